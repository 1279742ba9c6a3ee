"""The teacher's lm_head in each compute dtype against the first-batch check's tolerance and the budget.

    .venv/bin/python bench/head_dtype.py [--teacher toy|real] [--windows 4] [--window-len 256] [--write-docs]

For the toy teacher (the test suite's tiny Qwen2, 2,048 ids) or the real one (SmolLM2-135M-Instruct,
49,152 ids, `xtcache.testing.real`), on held-out text: transformers runs the teacher in float32 and
gives its logits (the exact reference) and its final hidden states; `TeacherHead` then makes the
logits from those hidden states in float32, bfloat16 and float16, as the capture's fast path does
(hidden states cast to the head's dtype, one matmul, float32 log-softmax). Each row reports the
largest and mean |log-prob gap| to the reference at the reference's top-64 ids and the realized next
tokens (the entries the first-batch check compares), and the check's default tolerance for that dtype
at the largest logit seen (`stage1_teacher.capture.run.default_tolerance`). The check's own reference
is vLLM's prompt log-probs, which round to the engine's dtype too: the tolerance must hold both
roundings, so a head dtype passes here only with room to spare.

`head_memory` (used by bench/gpu_check.py) runs `distill_targets` on the device in each capture mode
and compares the peak memory of its logit blocks with the budget's figure for them
(`stage1_teacher.capture.budget`); on a CPU there is no peak to read and only the targets are made.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

DOC_BLOCKS = {"head-dtype-toy": "docs/gpu.md", "head-dtype-real": "docs/gpu.md"}  # --write-docs: one per --teacher
DTYPES = ("float32", "bfloat16", "float16")
CHECK_K = 64  # ids per row the reference compares (the first-batch check's top-k)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--teacher", choices=["toy", "real"], default="toy")
    p.add_argument("--windows", type=int, default=4, help="held-out windows compared")
    p.add_argument("--window-len", type=int, default=256)
    p.add_argument("--write-docs", action="store_true", help="write the table into docs/gpu.md (head-dtype-<teacher>)")
    return p.parse_args(argv)


def teacher_and_texts(which: str) -> tuple[str, list[str]]:
    """(teacher directory, held-out texts) of the toy or the real tier."""
    if which == "real":
        from xtcache.testing.real import build_real_models

        models = build_real_models()
        teacher, heldout = models.teacher, models.heldout_jsonl
    else:
        from xtcache.testing import toy
        from xtcache.testing.suite import TEST_CACHE, TEST_SPEC
        from xtcache.testing.toy_teacher import build_vllm_teacher

        setup = toy.build_toy_setup(TEST_CACHE, TEST_SPEC)
        teacher, heldout = build_vllm_teacher(setup.root), setup.heldout_jsonl
    texts = [json.loads(line)["text"] for line in Path(heldout).read_text().splitlines() if line.strip()]
    return str(teacher), texts


def reference(teacher: str, texts: list[str], windows: int, window_len: int, device: str) -> list[dict]:
    """Per window: float32 hidden states [L-1, H], reference log-probs at the compared ids, those ids."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(teacher)
    model = AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32).to(device).eval()
    ids = [t for text in texts for t in tok(text)["input_ids"]]
    out = []
    with torch.no_grad():
        for w in range(windows):
            window = ids[w * window_len:(w + 1) * window_len]
            if len(window) < 2:
                break
            res = model(torch.tensor([window], device=device), output_hidden_states=True)
            logits, hidden = res.logits[0, :-1].float(), res.hidden_states[-1][0, :-1].float()
            lp = torch.log_softmax(logits, dim=-1)
            top = torch.topk(lp, CHECK_K, dim=-1).indices
            cols = torch.cat([top, torch.tensor(window[1:], device=device)[:, None]], dim=1)  # + realized token
            out.append({"hidden": hidden, "ids": cols.cpu().numpy().astype(np.int64),
                        "logprobs": lp.gather(1, cols).cpu().numpy()})
    del model
    return out


