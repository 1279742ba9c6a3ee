"""Stage 2 cost of distillation: student step time and peak memory, CE-only vs each KD loss.

    python bench/train_step.py                      # toy teacher/student, CPU or GPU
    python bench/train_step.py --steps 20 --seq-len 512 --micro-batch-size 8 --bf16

Builds three real teacher caches from the toy teacher with plain transformers (top-k for a
cross-tokenizer student, top-k and sampled for a student sharing the teacher's tokenizer), then
trains each configuration for a few DeepSpeed ZeRO-2 steps in its own process (one process group
per process) and prints one table:

- step ms: median time of `Trainer.train_step` over the timed steps (batches prefetched, so the
  loader is not in it): wall time on GPU, the process's CPU time on one thread on CPU (robust to
  other jobs on a shared machine); ratio to the CE-only step of the same student (target <= 1.3x; proportioned students: see below);
- peak MiB: on GPU `torch.cuda.max_memory_allocated`; on CPU, 16 B/parameter (fp32 weights,
  gradients, AdamW m and v) plus the peak of tensor bytes allocated during one step and still
  live, counted by a torch dispatch mode (CPU has no allocator statistics; the prefetched batch
  is not allocated by the step, so it is not in it); ratio to CE-only (target <= 1.1x) and, for
  the full-vocabulary rows (`full`: a cache with every teacher id, k = V), to the top-k row of the
  same loss (target <= 1.2x);
- teacher MiB: the cache's tensors of one micro-batch (ids, log-probs, ...), which the step moves
  to the device on a GPU (so the GPU peak holds them; the CPU peak does not);
- loader positions/s (`xtcache.testing.rates.measure_rate`, no model, same clock, in-process
  reading: --num-workers 0) against the positions/s the trainer consumes (target >= 10x).

The row `cross/2 teachers` trains the cross-tokenizer student from two caches at once (the toy
teacher's top-k cache, P-KL, and a second teacher on the student's own tokenizer, KL, combined by
`--teacher-combine dynamic`); its step is compared with the one-teacher P-KL step (target <= 1.3x)
and its loader (two caches read in lockstep) with the trainer.

    python bench/train_step.py --rows cross/ce,cross/pkl,cross/2-teachers   # only these rows

The rows `cross-1b/...` and `same-1b/...` train proportioned students (hidden 256, 4 layers, 4k
vocabularies, their own toy teacher), whose LM head takes about the share of a step's FLOPs that it
takes in a 1B model (the `head FLOP` column); their targets: top-k KL and P-KL within 1.1x CE,
full-vocabulary KL within 1.5x.

    python bench/train_step.py --rows 'cross-1b/ce,cross-1b/pkl,same-1b/ce,same-1b/kl,same-1b/kl full'

The rows `real/ce` and `real/pkl` (`--teacher real`) train the real pair of
xtcache.testing.real: a fresh tiny Llama student (hidden 64, 2 layers) on the Llama-3 vocabulary
(128,256 ids) against SmolLM2-135M-Instruct (49,152 ids), the W that `xtcache projection build`
makes for the two tokenizers, and a top-64 cache of the real teacher (built here with plain
transformers from the tier's documents, or `--real-cache` for a store at hand); target P-KL <= 1.2x CE.

    python bench/train_step.py --teacher real                                   # the real pair's two rows
    python bench/train_step.py --teacher real --real-cache /path/to/top64-store   # a store aligned for Llama-3

`--write-docs` also writes the printed table: docs/benchmarks.md's `train-step` block (all rows) or, with
`--rows cross/ce,cross/pkl,cross/2-teachers`, its `train-step-two-teachers` block; with the
proportioned rows above, docs/losses.md's `train-step-proportioned` block; with `--teacher real`,
docs/losses.md's `train-step-real` block.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from xtcache.app.docblock import require_blocks, tee_stdout, write_block  # noqa: E402

# --write-docs: block -> file; the default rows write train-step, TWO_TEACHER_ROWS write train-step-two-teachers
DOC_BLOCKS = {"train-step": "docs/benchmarks.md", "train-step-two-teachers": "docs/benchmarks.md",
              "train-step-proportioned": "docs/losses.md", "train-step-real": "docs/losses.md"}
TWO_TEACHER_ROWS = "cross/ce,cross/pkl,cross/2-teachers"
PROPORTIONED_ROWS = "cross-1b/ce,cross-1b/pkl,same-1b/ce,same-1b/kl,same-1b/kl full"
# The proportioned students (rows cross-1b/..., same-1b/...): hidden 256, 4 layers, 4k vocabularies, so that the LM
# head takes about the share of a step's FLOPs it takes in a 1B model (Llama-3.2-1B: 2048 x 128k = 263M of 1.24G
# matmul parameters per token, 21%); the table prints the share of each student (`head_flop_share`: 22%)
# (student, loss, cache(s), student model) of every row, in table order
ROWS = [("cross", "ce", "topk", "cross_student"), ("cross", "pkl", "topk", "cross_student"),
        ("cross", "pkl full", "full", "cross_student"), ("cross", "alm", "topk", "cross_student"),
        ("same", "ce", "topk", "same_student"), ("same", "kl", "topk", "same_student"),
        ("same", "kl full", "full", "same_student"), ("same", "rkl", "topk", "same_student"),
        ("same", "jsd", "topk", "same_student"), ("same", "sampled", "sampled", "same_student"),
        ("cross", "2-teachers", ("topk", "second"), "cross_student"),
        ("cross-1b", "ce", "topk-1b", "cross_student-1b"), ("cross-1b", "pkl", "topk-1b", "cross_student-1b"),
        ("same-1b", "ce", "topk-1b", "same_student-1b"), ("same-1b", "kl", "topk-1b", "same_student-1b"),
        ("same-1b", "kl full", "full-1b", "same_student-1b"),
        ("real", "ce", "real-topk", "real_student"), ("real", "pkl", "real-topk", "real_student")]
REAL_K = 64  # top-k of the real pair's cache
PROPORTIONED = dict(num_docs=300, doc_chars=1200, teacher_vocab=4096, student_vocab=4096, teacher_hidden=64,
                    teacher_layers=2, student_hidden=256, student_layers=4, teacher_steps=150, teacher_seq_len=128)


class LiveBytes:
    """Peak bytes of tensor storages created while active and still referenced (CPU stand-in).

    A view op (slice, transpose, detach, ...) allocates nothing: its output counts only through
    the storage it views, and not at all when that storage existed before (the prefetched batch,
    the parameters). `lift_fresh` (a tensor made from numpy or Python data during the step, e.g.
    the objective's host-side plan) is the one view-flagged op that brings new memory in.
    """

    def __init__(self):
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode  # noqa: PLC2701 (torch has no public name for it)

        tracker = self
        lift_fresh = torch.ops.aten.lift_fresh.default

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                tracker._see(out, only_tracked=func.is_view and func is not lift_fresh)
                return out

        self.mode = _Mode()
        self.live: dict[int, list[int]] = {}
        self.current = self.peak = 0

    def _see(self, out, *, only_tracked: bool = False) -> None:
        import torch
        from torch.utils._pytree import tree_flatten  # noqa: PLC2701 (torch has no public name for it)

        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
                continue
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr == 0 or (only_tracked and ptr not in self.live):
                continue
            if ptr in self.live:
                self.live[ptr][1] += 1
            else:
                self.live[ptr] = [storage.nbytes(), 1]
                self.current += storage.nbytes()
                self.peak = max(self.peak, self.current)
            weakref.finalize(t, self._release, ptr)

    def _release(self, ptr: int) -> None:
        entry = self.live.get(ptr)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self.live[ptr]

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)


def worker(spec: dict) -> dict:
    """One configuration in this process: time steps, measure memory and the loader's rate."""
    import torch

    from stage2_student.config import TrainConfig
    from stage2_student.data import open_stage_data
    from stage2_student.student import load_tokenizer, setup_distributed, teardown_distributed
    from stage2_student.trainer import Trainer
    from xtcache.testing.rates import measure_rate

    if not torch.cuda.is_available():
        torch.set_num_threads(1)
    rank, _, world = setup_distributed()
    try:
        cfg = TrainConfig.from_flat(spec["config"])
        tokenizer = load_tokenizer(cfg.student)
        data = open_stage_data(cfg, tokenizer, rank, world)
        trainer = Trainer(cfg, data, rank=rank, world=world)
        it = iter(data.train)
        steps = [[next(it) for _ in range(cfg.optim.grad_accum)] for _ in range(spec["warmup"] + spec["steps"] + 1)]
        cuda = torch.cuda.is_available()
        for batches in steps[:spec["warmup"]]:
            trainer.train_step(batches)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        # GPU: wall time; CPU: this process's CPU time on one thread, which other jobs sharing the
        # machine's cores do not inflate (wall time there measures the neighbours as much as us)
        clock = time.perf_counter if cuda else time.process_time
        times, positions = [], 0
        for batches in steps[spec["warmup"]:-1]:
            t0 = clock()
            trainer.train_step(batches)
            if cuda:
                torch.cuda.synchronize()
            times.append(clock() - t0)
            positions += sum(int(b["attention_mask"].sum()) for b in batches)
        if cuda:
            peak = torch.cuda.max_memory_allocated()
        else:
            n_params = sum(p.numel() for p in trainer.engine.module.parameters())
            with LiveBytes() as live:
                trainer.train_step(steps[-1])
            peak = 16 * n_params + live.peak
        loader = data.train.__class__(data.train.dataset, num_workers=cfg.loader.num_workers)
        t0 = clock()
        rate = measure_rate(loader, spec["loader_batches"])
        loader_pos_s = rate["positions_per_s"] * rate["seconds"] / max(clock() - t0, 1e-9)  # same clock
        step_s = statistics.median(times)
        teacher = sum(v.numel() * v.element_size() for b in steps[-1] for k, v in b.items() if k.rsplit("/", 1)[-1].startswith("teacher_"))  # every teacher's
        return {"name": spec["name"], "step_ms": 1000 * step_s, "peak_mib": peak / 2**20,
                "teacher_mib": teacher / len(steps[-1]) / 2**20,
                "trainer_pos_s": positions / len(times) / step_s, "loader_pos_s": loader_pos_s,
                "kd_loss": data.objective.kind, "device": str(trainer.device),
                "head_share": head_flop_share(trainer.engine.module.config, cfg.loader.seq_len)}
    finally:
        teardown_distributed()


def head_flop_share(cfg, seq_len: int) -> float:
    """Share of a training step's matmul FLOPs in the LM head: 2 h V over the head plus every layer's
    projections (q, k, v, o, gated MLP) and attention (QK^T and AV over the full seq_len x seq_len
    matrix), per token; forward and backward scale all of them alike, norms and softmax left out."""
    h, inter, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    kv = cfg.num_key_value_heads * (h // cfg.num_attention_heads)
    layer = 2 * (h * h + 2 * h * kv + h * h + 3 * h * inter) + 4 * seq_len * h
    head = 2 * h * cfg.vocab_size
    return head / (head + layers * layer)


def build_inputs(root: Path, args, kinds: set[str]) -> dict:
    """Toy models, a same-tokenizer student and the caches of the students in `kinds` (toy and proportioned)."""
    from xtcache.testing import toy
    from xtcache.testing.suite import TEST_CACHE, TEST_SPEC

    inputs = {}
    if kinds & {"cross", "same"}:
        inputs.update(build_student_inputs(root / "toy", args, TEST_CACHE, TEST_SPEC, extras=True))
    if kinds & {"cross-1b", "same-1b"}:  # the proportioned students, their own (4k-vocabulary) teacher
        prop = build_student_inputs(root / "prop", args, TEST_CACHE, toy.ToySpec(**PROPORTIONED), extras=False)
        inputs.update({f"{k}-1b": v for k, v in prop.items()})
    if "real" in kinds:
        inputs.update(build_real_inputs(root / "real", args))
    return inputs


def build_real_inputs(root: Path, args) -> dict:
    """The real pair (xtcache.testing.real): a fresh tiny Llama student on the Llama-3 vocabulary, the projection W
    of its tokenizer onto SmolLM2's, and a top-64 cache of SmolLM2 (`--real-cache`, or built here)."""
    from xtcache.projection import build_projection
    from xtcache.testing import toy
    from xtcache.testing.caches import build_hf_cache
    from xtcache.testing.real import build_real_models
    from xtcache.tokenizer import load_tokenizer

    models = build_real_models()
    student = root / "student"
    toy.build_tiny_model("llama", models.llama3_tokenizer, student, hidden=64, layers=2, intermediate=192, seed=1)
    projection = root / "w.safetensors"
    build_projection(load_tokenizer(models.llama3_tokenizer), load_tokenizer(models.teacher)).save(projection)
    cache = args.real_cache or build_hf_cache(root / "topk", models.teacher, models.train_jsonl,
                                              [models.llama3_tokenizer], k=REAL_K, max_docs=args.docs)
    return {"real_student": str(student), "real-topk": str(cache), "real_projection": str(projection)}


def build_student_inputs(root: Path, args, cache_dir: Path, spec, *, extras: bool) -> dict:
    """A toy setup's models (the cross-tokenizer student from `spec`, a same-tokenizer one built beside it), a
    second teacher on the student's tokenizer (`extras`), and the teacher's top-k, full (and, `extras`, sampled) caches."""
    from xtcache.testing import toy
    from xtcache.testing.caches import build_hf_cache
    from xtcache.tokenizer import load_tokenizer

    setup = toy.build_toy_setup(cache_dir, spec)
    same_student = root / "student_same_tok"
    # qwen2 like the teacher: transformers picks the tokenizer class from the model type, so a llama
    # config would load the same files as another tokenizer (another fingerprint)
    toy.build_tiny_model("qwen2", setup.teacher_tokenizer, same_student, hidden=spec.student_hidden,
                         layers=spec.student_layers, intermediate=spec.student_hidden * 3, seed=1)
    kw = dict(k=args.k, max_docs=args.docs)
    extra = {}
    if extras:  # the sampled cache and a second, different teacher on the student's tokenizer
        second = root / "teacher_student_tok"
        toy.build_tiny_model("llama", setup.student_tokenizer, second, hidden=spec.teacher_hidden,
                             layers=spec.teacher_layers, intermediate=spec.teacher_hidden * 3, seed=7)
        extra = {"second": build_hf_cache(root / "second", second, setup.train_jsonl, [setup.student_tokenizer], **kw),
                 "sampled": build_hf_cache(root / "sampled", setup.teacher_model, setup.train_jsonl, [], mode="sampled",
                                           num_samples=args.k, **kw)}
    return {
        **extra, "cross_student": str(setup.student_model), "same_student": str(same_student),
        "topk": build_hf_cache(root / "topk", setup.teacher_model, setup.train_jsonl, [setup.student_tokenizer], **kw),
        # full vocabulary: every teacher id stored (k = V, residual 0), as `--mode full` holds it
        "full": build_hf_cache(root / "full", setup.teacher_model, setup.train_jsonl, [setup.student_tokenizer],
                               k=len(load_tokenizer(setup.teacher_tokenizer)), max_docs=args.docs),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8, help="timed optimizer steps per configuration")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--k", type=int, default=32, help="top-k width / sampled draws of the caches")
    ap.add_argument("--docs", type=int, default=64, help="documents per cache")
    ap.add_argument("--num-workers", type=int, default=0)
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--rows", help="comma-separated row names to run (default: all of --teacher's)")
    ap.add_argument("--teacher", choices=("toy", "real"), default="toy",
                    help="toy: the toy and proportioned rows; real: the real pair's rows (real/ce, real/pkl)")
    ap.add_argument("--real-cache", help="a top-k store of SmolLM2-135M-Instruct aligned for the Llama-3 tokenizer "
                                         "(default: build one from the real tier's documents)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--write-docs", action="store_true",
                    help="also write the table into docs/benchmarks.md (train-step, or train-step-two-teachers with "
                         f"--rows {TWO_TEACHER_ROWS}) or docs/losses.md (train-step-proportioned with "
                         f"--rows '{PROPORTIONED_ROWS}')")
    args = ap.parse_args()
    block = doc_block(args)
    if block:
        require_blocks(REPO, {block: DOC_BLOCKS[block]})
    if args.worker:
        print("RESULT " + json.dumps(worker(json.loads(args.worker))), flush=True)
        return
    wanted = args.rows.split(",") if args.rows else [f"{kind}/{loss}" for kind, loss, _, _ in ROWS
                                                     if (kind == "real") == (args.teacher == "real")]
    with tempfile.TemporaryDirectory(prefix="xtcache_bench_train_") as tmp:
        root = Path(tmp)
        t0 = time.perf_counter()
        inputs = build_inputs(root, args, {name.split("/")[0] for name in wanted})
        print(f"caches built in {time.perf_counter() - t0:.1f}s (k={args.k}, real pair k={REAL_K}, {args.docs} docs each)")
        runs = [(kind, loss, [inputs[c] for c in caches] if isinstance(caches, tuple) else inputs[caches], inputs[student])
                for kind, loss, caches, student in ROWS if f"{kind}/{loss}" in wanted]
        results = []
        for student_kind, loss, cache, student in runs:
            two = loss == "2-teachers"
            config = {"cache": cache, "student": student, "out": str(root / f"run_{student_kind}_{loss.replace(' ', '_')}"),
                      "loss": "auto" if two else loss.split()[0], "ce_weight": 1.0 if loss == "ce" else 0.1,
                      "teacher_combine": "dynamic", "seq_len": args.seq_len,
                      "micro_batch_size": args.micro_batch_size, "max_steps": 1000, "lr": 1e-3,
                      "zero_stage": 2, "bf16": args.bf16, "num_workers": args.num_workers}
            if student_kind == "real":  # the real pair: train-student's cross-tokenizer defaults (forward-reverse P-KL)
                config["projection"] = [inputs["real_projection"]]
            else:  # the toy and proportioned rows: the forward P-KL their docs blocks were measured with
                config["pkl_divergence"] = "forward"
            spec = {"name": f"{student_kind}/{loss}", "config": config, "steps": args.steps, "warmup": args.warmup,
                    "loader_batches": 4 * (args.steps + args.warmup)}
            env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
            proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)], cwd=REPO, env=env,
                                  capture_output=True, text=True)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode != 0 or not lines:
                print(f"{spec['name']}: FAILED\n{proc.stderr[-3000:]}")
                continue
            results.append({**json.loads(lines[-1][7:]), "student": student_kind, "loss": loss})
    with tee_stdout() as printed:
        print_table(results, args)
    if block:
        if len(results) != len(runs):
            raise SystemExit(f"--write-docs: {len(runs) - len(results)} rows FAILED above; "
                             f"{DOC_BLOCKS[block]} not written")
        write_block(REPO / DOC_BLOCKS[block], block, "```text\n" + printed.text().strip("\n") + "\n```")


