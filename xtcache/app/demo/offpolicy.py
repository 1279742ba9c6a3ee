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
abridged), stamped with the command, date and machine (xtcache.app.docblock).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import typer

from xtcache.app.demo.console import StageRunner
from xtcache.app.demo.setup import SIZES, build_setup
from xtcache.app.demo.steps import build_projection, dump_caches, engine_log, fmt, plot, train
from xtcache.app.docblock import write_block

log = logging.getLogger(__name__)
DOC_BLOCKS = {"demo-output": "README.md", "demo-inspect": "README.md"}  # --write-docs: block -> file
README = Path(__file__).resolve().parents[3] / "README.md"


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
    kd = train(run, ds.setup, dump["path"], eval_dump["path"], projection, runs["distilled (P-KL + CE)"], size,
                kd=True, extra=ds.train_on, steps=steps)
    ce = train(run, ds.setup, dump["path"], eval_dump["path"], projection, runs["baseline (CE only)"], size,
                kd=False, extra=ds.train_on, steps=steps)

    log.info("step 5/5: report")
    png = ds.workdir / "demo_curves.png"
    plot(runs, png)
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


def _print_table(r: dict) -> None:
    typer.echo(_table(r))


def _table(r: dict) -> str:
    kd, ce = r["distilled"], r["baseline"]
    kl_kd, kl_ce = kd.get("final_eval_kl"), ce.get("final_eval_kl")
    teacher = ("not run: the cache was found and reused (same teacher, tokenizers, corpus, settings)" if r["teacher_reused"]
               else f"{fmt(r['teacher_positions_per_s'], ',.0f')} positions/s")
    lines = [
        "",
        "xtcache demo" + (" --chat: conversations, ChatML-style teacher template, Llama-3-style student template, "
                          "trained on assistant turns" if r.get("chat") else ""),
        f"  {'teacher (' + r['engine'] + ')':<24}{teacher}",
        f"  cache                   {fmt(r['bytes_per_position'], '.1f')} bytes/position, {r['cache_mb']:.2f} MB",
        f"  held-out reference      every teacher id of {fmt(r['eval_cache_docs'], 'd')} held-out documents, "
        f"{r['eval_cache_mb']:.2f} MB",
        "",
        f"  {'student run':<24}{'steps/s':>9}{'held-out CE':>13}{'held-out KL to teacher*':>25}",
        f"  {'baseline (CE only)':<24}{fmt(ce.get('steps_per_s'), '.2f'):>9}{fmt(ce.get('final_eval_ce')):>13}{fmt(kl_ce):>25}",
        f"  {'distilled (P-KL + CE)':<24}{fmt(kd.get('steps_per_s'), '.2f'):>9}{fmt(kd.get('final_eval_ce')):>13}{fmt(kl_kd):>25}",
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
    cache = Path(result["cache"])
    shown = os.path.relpath(cache) if not os.path.relpath(cache).startswith("..") else str(cache)
    out = subprocess.run([sys.executable, "-m", "xtcache.app.cli", "inspect", shown], capture_output=True, text=True)
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


