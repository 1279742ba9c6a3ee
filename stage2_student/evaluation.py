"""Held-out evaluation of a stage 2 run: the KL to the teacher, the training objective, CE, top-1 agreement.

    row = evaluate(trainer)    # every rank calls it; one metrics.jsonl row {"kind": "eval", ...}

`kl` is the same measure for every run, whatever the training loss (CE, KL, P-KL, ALM...): the
measure `Objective` of `stage2_student.data` at T = 1, summed over the held-out chunks and divided
by their number; `kl_definition` states what it is for this cache (over the cached support plus
a rest bucket: a lower bound; over the full vocabulary for full caches). The training
objective's KD term is reported next to it under its own name (`kl`, `pkl`, `alm`, ...:
`objective_kd_name`, value `objective_kd`).
"""

from __future__ import annotations

from stage2_student.student import dummy_batch, model_inputs, to_device


def _same_measure(objective, measure) -> bool:
    kind = "kl" if objective.kind == "sampled" else objective.kind
    return measure is not None and kind == measure.kind and objective.spec.temperature == 1.0


def evaluate(trainer) -> dict | None:
    """One pass over this rank's held-out micro-batches (every rank runs the same forwards)."""
    import torch

    data = trainer.data
    if data.make_eval is None:
        return None
    obj, measure = data.objective, data.measure
    trainer.engine.eval()
    sums = torch.zeros(7, dtype=torch.float64, device=trainer.device)
    it = iter(data.make_eval())
    last = None
    budget = trainer.cfg.eval.eval_batches or 10**12
    with torch.no_grad():
        for _ in range(budget):
            batch = next(it, None)
            if not trainer.all_reduce([float(batch is not None)])[0]:
                break
            # a rank out of held-out batches repeats a forward at weight 0 (ZeRO-3 gathers in lockstep)
            last = batch if batch is not None else (last or dummy_batch(trainer.tokenizer))
            logits = trainer.engine(**model_inputs(to_device(last, trainer.device))).logits
            prep = obj.prepare(last, vocab=logits.shape[-1]).to(trainer.device)
            kd, ce = obj.sums(logits, prep)
            kl = agree = agree_n = torch.zeros((), dtype=torch.float64, device=trainer.device)
            if measure is not None:
                m_prep = prep if _same_measure(obj, measure) else measure.prepare(last, vocab=logits.shape[-1]).to(
                    trainer.device)
                kl = kd if m_prep is prep else measure.sums(logits, m_prep)[0]
                agree, agree_n = measure.agreement(logits, m_prep)
            if batch is not None:
                chunks, tokens = obj.counts(last)
                sums += torch.stack([kd.double(), ce.double(), kl.double(), agree.double(), agree_n.double(),
                                     torch.tensor(float(chunks), dtype=torch.float64, device=sums.device),
                                     torch.tensor(float(tokens), dtype=torch.float64, device=sums.device)])
    kd, ce, kl, agree, agree_n, chunks, tokens = trainer.all_reduce(sums.tolist())
    trainer.engine.train()
    row = {"kind": "eval", "step": trainer.step, "ce": ce / tokens if tokens else None,
           "kl": kl / chunks if (chunks and measure is not None) else None, "kl_definition": data.measure_definition,
           "objective_kd_name": obj.kind, "objective_kd": kd / chunks if (chunks and obj.kind) else None,
           "top1_agree": agree / agree_n if agree_n else None, "chunks": chunks, "tokens": tokens}
    return row