def doc_block(args) -> str | None:
    """The doc block --write-docs writes for these --rows (None without --write-docs); refuses other row sets."""
    if not args.write_docs:
        return None
    if args.rows is None:
        return "train-step-real" if args.teacher == "real" else "train-step"
    if args.rows == TWO_TEACHER_ROWS:
        return "train-step-two-teachers"
    if args.rows == PROPORTIONED_ROWS:
        return "train-step-proportioned"
    raise SystemExit(f"train_step.py --write-docs with --rows {args.rows}: the docs have blocks for all rows (no --rows, "
                     f"with --teacher toy or real), for --rows {TWO_TEACHER_ROWS} and for --rows '{PROPORTIONED_ROWS}' "
                     "only; drop --write-docs or use one of those")


def print_table(results: list[dict], args) -> None:
    base = {r["student"]: r for r in results if r["loss"] == "ce"}
    topk = {(r["student"], r["loss"]): r for r in results if not r["loss"].endswith(" full")}
    device = results[0]["device"] if results else "?"
    print(f"\nstage 2 step cost on {device} ({'wall' if device.startswith('cuda') else 'CPU'} time, medians): seq_len {args.seq_len} x micro-batch {args.micro_batch_size}, "
          f"ZeRO-2, {'bf16' if args.bf16 else 'fp32'}, {args.steps} timed steps; ratios vs CE-only of the same student, "
          "full-vocabulary rows also vs the top-k row of the same loss")
    head = (f"{'student/loss':<18} {'head FLOP':>9} {'step ms':>8} {'x CE':>6} {'peak MiB':>9} {'x CE':>6} {'x top-k':>8} "
            f"{'teacher MiB':>12} {'trainer pos/s':>14} {'loader pos/s':>13} {'loader/trainer':>15}")
    print(head)
    print("-" * len(head))
    for r in results:
        b = base.get(r["student"])
        t_ratio = r["step_ms"] / b["step_ms"] if b else float("nan")
        m_ratio = r["peak_mib"] / b["peak_mib"] if b else float("nan")
        k = topk.get((r["student"], r["loss"].removesuffix(" full"))) if r["loss"].endswith(" full") else None
        k_ratio = f"{r['peak_mib'] / k['peak_mib']:.2f}" if k else ""
        print(f"{r['student'] + '/' + r['loss']:<18} {r['head_share']:>9.0%} {r['step_ms']:>8.1f} {t_ratio:>6.2f} {r['peak_mib']:>9.1f} "
              f"{m_ratio:>6.2f} {k_ratio:>8} {r['teacher_mib']:>12.2f} {r['trainer_pos_s']:>14,.0f} "
              f"{r['loader_pos_s']:>13,.0f} {r['loader_pos_s'] / r['trainer_pos_s']:>15.1f}")
    print("head FLOP: the LM head's share of the student's matmul FLOPs per token (about a quarter in a 1B model); "
          "the -1b students are proportioned so (hidden 256, 4 layers, 4k vocabularies)")
    print("targets: KD step <= 1.3x CE (-1b students: top-k KL and P-KL <= 1.1x, full-vocabulary KL <= 1.5x), "
          "peak memory <= 1.1x CE (full vocabulary: <= 1.2x the top-k row), loader >= 10x the trainer's consumption")
    real = {r["loss"]: r for r in results if r["student"] == "real"}
    if "ce" in real and "pkl" in real:
        ce, pkl = real["ce"]["step_ms"], real["pkl"]["step_ms"]
        print(f"real pair (Llama-3 student, 128,256 ids; SmolLM2-135M teacher, 49,152 ids; top-{REAL_K}): CE "
              f"{1000 / ce:.3f} steps/s, P-KL (forward-reverse, the default) {1000 / pkl:.3f} steps/s, P-KL/CE "
              f"{pkl / ce:.2f}x (target <= 1.2x)")
    one = next((r for r in results if r["student"] == "cross" and r["loss"] == "pkl"), None)
    two = next((r for r in results if r["loss"] == "2-teachers"), None)
    if one and two:
        print(f"two teachers (P-KL + KL, dynamic) vs one (P-KL): step {two['step_ms'] / one['step_ms']:.2f}x "
              f"(target <= 1.3x), peak memory {two['peak_mib'] / one['peak_mib']:.2f}x, loader "
              f"{two['loader_pos_s'] / two['trainer_pos_s']:.1f}x ahead of the trainer (target >= 10x)")


if __name__ == "__main__":
    main()
