"""GPU smoke check: both stages end to end on a tiny teacher and student, on one device, one table.

On a machine with one CUDA GPU (`make gpu-check`), in a few minutes, on the test suite's toy setup
(two BPE tokenizers, a tiny Qwen2 teacher, a tiny Llama student; built from text on the machine and
cached in .xtcache_test_cache):

  1. vLLM, where it imports: forward only (`generate(max_tokens=1)`) over the held-out windows (the
     engine's ceiling), then `teacher-dump` on the vLLM fast path over the same documents: its capture
     rate and its first-batch check (largest and mean |log-prob gap|, the tolerance from the logit
     scale). Without vLLM (a bare PyTorch machine) these rows say so and everything else runs;
  2. `teacher-dump --engine hf` (transformers) in every mode (top-k, full, sampled, head + tail) on the
     device, sampling with the device's own generators; each store is read back with every check on;
  3. the teacher's lm_head in the resolved compute dtype (bf16 on CUDA) against float32 transformers
     logits, with the first-batch check's tolerance (bench/head_dtype.py), and on CUDA the peak memory
     of the capture's logit blocks in each mode against the memory budget's figure for them;
  4. `train-student` (DeepSpeed ZeRO-2, bf16 on CUDA, projected KL across the two tokenizers) twice
     with `--deterministic` and the same seed: step time, peak device memory, and whether the two
     exported students are bit-identical;
  5. every module this process and the trainer import, by distribution, against the packages of a bare
     PyTorch GPU image plus `bench/gpu_wheels.py`'s wheels: one missing fails the check.

`--device cpu` runs the same steps on the CPU in float32 (tests/test_gpu_check.py runs it in the
suite with vLLM hidden); the table says which device produced it.

    .venv/bin/python bench/gpu_check.py [--device cuda|cpu] [--docs 64] [--steps 20] [--workdir .xtcache_gpu_check]
        [--write-docs]      # with --device cuda: also writes the table into docs/gpu.md's `gpu-check` block
    # a bare GPU machine without network: bench/gpu_wheels.py (the wheels, 14 MiB, and how to install them)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

DOC_BLOCKS = {"gpu-check": "docs/gpu.md"}  # --write-docs (GPU runs only): block -> file
HF_MODES = {"topk": {"k": 16}, "full": {"k": 0}, "sampled": {"k": 0, "num_samples": 32},
            "headtail": {"k": 8, "num_samples": 32}}  # teacher-dump --engine hf, and the head's blocks


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cuda: the first visible GPU (refused without one); cpu: hide every GPU, float32")
    p.add_argument("--docs", type=int, default=64, help="held-out documents captured and timed")
    p.add_argument("--steps", type=int, default=20,
                   help="student optimizer steps of each train-student run; 0: no train-student runs (their rows say so)")
    p.add_argument("--top-k", type=int, default=16)
    p.add_argument("--max-seq-len", type=int, default=256)
    p.add_argument("--workdir", default=str(REPO / ".xtcache_gpu_check"))
    p.add_argument("--write-docs", action="store_true",
                   help="with --device cuda: also write the table into docs/gpu.md (gpu-check); a CPU run only prints")
    args = p.parse_args(argv)
    if args.steps < 0:
        p.error(f"--steps {args.steps}: must be 0 (no train-student runs) or more")
    if args.steps == 0 and args.write_docs:
        p.error("--write-docs --steps 0: the docs' table has the train-student rows; give --steps 1 or more")
    return args


def device_setup(device: str) -> tuple[str, str]:
    """(dtype, torch device) after pinning this process and its children to `device`."""
    from xtcache.devices import cuda_present

    if device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        return "float32", "cpu"
    if not cuda_present():
        raise SystemExit("gpu_check --device cuda: no CUDA device is visible (nvidia-smi, CUDA_VISIBLE_DEVICES); "
                         "use --device cpu to run the same steps on the CPU")
    return "bfloat16", "cuda"


def vllm_version() -> str | None:
    """vLLM's version where it imports, else None (a bare PyTorch machine: its steps are skipped)."""
    try:
        import vllm
    except ImportError:
        return None
    return vllm.__version__


