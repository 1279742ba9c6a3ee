"""Variance of the cross-entropy estimate of sampled and head + tail caches: exact formula beside measurement.

    .venv/bin/python bench/estimator_variance.py [--heldout-docs 5] [--seeds 64] [--write-docs]

A sampled or headtail cache stores an unbiased estimate p_hat of the teacher row p (docs/losses.md,
"Exact head, sampled tail"), so the cross entropy a student q trains on, -sum_j p_hat_j log q_j, is
an estimate of -sum_j p_j log q_j whose per-position variance is

    sampled N draws:        Var_{j ~ p}(log q_j) / N
    head K + tail N draws:  R^2 Var_{j ~ p_tail}(log q_j) / N     (R: the tail mass, p_tail: p outside the head / R)

This bench takes the toy teacher and the held-out documents of bench/quality.py (its helpers,
imported: the same toy setup in the same --workdir and its held-out file, the first --heldout-docs
documents), runs the teacher (transformers, CPU, float32, each document in one forward) and, for each
estimator, computes both the exact mean variance above (float64, from the teacher's logits) and the
variance measured over --seeds independent draws made by the product's code:
`stage1_teacher.capture.head.distill_targets` (what `teacher-dump` stores, a seeded generator per draw) turned
into p_hat by `stage2_student.losses.teacher_logprobs` (what every distribution loss reads). The
student q is the teacher itself at T = 2. Prints a markdown table; `--write-docs` writes it into
docs/losses.md's `estimator-variance` block, stamped with the command (xtcache.app.docblock).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.quality import Settings, first_docs, load_model  # noqa: E402

DOC_BLOCKS = {"estimator-variance": "docs/losses.md"}  # --write-docs: block -> file
STUDENT_T = 2.0  # q: the teacher at this temperature stands in for the student
log = logging.getLogger("bench.estimator_variance")


@dataclass(frozen=True)
class Estimator:
    name: str
    mode: str  # sampled | headtail
    head: int  # K: exact head width (0 for sampled)
    draws: int  # N: draws per position (the tail's, for headtail)


ESTIMATORS = [Estimator("sampled n=16", "sampled", 0, 16), Estimator("sampled n=64", "sampled", 0, 64),
              *(Estimator(f"head {k} + tail {n}", "headtail", k, n) for k, n in ((2, 16), (4, 12), (4, 16), (8, 16)))]


@dataclass(frozen=True)
class TeacherRows:
    """The teacher's next-token logits on the held-out documents, one row per predicted position."""

    logits: object  # torch float32 [P, V_model] (the lm_head's padding columns last)
    targets: object  # numpy int64 [P]: the next token of each position
    vocab: int  # V: the tokenizer's ids (columns at or beyond it are never stored)
    docs: int


def teacher_rows(workdir: Path, n_docs: int) -> TeacherRows:
    """The quality bench's toy teacher on the first `n_docs` of its held-out documents."""
    import numpy as np
    import torch

    from xtcache.align.tokenizer import encode_flat
    from xtcache.app.demo.setup import SIZES, toy_spec
    from xtcache.testing import toy
    from xtcache.tokenizer import load_tokenizer

    setup = toy.build_toy_setup(workdir / "artifacts", toy_spec(SIZES["default"]))
    s = Settings()
    held = first_docs(setup.heldout_jsonl, workdir / "quality" / "data" / f"heldout-d{s.train_docs}-h{s.heldout_docs}.jsonl",
                      max(n_docs, s.heldout_docs))
    texts = [json.loads(line)["text"] for line in held.read_text(encoding="utf-8").splitlines()[:n_docs]]
    tok = load_tokenizer(setup.teacher_tokenizer)
    ids, _, counts = encode_flat(tok, texts, add_special_tokens=True, side="teacher")
    model = load_model(setup.teacher_model).eval()
    limit = model.config.max_position_embeddings
    if counts.max() > limit:
        raise SystemExit(f"--heldout-docs {n_docs}: a document has {counts.max()} teacher tokens, more than the "
                         f"teacher's {limit} positions; take fewer documents")
    logits, targets = [], []
    with torch.no_grad():
        for doc in np.split(ids, np.cumsum(counts)[:-1]):
            logits.append(model(input_ids=torch.as_tensor(doc)[None]).logits[0, :-1].float())  # [L - 1, V_model]
            targets.append(doc[1:])
    return TeacherRows(torch.cat(logits), np.concatenate(targets), len(tok), n_docs)


