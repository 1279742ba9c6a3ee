"""The demo's steps, shared by its off-policy and on-policy parts: each runs `xtcache` as a user would.

    dump_caches(run, ds, size, engine)     # step 2: the top-k and the held-out full-vocabulary caches
    build_projection(run, ds)              # step 3: the student -> teacher vocabulary map
    train(run, setup, cache, eval_cache, projection, out, size, kd=True)   # step 4: one student run
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

from xtcache.app.demo.console import StageFailed, StageRunner
from xtcache.app.demo.setup import DemoSetup, DemoSize
from xtcache.app.store_commands import store_summary
from xtcache.errors import StoreError
from xtcache.store import CacheReader

log = logging.getLogger(__name__)


def dump_cache(run: StageRunner, setup, data: list[Path], out: Path, capture: list[str], engine: str) -> dict:
    """teacher-dump with `engine` into `out` (reused when complete for the same key); returns its summary."""
    reused_before = is_complete(out)
    args = ["teacher-dump", "--teacher", str(setup.teacher_model), "--student-tokenizer",
            str(setup.student_tokenizer), *[a for f in data for a in ("--data", str(f))], "--out", str(out), *capture,
            "--max-seq-len", "512", "--engine", engine, "--dtype", "float32"]
    try:
        run.xtcache(*args)
    except StageFailed as failed:
        try:  # a store of an older demo version under the same path: replace it, loudly
            CacheReader(str(out))
        except StoreError:
            raise failed from None
        log.warning("replacing %s, which was written for other settings", out)
        shutil.rmtree(out)
        reused_before = False
        run.xtcache(*args)
    reader = CacheReader(str(out))
    summaries = [s.model_dump() if hasattr(s, "model_dump") else dict(s) for s in reader.writer_summaries().values()]
    summary = dict(summaries[0].get("summary", summaries[0])) if summaries else {}
    stored = store_summary(str(out))  # the sizes `xtcache inspect` prints, by its definition
    summary["bytes"], summary["bytes_per_position"] = stored.store_bytes, stored.bytes_per_position
    positions = summary.get("positions") or 0
    summary["positions_per_s"] = positions / summary["capture_s"] if summary.get("capture_s") else None
    summary["reused"] = reused_before
    return summary


def is_complete(url: Path) -> bool:
    try:
        return CacheReader(str(url)).is_complete()
    except StoreError:
        return False


def train(run: StageRunner, setup, cache: Path, eval_cache: Path, projection: Path, out: Path, size: DemoSize, *,
           kd: bool, extra: tuple[str, ...] = (), steps: int | None = None, student: Path | None = None,
           schedule: tuple[str, ...] | None = None) -> dict:
    """train-student from the fresh student (or `student`), at the size's rate with 10 warmup steps and the
    default cosine (or the flags `schedule`)."""
    if out.exists():
        shutil.rmtree(out)
    args = ["train-student", "--cache", str(cache), "--eval-cache", str(eval_cache), "--student",
            str(student or setup.student_model), "--out", str(out), "--projection", str(projection),
            "--seq-len", str(size.seq_len), "--micro-batch-size", str(size.micro_batch_size),
            "--max-steps", str(steps or size.student_steps),
            *(schedule or ("--lr", str(size.lr), "--warmup-steps", "10")),
            "--eval-every", str(size.eval_every), "--zero-stage", "2", "--seed", "0", *extra]
    # the toy pair's KD objective (forward P-KL + 0.1 CE, docs/demo.md), given whole: not train-student's
    # cross-tokenizer defaults, which were measured on the real pair (docs/losses.md)
    kd_flags = ["--loss", "pkl", "--pkl-divergence", "forward", "--kd-weight", "1.0", "--ce-weight", "0.1"]
    args += kd_flags if kd else ["--loss", "ce", "--ce-weight", "1.0"]
    run.xtcache(*args)
    return json.loads((out / "summary.json").read_text())


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot(runs: dict[str, Path], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for name, run_dir in runs.items():
        rows = metrics(run_dir)
        train = [r for r in rows if r.get("kind") == "train" and r.get("ce") is not None]
        evals = [r for r in rows if r.get("kind") == "eval"]
        axes[0].plot([r["step"] for r in train], [r["ce"] for r in train], label=name)
        axes[1].plot([r["step"] for r in evals], [r["ce"] for r in evals], marker="o", label=name)
        axes[2].plot([r["step"] for r in evals], [r["kl"] for r in evals], marker="o", label=name)
    for ax, title in zip(axes, ["train CE (student tokens)", "held-out CE", "held-out KL to the teacher"]):
        ax.set_title(title)
        ax.set_xlabel("optimizer step")
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def dump_caches(run: StageRunner, ds: DemoSetup, size: DemoSize, engine: str) -> tuple[dict, dict]:
    """Step 2: the top-k cache of the training documents and the full-vocabulary cache of the held-out
    ones (found by their keys and reused); returns both dumps' summaries (with their paths, "path")."""
    engine_name = "vLLM" if engine == "vllm" else "transformers"
    log.info("step 2/5: teacher-dump with %s: top-%d of the training documents, every id of the held-out ones",
             engine_name, size.top_k)
    cache = ds.workdir / "caches" / f"{ds.spec_key}-k{size.top_k}"
    dump = dump_cache(run, ds.setup, [ds.setup.train_jsonl], cache, ["--mode", "topk", "--top-k", str(size.top_k)], engine)
    eval_cache = ds.workdir / "caches" / f"{ds.spec_key}-heldout-full"
    # one teacher, one first-batch check: the held-out dump trusts the training cache's (absent when
    # an --engine hf run of this work directory wrote that cache)
    checked = engine == "vllm" and any((cache / "capture_checks").glob("*.json"))
    trust = ["--trust-check-from", str(cache)] if checked else []
    eval_dump = dump_cache(run, ds.setup, [ds.setup.heldout_jsonl], eval_cache, ["--mode", "full", *trust], engine)
    return {**dump, "path": cache}, {**eval_dump, "path": eval_cache}


def build_projection(run: StageRunner, ds: DemoSetup) -> Path:
    """Step 3: the student -> teacher vocabulary map."""
    log.info("step 3/5: projection build")
    projection = ds.workdir / f"projection-{ds.spec_key}.safetensors"
    run.xtcache("projection", "build", "--student-tokenizer", str(ds.setup.student_tokenizer), "--teacher-tokenizer",
                str(ds.setup.teacher_tokenizer), "--out", str(projection))
    return projection


def engine_log(workdir: Path, mode: str) -> Path:
    """Where a demo run's engine output goes: WORKDIR/demo[-MODE].log, rewritten on every run."""
    return workdir / (f"demo-{mode}.log" if mode else "demo.log")


def fmt(v, spec=".3f") -> str:
    return "-" if v is None else format(v, spec)