def vllm_capture(setup, teacher: str, corpus: Path, texts: list[str], args, dtype: str, work: Path) -> dict:
    """vLLM forward only, then teacher-dump on the fast path on the same documents: both rates, the check."""
    from bench.teacher_dump import bench_vllm_generate, corpus_windows
    from stage1_teacher.capture.budget import device_memory_used, wait_for_release

    windows = corpus_windows(teacher, texts, args.max_seq_len)
    before = device_memory_used(1)  # None off CUDA
    forward = bench_vllm_generate(teacher, windows, args.top_k, args.max_seq_len, dtype)
    # the forward-only engine's memory must be back before teacher-dump's preflight reads what is free
    wait_for_release(before, lambda: device_memory_used(1))
    s = dump(setup, teacher, corpus, work / "store", "vllm", "topk", args, dtype)
    (record,) = [json.loads(p.read_text()) for p in (work / "store" / "capture_checks").glob("*.json")]
    return {"forward": forward["a"], "capture": s.positions / s.capture_s, "check": record,
            "positions": s.positions, "path": s.capture_path}


def dump(setup, teacher: str, corpus: Path, out: Path, engine: str, mode: str, args, dtype: str, **opts):
    """`bench.teacher_dump.bench_dump` into a fresh `out`; the dump's summary."""
    from bench.teacher_dump import bench_dump

    if out.exists():
        shutil.rmtree(out)
    return bench_dump(teacher, str(setup.student_tokenizer), str(corpus), opts.get("k") or args.top_k, args.max_seq_len,
                      dtype, str(out), engine, mode, opts.get("num_samples", 64))["summary"]


def hf_captures(setup, teacher: str, corpus: Path, args, dtype: str, work: Path) -> dict:
    """teacher-dump --engine hf in every mode, each store read back with every check: mode -> row."""
    from xtcache.app.store_commands import verify_store

    out = {}
    for mode, opts in HF_MODES.items():
        s = dump(setup, teacher, corpus, work / f"hf-{mode}", "hf", mode, args, dtype, **opts)
        problems = verify_store(str(work / f"hf-{mode}"))
        if problems:
            raise SystemExit(f"gpu_check: the {mode} store of the transformers engine fails verify: {problems[0]}")
        out[mode] = {"rate": s.positions / s.capture_s, "bytes": s.bytes_written / max(1, s.positions)}
    return out


def head_rows(teacher: str, texts: list[str], dtype: str, device: str) -> dict:
    """The head in `dtype` on `device` against float32 transformers logits, and its blocks' memory per mode."""
    from bench.head_dtype import head_gaps, head_memory, reference

    ref = reference(teacher, texts, 2, 256, device)
    return {"gap": head_gaps(teacher, ref, dtype, device),
            "memory": head_memory(teacher, ref, dtype, device, HF_MODES)}


def train(setup, store: Path, args, dtype: str, out: Path) -> dict:
    """train-student on the dump (projected KL, ZeRO-2, --deterministic) in a subprocess (its memory is
    its own, as it is on a GPU after vLLM's): its summary. The projection (`xtcache projection build`'s
    defaults) is built once in the work directory."""
    from xtcache.projection import build_projection
    from xtcache.tokenizer import load_tokenizer

    projection = out.parent / "projection.safetensors"
    if not projection.exists():
        pm = build_projection(load_tokenizer(str(setup.student_tokenizer)), load_tokenizer(str(setup.teacher_tokenizer)))
        pm.save(projection)
    if out.exists():
        shutil.rmtree(out)
    cmd = [sys.executable, "-m", "xtcache.app.cli", "train-student", "--cache", str(store), "--student",
           str(setup.student_model), "--out", str(out), "--projection", str(projection), "--loss", "pkl",
           "--seq-len", "128", "--micro-batch-size", "8", "--max-steps", str(args.steps), "--warmup-steps", "2",
           "--eval-every", "0", "--zero-stage", "2", "--seed", "0", "--deterministic",
           "--bf16" if dtype == "bfloat16" else "--no-bf16"]
    subprocess.run(cmd, check=True, cwd=REPO)
    return json.loads((out / "summary.json").read_text())


