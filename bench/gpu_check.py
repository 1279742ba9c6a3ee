"""GPU smoke check: both stages end to end on a tiny teacher and student, on one device, one table.

On any machine with one CUDA GPU (`make gpu-check`), in a few minutes:

  1. builds the test suite's toy setup (two BPE tokenizers, a tiny Qwen2 teacher, a tiny Llama
     student; cached in .xtcache_test_cache) from text already on the machine;
  2. vLLM forward only (`generate(max_tokens=1)`) over the held-out windows: the engine's ceiling;
  3. `teacher-dump` on the vLLM fast path over the same documents (teacher in bf16 on CUDA): its
     capture rate, and its first-batch check of the hidden-state path against vLLM's own prompt
     log-probs (largest and mean |log-prob gap|, the tolerance derived from the logit scale);
  4. `train-student` (DeepSpeed ZeRO-2, bf16 on CUDA, projected KL across the two tokenizers):
     step time and the peak device memory of the training process;

and prints the table that docs/gpu.md quotes. `--device cpu` runs the
same steps on the CPU in float32 (tests/test_gpu_check.py runs it in the suite); the table says
which device produced it.

    .venv/bin/python bench/gpu_check.py [--device cuda|cpu] [--docs 64] [--steps 20] [--workdir .xtcache_gpu_check]
        [--write-docs]      # with --device cuda: also writes the table into docs/gpu.md's `gpu-check` block
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

DOC_BLOCKS = {"gpu-check": "docs/gpu.md"}  # --write-docs (GPU runs only): block -> file


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cuda: the first visible GPU (refused without one); cpu: hide every GPU, float32")
    p.add_argument("--docs", type=int, default=64, help="held-out documents captured and timed")
    p.add_argument("--steps", type=int, default=20, help="student optimizer steps")
    p.add_argument("--top-k", type=int, default=16)
    p.add_argument("--max-seq-len", type=int, default=256)
    p.add_argument("--workdir", default=str(REPO / ".xtcache_gpu_check"))
    p.add_argument("--write-docs", action="store_true",
                   help="with --device cuda: also write the table into docs/gpu.md (gpu-check); a CPU run only prints")
    return p.parse_args(argv)


def device_setup(device: str) -> tuple[str, str]:
    """(dtype, device name) after pinning this process and its children to `device`."""
    from xtcache.devices import cuda_present

    if device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        return "float32", "CPU"
    if not cuda_present():
        raise SystemExit("gpu_check --device cuda: no CUDA device is visible (nvidia-smi, CUDA_VISIBLE_DEVICES); "
                         "use --device cpu to run the same steps on the CPU")
    from vllm.platforms import current_platform

    return "bfloat16", current_platform.get_device_name(0)


def capture(setup, teacher: str, args, dtype: str, work: Path) -> dict:
    """vLLM forward only, then teacher-dump on the same documents; both rates and the check record."""
    from bench.teacher_dump import bench_dump, bench_vllm_generate, corpus_windows
    from stage1_teacher.capture.budget import device_memory_used, wait_for_release

    texts = [json.loads(line)["text"] for line in Path(setup.heldout_jsonl).read_text().splitlines()][:args.docs]
    corpus = work / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    windows = corpus_windows(teacher, texts, args.max_seq_len)
    before = device_memory_used(1)  # None off CUDA
    forward = bench_vllm_generate(teacher, windows, args.top_k, args.max_seq_len, dtype)
    # the forward-only engine's memory must be back before teacher-dump's preflight reads what is free
    wait_for_release(before, lambda: device_memory_used(1))
    store = work / "store"
    if store.exists():
        import shutil

        shutil.rmtree(store)
    dump = bench_dump(teacher, str(setup.student_tokenizer), str(corpus), args.top_k, args.max_seq_len, dtype,
                      str(store))
    (record,) = [json.loads(p.read_text()) for p in (store / "capture_checks").glob("*.json")]
    return {"forward": forward["a"], "capture": dump["d"], "check": record, "store": store,
            "positions": dump["summary"].positions, "path": dump["summary"].capture_path}


def train(setup, store: Path, args, dtype: str, work: Path) -> dict:
    """train-student on the dump (projected KL, ZeRO-2) in a subprocess (its memory is its own, as it is
    on a GPU after vLLM's): its summary. The projection (`xtcache projection build`'s defaults) is built here."""
    from xtcache.projection import build_projection
    from xtcache.tokenizer import load_tokenizer

    out = work / "student"
    projection = work / "projection.safetensors"
    pm = build_projection(load_tokenizer(str(setup.student_tokenizer)), load_tokenizer(str(setup.teacher_tokenizer)))
    pm.save(projection)
    cmd = [sys.executable, "-m", "xtcache.app.cli", "train-student", "--cache", str(store), "--student",
           str(setup.student_model), "--out", str(out), "--projection", str(projection), "--loss", "pkl",
           "--seq-len", "128", "--micro-batch-size", "8", "--max-steps", str(args.steps), "--warmup-steps", "2", "--eval-every", "0", "--zero-stage", "2",
           "--seed", "0", "--bf16" if dtype == "bfloat16" else "--no-bf16"]
    subprocess.run(cmd, check=True, cwd=REPO)
    return json.loads((out / "summary.json").read_text())


def table(device_name: str, dtype: str, cap: dict, summary: dict) -> str:
    chk = cap["check"]
    peak = summary.get("peak_memory_mib")
    rows = [
        ("device", device_name),
        ("teacher dtype", dtype),
        ("vLLM forward only, positions/s", f"{cap['forward']:,.0f}"),
        ("teacher-dump capture, positions/s", f"{cap['capture']:,.0f}"),
        ("capture / forward only", f"{cap['capture'] / cap['forward']:.2f}"),
        ("capture path", cap["path"]),
        ("first-batch check: max / mean |log-prob gap|", f"{chk['max_gap']:.3g} / {chk.get('mean_gap') or 0:.3g}"),
        ("check tolerance: max / mean (largest logit)",
         f"{chk['tolerance']:.3g} / {chk.get('mean_tolerance') or 0:.3g} ({chk.get('logit_max') or 0:.1f})"),
        ("check platform, model runner", f"{chk.get('platform')}, {chk.get('model_runner')}"),
        ("train-student step time, s (P-KL, ZeRO-2)", f"{1 / summary['steps_per_s']:.3f}"),
        ("train-student peak memory, MiB", f"{peak:,.0f} ({summary.get('peak_memory_kind', '?')})" if peak else "-"),
    ]
    width = max(len(r[0]) for r in rows)
    return "\n".join([f"| {'gpu_check':<{width}} | value |", f"| {'-' * width} | --- |"] +
                     [f"| {k:<{width}} | {v} |" for k, v in rows])


def main(argv=None) -> None:
    args = parse_args(argv)
    dtype, device_name = device_setup(args.device)
    if args.write_docs and args.device == "cuda":
        from xtcache.app.docblock import require_blocks

        require_blocks(REPO, DOC_BLOCKS)
    from xtcache.testing import toy
    from xtcache.testing.suite import TEST_CACHE, TEST_SPEC
    from xtcache.testing.toy_teacher import build_vllm_teacher

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    setup = toy.build_toy_setup(TEST_CACHE, TEST_SPEC)  # the test suite's setup, built once
    teacher = str(build_vllm_teacher(setup.root))
    cap = capture(setup, teacher, args, dtype, work)
    summary = train(setup, cap["store"], args, dtype, work)
    head = (f"$ python bench/gpu_check.py --device {args.device} --docs {args.docs} --steps {args.steps}  "
            f"({time.strftime('%Y-%m-%d')}, {time.perf_counter() - t0:.0f} s in all, {cap['positions']:,} positions)")
    print("\n" + head)
    print(table(device_name, dtype, cap, summary), flush=True)
    if args.write_docs:
        write_docs(args.device, device_name, head, table(device_name, dtype, cap, summary))


def write_docs(device: str, device_name: str, head: str, text: str) -> None:
    """docs/gpu.md's gpu-check block holds GPU runs only: a CPU run says so and writes nothing."""
    if device != "cuda":
        print("--write-docs: not written: docs/gpu.md's gpu-check block holds GPU runs only (this run: --device cpu)")
        return
    from xtcache.app.docblock import write_block

    write_block(REPO / "docs" / "gpu.md", "gpu-check", head + "\n\n" + text, gpu=device_name)


if __name__ == "__main__":
    main()
