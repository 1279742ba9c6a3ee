"""`xtcache demo`: the whole pipeline on local data, with proof that the cache teaches.

    make demo                      # sets up .venv, then runs `xtcache demo`
    xtcache demo --size small      # the reduced size the test suite runs

What it does, all on this machine and with no downloads:
1. builds a corpus from the Python standard library's sources (train and held-out documents), trains
   two different byte-level BPE tokenizers on it (teacher: single digits, no BOS; student: digits in
   groups of 1-3, BOS), and pre-trains a tiny Qwen2 teacher so it is clearly better than a fresh
   student; all of this is cached under the work directory and reused on the next run;
2. `xtcache teacher-dump` with vLLM (cross-tokenizer, top-k) over the training documents, and a
   full-vocabulary cache (`--mode full`, every teacher id) of the held-out documents, the
   evaluation reference (it trusts the first dump's first-batch check of the vLLM fast path,
   `--trust-check-from`, so only one dump starts the check's engine): on a second run both are
   found by their keys and the teacher does not run again (`--engine hf` captures with
   transformers instead);
3. `xtcache projection build` (student -> teacher vocabulary map);
4. `xtcache train-student` with DeepSpeed twice, for the same number of steps: distilled from the
   top-k cache (projected KL + CE) and a CE-only baseline, both evaluated (`--eval-cache`) on the
   full-vocabulary cache of the held-out documents;
5. prints a table (teacher positions/s, bytes/position, cache size, student steps/s, held-out CE
   and held-out KL to the teacher for both runs) and writes `demo_curves.png`. The held-out KL is
   the first-token KL (P-KL at each chunk's first position: the student's distribution projected
   onto the teacher vocabulary, each student token read as the first teacher token of its text)
   against the teacher's full distribution, not against a top-k bucket (which would be a coarse
   lower bound of it).

Every stage runs as its own `xtcache` subprocess, exactly as a user would run it.

`xtcache demo --chat` runs the same comparison on conversations (`docs/conversations.md`): the
teacher's tokenizer carries a ChatML-style chat template and the teacher is pre-trained on
conversations rendered in it; the student's tokenizer carries a Llama-3-style template; stage 1
renders every conversation in both templates, and both students train with `--train-on assistant`.

`xtcache demo --write-docs` (default size, plain text) also writes README.md's `demo-output` block
(the table below) and its `demo-inspect` block (`xtcache inspect` of the demo's own top-k cache,
abridged), stamped with the command, date and machine (xtcache.docblock).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import typer

from xtcache.demo_console import StageFailed, StageRunner
from xtcache.demo_setup import SIZES, DemoSetup, DemoSize, build_setup
from xtcache.demo_setup import _toy_spec as _toy_spec  # read here by bench/quality.py

log = logging.getLogger(__name__)
DOC_BLOCKS = {"demo-output": "README.md", "demo-inspect": "README.md"}  # --write-docs: block -> file
README = Path(__file__).resolve().parents[1] / "README.md"


def _dump(run: StageRunner, setup, data: list[Path], out: Path, capture: list[str], engine: str) -> dict:
    """teacher-dump with `engine` into `out` (reused when complete for the same key); returns its summary."""
    from xtcache.commands_store import store_summary
    from xtcache.errors import StoreError
    from xtcache.store import CacheReader

    reused_before = _is_complete(out)
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
    summary["bytes"], summary["bytes_per_position"] = stored["store_bytes"], stored["bytes_per_position"]
    positions = summary.get("positions") or 0
    summary["positions_per_s"] = positions / summary["capture_s"] if summary.get("capture_s") else None
    summary["reused"] = reused_before
    return summary


def _is_complete(url: Path) -> bool:
    from xtcache.errors import StoreError
    from xtcache.store import CacheReader

    try:
        return CacheReader(str(url)).is_complete()
    except StoreError:
        return False


def _train(run: StageRunner, setup, cache: Path, eval_cache: Path, projection: Path, out: Path, size: DemoSize, *,
           kd: bool, extra: tuple[str, ...] = (), steps: int | None = None) -> dict:
    if out.exists():
        shutil.rmtree(out)
    args = ["train-student", "--cache", str(cache), "--eval-cache", str(eval_cache), "--student",
            str(setup.student_model), "--out", str(out), "--projection", str(projection),
            "--seq-len", str(size.seq_len), "--micro-batch-size", str(size.micro_batch_size),
            "--max-steps", str(steps or size.student_steps), "--lr", str(size.lr), "--warmup-steps", "10",
            "--eval-every", str(size.eval_every), "--zero-stage", "2", "--seed", "0", *extra]
    args += ["--loss", "pkl", "--kd-weight", "1.0", "--ce-weight", "0.1"] if kd else ["--loss", "ce", "--ce-weight", "1.0"]
    run.xtcache(*args)
    return json.loads((out / "summary.json").read_text())


def _metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _plot(runs: dict[str, Path], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for name, run_dir in runs.items():
        rows = _metrics(run_dir)
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
    dump = _dump(run, ds.setup, [ds.setup.train_jsonl], cache, ["--mode", "topk", "--top-k", str(size.top_k)], engine)
    eval_cache = ds.workdir / "caches" / f"{ds.spec_key}-heldout-full"
    # one teacher, one first-batch check: the held-out dump trusts the training cache's (absent when
    # an --engine hf run of this work directory wrote that cache)
    checked = engine == "vllm" and any((cache / "capture_checks").glob("*.json"))
    trust = ["--trust-check-from", str(cache)] if checked else []
    eval_dump = _dump(run, ds.setup, [ds.setup.heldout_jsonl], eval_cache, ["--mode", "full", *trust], engine)
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


def run_demo(workdir: Path, size_name: str, *, chat: bool = False, engine: str = "vllm") -> dict:
    """Run the demo (on conversations with `chat`, capturing the teacher with `engine`); returns the
    numbers of its table (the tests read them)."""
    workdir.mkdir(parents=True, exist_ok=True)
    run = StageRunner(engine_log(workdir, "chat" if chat else ""))
    try:
        result = _run_demo(run, workdir, size_name, chat=chat, engine=engine)
    finally:
        run.close()
    return result


def _run_demo(run: StageRunner, workdir: Path, size_name: str, *, chat: bool, engine: str) -> dict:
    t0 = time.perf_counter()
    size = SIZES[size_name]
    ds = build_setup(run, workdir, size_name, chat=chat)
    t_setup = time.perf_counter() - t0
    dump, eval_dump = dump_caches(run, ds, size, engine)
    projection = build_projection(run, ds)

    steps = size.steps(chat=chat)
    log.info("step 4/5: train-student, distilled from the cache and CE-only, %d steps each", steps)
    runs = {"distilled (P-KL + CE)": ds.workdir / "runs" / "distilled",
            "baseline (CE only)": ds.workdir / "runs" / "baseline"}
    kd = _train(run, ds.setup, dump["path"], eval_dump["path"], projection, runs["distilled (P-KL + CE)"], size,
                kd=True, extra=ds.train_on, steps=steps)
    ce = _train(run, ds.setup, dump["path"], eval_dump["path"], projection, runs["baseline (CE only)"], size,
                kd=False, extra=ds.train_on, steps=steps)

    log.info("step 5/5: report")
    png = ds.workdir / "demo_curves.png"
    _plot(runs, png)
    result = {
        "teacher_reused": dump["reused"],
        "teacher_positions_per_s": dump.get("positions_per_s"),
        "bytes_per_position": dump.get("bytes_per_position"),
        "cache_mb": dump["bytes"] / 1e6,
        "eval_cache_mb": eval_dump["bytes"] / 1e6,
        "eval_cache_docs": eval_dump.get("documents"),
        "distilled": kd,
        "baseline": ce,
        "png": str(png),
        "wall_s": time.perf_counter() - t0,
        "setup_s": t_setup,
        "chat": chat,
        "engine": "vLLM" if engine == "vllm" else "transformers",
        "cache": str(dump["path"]),
        "engine_log": str(run.log_path),
    }
    (ds.workdir / "demo_result.json").write_text(json.dumps(result, indent=2, default=str))
    _print_table(result)
    return result


def _fmt(v, spec=".3f") -> str:
    return "-" if v is None else format(v, spec)


def _print_table(r: dict) -> None:
    typer.echo(_table(r))


def _table(r: dict) -> str:
    kd, ce = r["distilled"], r["baseline"]
    kl_kd, kl_ce = kd.get("final_eval_kl"), ce.get("final_eval_kl")
    teacher = ("not run: the cache was found and reused (same teacher, tokenizers, corpus, settings)" if r["teacher_reused"]
               else f"{_fmt(r['teacher_positions_per_s'], ',.0f')} positions/s")
    lines = [
        "",
        "xtcache demo" + (" --chat: conversations, ChatML-style teacher template, Llama-3-style student template, "
                          "trained on assistant turns" if r.get("chat") else ""),
        f"  {'teacher (' + r['engine'] + ')':<24}{teacher}",
        f"  cache                   {_fmt(r['bytes_per_position'], '.1f')} bytes/position, {r['cache_mb']:.2f} MB",
        f"  held-out reference      every teacher id of {_fmt(r['eval_cache_docs'], 'd')} held-out documents, "
        f"{r['eval_cache_mb']:.2f} MB",
        "",
        f"  {'student run':<24}{'steps/s':>9}{'held-out CE':>13}{'held-out KL to teacher*':>25}",
        f"  {'baseline (CE only)':<24}{_fmt(ce.get('steps_per_s'), '.2f'):>9}{_fmt(ce.get('final_eval_ce')):>13}{_fmt(kl_ce):>25}",
        f"  {'distilled (P-KL + CE)':<24}{_fmt(kd.get('steps_per_s'), '.2f'):>9}{_fmt(kd.get('final_eval_ce')):>13}{_fmt(kl_kd):>25}",
        "",
        "  * first-token KL to the teacher's FULL distribution (every teacher id, from the held-out full-vocabulary",
        "    cache) at each chunk's first position of the held-out documents; CE: nats per student token",
        "",
    ]
    if kl_kd is not None and kl_ce is not None:
        verdict = "ahead" if kl_kd < kl_ce else "NOT ahead"
        lines.append(f"  distilled student is {verdict} on held-out KL to the teacher: "
                     f"{kl_kd:.3f} vs {kl_ce:.3f} ({(1 - kl_kd / kl_ce) * 100:+.1f}% lower)")
    lines += [f"  curves: {r['png']}", f"  wall time: {r['wall_s']:.0f} s", ""]
    return "\n".join(lines)


def write_readme_blocks(result: dict) -> None:
    """README.md's demo-output block (the table) and demo-inspect block (`xtcache inspect` of the top-k
    cache, run as a user would, abridged to the header and the array table)."""
    from xtcache.docblock import write_block

    cache = Path(result["cache"])
    shown = os.path.relpath(cache) if not os.path.relpath(cache).startswith("..") else str(cache)
    out = subprocess.run([sys.executable, "-m", "xtcache.cli", "inspect", shown], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"--write-docs: xtcache inspect {shown} failed (exit {out.returncode}): {out.stderr[-500:]}")
    write_block(README, "demo-output", "```text\n" + _table(result).strip("\n") + "\n```")
    write_block(README, "demo-inspect", "```text\n" + "\n".join(abridged_inspect(out.stdout)) + "\n```")


def abridged_inspect(text: str) -> list[str]:
    """`xtcache inspect`'s header lines and array table, up to the top-k size line (README's example)."""
    keep = []
    for line in text.splitlines():
        if line.startswith(("mean top-k mass", "cache key", "  ")) or not line.strip():
            continue  # the key and fingerprints: long hex strings that say nothing in an example
        keep.append(line)
        if line.startswith("top-k arrays:"):
            return keep
    raise SystemExit("--write-docs: xtcache inspect printed no 'top-k arrays:' line; README.md not written")


def demo(
    workdir: str = typer.Option(".xtcache_demo", help="Where artifacts, caches, runs and the plot go (reused)."),
    size: str = typer.Option("default", help="default | small (the reduced size the tests run)."),
    chat: bool = typer.Option(False, "--chat", help="Distil over conversations, each model in its own chat "
                                                    "template, training on assistant turns."),
    engine: str = typer.Option("vllm", help="vllm | hf: the teacher-dump engine (hf: transformers, for a machine "
                                            "without a working vLLM; the tests' plain-text demo)."),
    write_docs: bool = typer.Option(False, "--write-docs", help="Also write README.md's demo-output and demo-inspect "
                                                               "blocks (default size, plain text, vLLM only)."),
    on_policy: bool = typer.Option(False, "--on-policy", help="Two on-policy rounds (`xtcache rounds`) beside "
                                   "off-policy KD on conversations; held-out KL and `xtcache policy-eval`'s "
                                   "reverse KL and teacher NLL on the students' own samples."),
) -> None:
    """Run the whole pipeline on local data: teacher-dump, projection, distilled vs CE-only student.

    Engine output (vLLM, DeepSpeed) goes to WORKDIR/demo[-chat|-on-policy].log, named at the start and end."""
    if size not in SIZES:
        raise typer.BadParameter(f"--size {size}: use one of {', '.join(SIZES)}")
    if engine not in ("vllm", "hf"):
        raise typer.BadParameter(f"--engine {engine}: use vllm or hf")
    if write_docs and (size != "default" or chat or on_policy or engine != "vllm"):
        raise typer.BadParameter("--write-docs: README.md shows the default plain-text demo on vLLM; drop --size, "
                                 "--chat, --on-policy and --engine")
    if on_policy:  # on conversations: --chat is implied
        from xtcache.demo_onpolicy import run_on_policy_demo

        run_on_policy_demo(Path(workdir), size, engine=engine)
        return
    if write_docs:
        from xtcache.docblock import require_blocks

        require_blocks(README.parent, DOC_BLOCKS)
    result = run_demo(Path(workdir), size, chat=chat, engine=engine)
    if write_docs:
        write_readme_blocks(result)