def runtime_gap() -> dict | None:
    """On CUDA: NVML's total of device 0 as the budget reads it (`budget.nvml_memory`), the CUDA runtime's
    total, and the budget's estimate of the runtime's (`budget.runtime_total`); None on a CPU."""
    import torch

    from stage1_teacher.capture.budget import nvml_memory, physical_indices, runtime_total

    if not torch.cuda.is_available():
        return None
    ((nvml, _, _),) = nvml_memory(physical_indices(1))
    return {"nvml": nvml, "runtime": int(torch.cuda.mem_get_info(0)[1]), "estimate": runtime_total(nvml)}


def same_weights(a: Path, b: Path) -> bool:
    """True when the two exported students hold bit-identical tensors."""
    from safetensors.torch import load_file

    ta, tb = load_file(str(a / "hf" / "model.safetensors")), load_file(str(b / "hf" / "model.safetensors"))
    return ta.keys() == tb.keys() and all(ta[k].dtype == tb[k].dtype and ta[k].equal(tb[k]) for k in ta)


def missing_on_bare_image() -> list[str]:
    """Distributions a bare PyTorch GPU image plus bench/gpu_wheels.py's wheels would lack: those that the
    first-party modules loaded here (the trainer's included) import anywhere in their source, and the
    requirements of each wheel (read from the installed metadata). Optional extras (vLLM, s3fs) are not
    counted: the check runs without them."""
    import ast
    import importlib.metadata as md

    import stage2_student.trainer  # noqa: F401  (what train-student's process imports)
    from bench.gpu_wheels import BARE_IMAGE, MODULE_DISTRIBUTIONS, WHEELS, canonical

    first_party = ("xtcache", "stage1_teacher", "stage2_student", "schemas", "bench")
    names: set[str] = set()
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if (name.split(".")[0] not in first_party and name != "__main__") or not path or not path.endswith(".py"):
            continue
        for node in ast.walk(ast.parse(Path(path).read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module.split(".")[0])
    names -= set(sys.stdlib_module_names) | set(first_party) | OPTIONAL_MODULES
    by_module = md.packages_distributions()
    needed = {canonical(d) for n in names for d in by_module.get(n, [MODULE_DISTRIBUTIONS.get(n, n)])}
    for spec in WHEELS:
        for req in md.requires(spec.split("==")[0]) or []:
            if "extra ==" not in req and "sys_platform" not in req and "python_version <" not in req:
                needed.add(canonical(re.split(r"[\s<>=!~;\[(]", req, maxsplit=1)[0]))
    have = {canonical(n) for n in BARE_IMAGE} | {canonical(w.split("==")[0]) for w in WHEELS}
    return sorted(needed - have)


OPTIONAL_MODULES = {"vllm", "s3fs", "gguf"}  # extras: vLLM (skipped without it), s3 URLs, the real tier's GGUF


def table(device_name: str, dtype: str, vllm: str | None, cap: dict | None, hf: dict, head: dict, runs: list[dict],
          identical: bool | None, missing: list[str], mem: dict | None) -> str:
    gap = head["gap"]
    skipped = "not run: vLLM does not import here"
    rows = [("device", device_name), ("teacher dtype", dtype), ("vLLM", vllm or "absent")]
    if cap is not None:
        chk = cap["check"]
        rows += [
            ("vLLM forward only, positions/s", f"{cap['forward']:,.0f}"),
            ("teacher-dump capture, positions/s", f"{cap['capture']:,.0f}"),
            ("capture / forward only", f"{cap['capture'] / cap['forward']:.2f}"),
            ("capture path", cap["path"]),
            ("first-batch check: max / mean |log-prob gap|", f"{chk['max_gap']:.3g} / {chk.get('mean_gap') or 0:.3g}"),
            ("check tolerance: max / mean (largest logit)",
             f"{chk['tolerance']:.3g} / {chk.get('mean_tolerance') or 0:.3g} ({chk.get('logit_max') or 0:.1f})"),
            ("check platform, model runner", f"{chk.get('platform')}, {chk.get('model_runner')}")]
    else:
        rows += [("vLLM forward only, positions/s", skipped), ("teacher-dump capture, positions/s", skipped)]
    for mode, r in hf.items():
        rows.append((f"transformers engine, {mode}: positions/s, B/position", f"{r['rate']:,.0f}, {r['bytes']:.1f}"))
    rows.append((f"lm_head in {gap['dtype']} vs float32: max / mean log-prob gap",
                 f"{gap['max_gap']:.3g} / {gap['mean_gap']:.3g} (tolerance {gap['tolerance']:.3g} / "
                 f"{gap['mean_tolerance']:.3g}, {'passes' if gap['passes'] else 'FAILS'})"))
    for m in head["memory"]:
        peak_b = f"{m['peak_bytes'] / 2**20:,.1f}" if m["peak_bytes"] is not None else "-"
        rows.append((f"head blocks, {m['mode']}: positions/s, peak / budget MiB",
                     f"{m['positions_per_s']:,.0f}, {peak_b} / {m['budget_bytes'] / 2**20:,.1f}"))
    rows.append(("device memory total, MiB: NVML / CUDA runtime (budget's estimate)",
                 f"{mem['nvml'] / 2**20:,.0f} / {mem['runtime'] / 2**20:,.0f} ({mem['estimate'] / 2**20:,.0f})"
                 if mem else "-"))
    train_rows = ("train-student step time, s (P-KL, ZeRO-2)", "train-student peak memory, MiB",
                  "two --deterministic runs, same seed")
    if runs:
        summary = runs[0]
        peak = summary.get("peak_memory_mib")
        values = (f"{1 / summary['steps_per_s']:.3f}",
                  f"{peak:,.0f} ({summary.get('peak_memory_kind', '?')})" if peak else "-",
                  "bit-identical" if identical else "DIFFER")
    else:
        values = ("not run: --steps 0",) * len(train_rows)
    rows += zip(train_rows, values)
    rows.append(("imports outside a bare image + gpu_wheels", ", ".join(missing) or "none"))
    width = max(len(r[0]) for r in rows)
    return "\n".join([f"| {'gpu_check':<{width}} | value |", f"| {'-' * width} | --- |"] +
                     [f"| {k:<{width}} | {v} |" for k, v in rows])


def main(argv=None) -> None:
    args = parse_args(argv)
    dtype, device = device_setup(args.device)
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
    texts = [json.loads(line)["text"] for line in Path(setup.heldout_jsonl).read_text().splitlines()][:args.docs]
    corpus = work / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    vllm = vllm_version()
    cap = vllm_capture(setup, teacher, corpus, texts, args, dtype, work) if vllm else None  # first: nothing
    hf = hf_captures(setup, teacher, corpus, args, dtype, work)  # of xtcache has touched CUDA before vLLM
    head = head_rows(teacher, texts, dtype, device)
    store = work / ("store" if cap is not None else "hf-topk")
    runs = [train(setup, store, args, dtype, work / f"student{i}") for i in range(2)] if args.steps else []
    identical = same_weights(work / "student0", work / "student1") if runs else None
    missing = missing_on_bare_image()
    device_name = "CPU" if device == "cpu" else _cuda_name()
    positions = cap["positions"] if cap is not None else None
    stamp = (f"$ python bench/gpu_check.py --device {args.device} --docs {args.docs} --steps {args.steps}  "
             f"({time.strftime('%Y-%m-%d')}, {time.perf_counter() - t0:.0f} s in all"
             + (f", {positions:,} positions)" if positions else ")"))
    text = table(device_name, dtype, vllm, cap, hf, head, runs, identical, missing, runtime_gap())
    print("\n" + stamp)
    print(text, flush=True)
    if args.write_docs:
        write_docs(args.device, device_name, stamp, text)
    failed = [what for what, bad in (("the head's gap exceeds the check's tolerance", not head["gap"]["passes"]),
                                     ("two --deterministic runs differ", identical is False),
                                     (f"imports missing on a bare image: {', '.join(missing)}", bool(missing))) if bad]
    if failed:
        raise SystemExit("gpu_check: " + "; ".join(failed))


def _cuda_name() -> str:
    import torch

    return torch.cuda.get_device_name(0)


def write_docs(device: str, device_name: str, head: str, text: str) -> None:
    """docs/gpu.md's gpu-check block holds GPU runs only: a CPU run says so and writes nothing."""
    if device != "cuda":
        print("--write-docs: not written: docs/gpu.md's gpu-check block holds GPU runs only (this run: --device cpu)")
        return
    from xtcache.app.docblock import write_block

    write_block(REPO / "docs" / "gpu.md", "gpu-check", head + "\n\n" + text, gpu=device_name)


if __name__ == "__main__":
    main()
