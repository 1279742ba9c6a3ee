"""`xtcache demo`: its options, and which part of the demo they run (off-policy, on conversations, on-policy)."""

from __future__ import annotations

from pathlib import Path

import typer

from xtcache.app.demo.offpolicy import DOC_BLOCKS, README, run_demo, write_readme_blocks
from xtcache.app.demo.onpolicy import run_on_policy_demo
from xtcache.app.demo.setup import SIZES
from xtcache.app.docblock import require_blocks


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
        run_on_policy_demo(Path(workdir), size, engine=engine)
        return
    if write_docs:
        require_blocks(README.parent, DOC_BLOCKS)
    result = run_demo(Path(workdir), size, chat=chat, engine=engine)
    if write_docs:
        write_readme_blocks(result)