def head_gaps(teacher: str, ref: list[dict], dtype: str, device: str) -> dict:
    """The head in `dtype` against the float32 reference: gaps, largest logit, the check's tolerance."""
    import numpy as np
    import torch

    from stage1_teacher.capture.head import TeacherHead
    from stage1_teacher.capture.run import default_tolerance, head_rows_logprobs

    head = TeacherHead.load(teacher, device, dtype=getattr(torch, dtype))
    gap, total, count, zmax = 0.0, 0.0, 0, 0.0
    for w in ref:
        lp, z = head_rows_logprobs(head, w["hidden"], w["ids"])
        diff = np.abs(lp - w["logprobs"])
        gap, total, count, zmax = max(gap, float(diff.max())), total + float(diff.sum()), count + diff.size, max(zmax, z)
    tol, mean_tol = default_tolerance(dtype, zmax)
    mean = total / max(1, count)
    return {"dtype": dtype, "max_gap": gap, "mean_gap": mean, "logit_max": zmax, "tolerance": tol,
            "mean_tolerance": mean_tol, "passes": gap <= tol and mean <= mean_tol,
            "margin": min(tol / max(gap, 1e-12), mean_tol / max(mean, 1e-12))}


def head_memory(teacher: str, ref: list[dict], dtype: str, device: str, modes: dict[str, dict]) -> list[dict]:
    """distill_targets in each mode (name -> k, num_samples) with the head on `device`: seconds, and on
    CUDA the peak bytes of the logit blocks above what was allocated before, against the budget's term."""
    import numpy as np
    import torch

    from stage1_teacher.capture.budget import Run, block_bytes
    from stage1_teacher.capture.head import TeacherHead, distill_targets

    head = TeacherHead.load(teacher, device, dtype=getattr(torch, dtype))
    hidden = torch.cat([w["hidden"] for w in ref]).to(device)
    targets = np.concatenate([w["ids"][:, -1] for w in ref])
    V, H = head.model_vocab, int(hidden.shape[1])
    cuda = torch.device(device).type == "cuda"
    rows = []
    for mode, opts in modes.items():
        gen = torch.Generator(device=device).manual_seed(0)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        out = distill_targets(hidden, targets, mode=mode, k=opts["k"], vocab_size=V,
                              num_samples=opts.get("num_samples", 0), generator=gen, head=head)
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        assert np.isfinite(out.realized).all(), f"{mode}: non-finite realized log-probs"
        peak = torch.cuda.max_memory_allocated() - base if cuda else None
        rows.append({"mode": mode, "positions_per_s": len(targets) / seconds, "peak_bytes": peak,
                     "budget_bytes": block_bytes(mode, V, H, Run(dtype=dtype).head_bytes(), reference_check=False,
                                                 rows=len(targets))})  # a block holds every row here when fewer
    return rows


def table(which: str, gaps: list[dict]) -> str:
    lines = [f"| {which} teacher: head dtype | max / mean gap | tolerance max / mean (largest logit) | margin | passes |",
             "| --- | ---: | ---: | ---: | --- |"]
    for g in gaps:
        lines.append(f"| {g['dtype']} | {g['max_gap']:.3g} / {g['mean_gap']:.3g} | {g['tolerance']:.3g} / "
                     f"{g['mean_tolerance']:.3g} ({g['logit_max']:.1f}) | {g['margin']:.1f}x | "
                     f"{'yes' if g['passes'] else 'NO'} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.write_docs:
        from xtcache.app.docblock import require_blocks

        require_blocks(REPO, {f"head-dtype-{args.teacher}": DOC_BLOCKS[f"head-dtype-{args.teacher}"]})
    teacher, texts = teacher_and_texts(args.teacher)
    ref = reference(teacher, texts, args.windows, args.window_len, "cpu")
    gaps = [head_gaps(teacher, ref, dtype, "cpu") for dtype in DTYPES]
    positions = sum(len(w["ids"]) for w in ref)
    head = (f"$ python bench/head_dtype.py --teacher {args.teacher} --windows {args.windows} --window-len "
            f"{args.window_len}  ({time.strftime('%Y-%m-%d')}, CPU, {positions:,} positions, {CHECK_K} ids + the "
            "realized token per position)")
    text = table(args.teacher, gaps)
    print("\n" + head + "\n" + text, flush=True)
    if args.write_docs:
        from xtcache.app.docblock import write_block

        write_block(REPO / "docs" / "gpu.md", f"head-dtype-{args.teacher}", head + "\n\n" + text)


if __name__ == "__main__":
    main()