def batch_layout(t, head: int):
    """(ids, log-probs, counts, residual) of `distill_targets` output as a stage-2 micro-batch holds them
    (`stage2_student.batches.drawn_targets`), in float64."""
    import torch

    from stage2_student.batches import drawn_targets

    b = drawn_targets(t.ids.astype("int64"), t.logprobs if head else None, t.counts.astype("float32"))
    lp = torch.from_numpy(b["teacher_logprobs"]).double() if head else None
    return (torch.from_numpy(b["teacher_ids"]), lp, torch.from_numpy(b["teacher_counts"]).double(),
            torch.from_numpy(t.residual).double())


def exact(rows: TeacherRows, est: Estimator, log_q) -> dict:
    """The estimator's exact per-position variance, tail mass and expected CE (float64, from the logits)."""
    import torch

    z = rows.logits.double()
    p = torch.softmax(z, dim=-1)[:, :rows.vocab]  # [P, V]: T = 1 over every column, the padding never drawn
    if est.mode == "sampled":  # draws from the tokenizer's ids, renormalised over them
        drawn, weight = p / p.sum(-1, keepdim=True), torch.ones(len(p), dtype=torch.float64)
        head = torch.zeros_like(p)
    else:
        top = torch.topk(p, est.head, dim=-1).indices  # [P, K]
        tail = p.scatter(1, top, 0.0)
        weight = tail.sum(-1)  # R [P]
        drawn = tail / weight.clamp(min=1e-300)[:, None]
        head = p - tail
    mean = (drawn * log_q).sum(-1)  # E_{j ~ drawn}(log q_j) [P]
    var = (drawn * (log_q - mean[:, None]) ** 2).sum(-1)  # [P]
    return {"var": (weight ** 2 * var / est.draws), "R": weight,
            "ce": -(head * log_q).sum(-1) - weight * mean}


def measured(rows: TeacherRows, est: Estimator, log_q, seeds: int) -> dict:
    """The CE estimate over `seeds` independent draws of the product's targets: per-position mean and variance."""
    import torch

    from stage1_teacher.capture.head import distill_targets
    from stage2_student.losses import teacher_logprobs

    total = torch.zeros(len(rows.targets), dtype=torch.float64)
    square = torch.zeros_like(total)
    stored = 0.0
    for seed in range(seeds):
        t = distill_targets(rows.logits, rows.targets, mode=est.mode, k=est.head, vocab_size=rows.vocab,
                            num_samples=est.draws, generator=torch.Generator().manual_seed(seed))
        ids, lp, counts, residual = batch_layout(t, est.head)
        log_p_hat, rest = teacher_logprobs(ids, lp, counts, residual, torch.float64)  # [P, k], [P]
        assert not rest.any()
        valid = ids >= 0
        ce = -torch.where(valid, log_p_hat.exp() * log_q.gather(1, ids.clamp(min=0)), 0.0).sum(-1)  # [P]
        total += ce
        square += ce ** 2
        stored += float(valid.sum(-1).double().mean()) / seeds
    mean = total / seeds
    return {"var": (square - seeds * mean ** 2) / (seeds - 1), "ce": mean, "width": t.ids.shape[1], "stored": stored}


