"""Held-out evaluation of a stage 2 run: the KL to the teacher(s), the training objective, CE, top-1 agreement.

    row = evaluate(trainer)    # every rank calls it; one metrics.jsonl row {"kind": "eval", ...}

`kl` is the same measure for every run, whatever the training loss (CE, KL, P-KL, ALM...): the
measure `Objective` of `stage2_student.data` at T = 1, summed over the held-out chunks and divided
by their number; `kl_definition` states what it is for this cache (over the cached support plus
a rest bucket: a lower bound; over the full vocabulary for full caches). The training
objective's KD term is reported next to it under its own name (`kl`, `pkl`, `alm`, ...:
`objective_kd_name`, value `objective_kd`).

Several teachers: `teacher{i}_kl` and `teacher{i}_top1_agree` per teacher (its measure over its
own valid chunks), and `mixture_kl` (teachers sharing one tokenizer: the KL to their mixture
sum_i lambda_i p_i with the --teacher-weights) which is then also `kl`; otherwise `kl` is None.
"""

from __future__ import annotations

from stage2_student.join import num_teachers, teacher_view
from stage2_student.mix import mix_views
from stage2_student.student import dummy_batch, model_inputs, to_device


def same_measure(objective, measure) -> bool:
    """The training objective's KD term on a held-out batch is the measure itself (same kind, temperature,
    teacher tail, projection, divergence and chunk rows): its value is reused, not computed again."""
    return measure is not None and objective.spec == measure.spec and objective.chunk_rows == measure.chunk_rows


def evaluate(trainer) -> dict | None:
    """One pass over this rank's held-out micro-batches (every rank runs the same forwards)."""
    import torch

    data = trainer.data
    if data.make_eval is None:
        return None
    obj, measures, mixture = data.objective, data.measures, data.mixture_measure
    n = len(measures)
    reuse = obj.combine != "mean-probs"
    trainer.engine.eval()
    # kd, ce, groups, tokens, then per teacher (kl, agree, agree_n, chunks), then mixture (kl, chunks)
    sums = torch.zeros(4 + 4 * n + 2, dtype=torch.float64, device=trainer.device)
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
            vocab = logits.shape[-1]
            # rkl-pg without its ratio: a held-out cache is text the student did not sample (a corpus cache
            # holds no sampling log-probs), so its objective value there is the chunks' mean log-ratio
            prep = obj.prepare(last, vocab=vocab, ratio=False).to(trainer.device)
            kd_g, ce = obj.terms(logits, prep)
            kd = (obj.weights(prep).to(kd_g.dtype) * kd_g).sum()
            zero = torch.zeros((), dtype=torch.float64, device=trainer.device)
            vals = [kd.double(), ce.double()]
            for i, measure in enumerate(measures):
                kl = agree = agree_n = chunks_i = zero
                if measure is not None:
                    sub, p = (obj.objectives[i], prep.preps[i]) if reuse else (None, None)
                    if sub is not None and same_measure(sub, measure):
                        m_prep, kl = p, kd_g[i].sum()
                    else:
                        m_prep = measure.prepare(teacher_view(last, i), vocab=vocab).to(trainer.device)
                        kl = measure.sums(logits, m_prep)[0]
                    agree, agree_n = measure.agreement(logits, m_prep)
                    chunks_i = zero + float(m_prep.chunks)
                vals += [kl.double(), agree.double(), agree_n.double(), chunks_i]
            mix_kl = mix_chunks = zero
            if mixture is not None and "teacher_ids" in last:
                view = mix_views([teacher_view(last, i) for i in range(num_teachers(last))], obj.lam)
                m_prep = mixture.prepare(view, vocab=vocab).to(trainer.device)
                mix_kl, mix_chunks = mixture.sums(logits, m_prep)[0].double(), zero + float(m_prep.chunks)
            if batch is not None:
                groups, tokens = obj.counts(last)
                sums += torch.stack(vals[:2] + [zero + float(groups), zero + float(tokens)] + vals[2:]
                                    + [mix_kl, mix_chunks])
    tot = trainer.all_reduce(sums.tolist())
    kd, ce, groups, tokens = tot[:4]
    per = [tot[4 + 4 * i:8 + 4 * i] for i in range(n)]
    mix_kl, mix_chunks = tot[-2:]
    trainer.engine.train()

    def ratio(a, b):
        return a / b if b else None

    row = {"kind": "eval", "step": trainer.step, "ce": ratio(ce, tokens),
           "kl_definition": data.measure_definition, "objective_kd_name": obj.kind,
           "objective_kd": kd / groups if (groups and obj.kind) else None, "chunks": groups, "tokens": tokens}
    if n == 1:
        kl, agree, agree_n, chunks = per[0]
        row.update(kl=ratio(kl, chunks) if measures[0] is not None else None, top1_agree=ratio(agree, agree_n))
    else:
        for i, (kl, agree, agree_n, chunks) in enumerate(per):
            row[f"teacher{i}_kl"] = ratio(kl, chunks) if measures[i] is not None else None
            row[f"teacher{i}_top1_agree"] = ratio(agree, agree_n)
        row["mixture_kl"] = ratio(mix_kl, mix_chunks) if mixture is not None else None
        row["kl"], row["top1_agree"] = row["mixture_kl"], None
    return row