def run(args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    rows = teacher_rows(Path(args.workdir), args.heldout_docs)
    log.info("teacher on %d documents: %d positions (%.0f s)", rows.docs, len(rows.targets), time.perf_counter() - t0)
    log_q = torch.log_softmax(rows.logits[:, :rows.vocab].double() / STUDENT_T, dim=-1)  # [P, V]
    log_p = torch.log_softmax(rows.logits.double(), dim=-1)
    entropy = float(-(log_p.exp() * log_p).sum(-1).mean())
    results = []
    for est in ESTIMATORS:
        t1 = time.perf_counter()
        ex, me = exact(rows, est, log_q), measured(rows, est, log_q, args.seeds)
        results.append({"estimator": est.name, "width": me["width"], "stored": me["stored"],
                        "mean_R": float(ex["R"].mean()), "var_exact": float(ex["var"].mean()),
                        "var_measured": float(me["var"].mean()), "ce_exact": float(ex["ce"].mean()),
                        "ce_measured": float(me["ce"].mean())})
        log.info("%s: %s (%.0f s)", est.name, results[-1], time.perf_counter() - t1)
    return {"positions": len(rows.targets), "docs": rows.docs, "vocab": rows.vocab, "seeds": args.seeds,
            "entropy": entropy, "results": results, "wall_s": time.perf_counter() - t0}


def markdown(report: dict) -> str:
    lines = [f"Teacher: the toy teacher of `bench/quality.py` (vocabulary {report['vocab']:,}, mean entropy "
             f"{report['entropy']:.2f} nats) on {report['positions']:,} positions of its first {report['docs']} "
             f"held-out documents. Student q: the teacher itself at T = {STUDENT_T:g}. Per estimator, the "
             f"per-position variance of the CE estimate `-sum_j p̂_j log q_j`, averaged over positions: exact (the "
             f"formulas above) and measured over {report['seeds']} independent draws of the stored targets "
             f"(`distill_targets`, then `teacher_logprobs`); the mean CE estimate beside its exact expectation.",
             "",
             "| estimator | ids/position (slots) | distinct ids stored | mean R | Var exact | Var measured | "
             "measured / exact | mean CE estimate (exact) |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in report["results"]:
        lines.append(f"| {r['estimator']} | {r['width']} | {r['stored']:.1f} | {r['mean_R']:.3f} | "
                     f"{r['var_exact']:.4f} | {r['var_measured']:.4f} | {r['var_measured'] / r['var_exact']:.3f} | "
                     f"{r['ce_measured']:.4f} ({r['ce_exact']:.4f}) |")
    lines += ["", "Slots: the store's ids per position (schemas `support_width`); distinct ids: the slots in use, on "
              "average (the head's and one per distinct drawn id). mean R: the mass the draws stand for (the tail's; 1 for sampled). A sampled "
              "estimate's expectation is the CE of p renormalised over the tokenizer's ids (the lm_head's padding "
              "columns are never drawn), hence its slightly different exact CE."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workdir", default=str(REPO / ".xtcache_bench_cache"),
                   help="the quality bench's toy artifacts (reused; built when missing)")
    p.add_argument("--heldout-docs", type=int, default=5, help="the first N held-out documents (default 5)")
    p.add_argument("--seeds", type=int, default=64, help="independent draws per estimator (default 64)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    p.add_argument("--write-docs", action="store_true",
                   help="also write the table into docs/losses.md's estimator-variance block (xtcache.app.docblock)")
    args = p.parse_args(argv)
    if args.heldout_docs < 1 or args.seeds < 2:
        p.error(f"--heldout-docs {args.heldout_docs} --seeds {args.seeds}: need at least 1 document and 2 seeds")
    if args.write_docs:
        from xtcache.app.docblock import require_blocks

        require_blocks(REPO, DOC_BLOCKS)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    for name in ("stage1_teacher", "stage2_student", "xtcache", "torch", "transformers"):
        logging.getLogger(name).setLevel(logging.WARNING)
    report = run(args)
    md = markdown(report)
    print(md)
    log.info("%.0f s", report["wall_s"])
    if args.write_docs:
        from xtcache.app.docblock import write_block

        write_block(REPO / DOC_BLOCKS["estimator-variance"], "estimator-variance", md)


if __name__ == "__main__":
    main()
