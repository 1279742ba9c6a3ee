"""The demo's sizes and its step 1: corpus, tokenizers and teacher, built in a child process.

    python -m xtcache.app.demo.setup --workdir .xtcache_demo --size default [--chat]   # what the demo runs

`build_setup` runs this module as a subprocess through the demo's `StageRunner`, so the libraries
that building imports (transformers, and DeepSpeed's accelerator notice with it) write to the
engine log, not the console; the child leaves DONE markers (`xtcache.testing.toy.build_once`), and
the demo then reads the same setup, already built, in its own process.
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import dataclass
from pathlib import Path

from xtcache.testing import toy
from xtcache.testing.chat import build_chat_setup

log = logging.getLogger("xtcache.app.demo.setup")  # also when run as __main__: the demo shows its lines


@dataclass(frozen=True)
class DemoSize:
    """Sizes of one demo run: the toy artifacts plus the student runs."""

    num_docs: int
    teacher_hidden: int
    teacher_steps: int
    student_steps: int
    seq_len: int
    micro_batch_size: int
    lr: float
    top_k: int
    eval_every: int
    chat_student_steps: int | None = None
    """Student steps of each `--chat` run; None: student_steps."""

    def steps(self, *, chat: bool) -> int:
        """Student steps of each run of the plain-text or the chat demo."""
        return self.chat_student_steps if chat and self.chat_student_steps else self.student_steps


SIZES = {
    "default": DemoSize(num_docs=700, teacher_hidden=128, teacher_steps=400, student_steps=150, seq_len=256,
                        micro_batch_size=8, lr=3e-3, top_k=32, eval_every=25),
    # small (the suite's): 80 steps, where distillation's lead over CE-only on held-out KL (0.073, 0.051, 0.079
    # nats with seeds 0, 1, 2, paired) is well above the spread between seeds (tests/test_demo.py); at 40 steps
    # it was 0.013-0.046. On conversations (--chat) the lead at 40 steps is already 0.137, 0.187, 0.172 nats
    # (seeds 0, 1, 2; each run's KL moves by at most 0.06 between seeds), so the chat runs stop there.
    "small": DemoSize(num_docs=260, teacher_hidden=64, teacher_steps=150, student_steps=80, seq_len=128,
                      micro_batch_size=8, lr=3e-3, top_k=16, eval_every=40, chat_student_steps=40),
}


def toy_spec(size: DemoSize):
    return toy.ToySpec(num_docs=size.num_docs, doc_chars=1500, teacher_vocab=2048, student_vocab=1536,
                       teacher_hidden=size.teacher_hidden, teacher_layers=2, student_hidden=64, student_layers=2,
                       teacher_steps=size.teacher_steps, teacher_seq_len=128, heldout_fraction=0.1)


@dataclass(frozen=True)
class DemoSetup:
    """The toy artifacts of one demo run and where its outputs go."""

    setup: object  # xtcache.testing.toy.ToySetup
    spec_key: str
    workdir: Path  # the run's outputs (WORKDIR, or WORKDIR/chat for conversations)
    train_on: tuple[str, ...]  # train-student's --train-on flags


def build_setup(run, workdir: Path, size_name: str, *, chat: bool) -> DemoSetup:
    """Step 1: corpus, tokenizers and teacher (chat templates and a conversational teacher with `chat`),
    built once under WORKDIR/artifacts (in a child run by `run`, a StageRunner) and reused."""
    spec = toy_spec(SIZES[size_name])
    fresh = not (workdir / "artifacts" / f"{'chat' if chat else 'toy'}-{spec.key()}" / "DONE").exists()
    log.info("step 1/5: corpus, tokenizers, teacher pre-training (%s)", "building" if fresh else "cached")
    cmd = [sys.executable, "-m", "xtcache.app.demo.setup", "--workdir", str(workdir), "--size", size_name]
    run.run([*cmd, *(["--chat"] if chat else [])], "demo setup: " + " ".join(cmd[2:]))
    return _setup(workdir, SIZES[size_name], chat=chat)


def _setup(workdir: Path, size: DemoSize, *, chat: bool) -> DemoSetup:
    """Build (or find, when built) the toy artifacts of `size`."""
    spec = toy_spec(size)
    setup = toy.build_toy_setup(workdir / "artifacts", spec, train_teacher=not chat)
    if not chat:
        return DemoSetup(setup=setup, spec_key=f"toy-{spec.key()}", workdir=workdir, train_on=())

    setup = build_chat_setup(setup, workdir / "artifacts" / f"chat-{spec.key()}", num_train=size.num_docs,
                             num_heldout=max(20, size.num_docs // 8), teacher_steps=size.teacher_steps,
                             teacher_hidden=size.teacher_hidden)
    return DemoSetup(setup=setup, spec_key=f"chat-{spec.key()}", workdir=workdir / "chat",
                     train_on=("--train-on", "assistant"))


def main() -> None:
    parser = argparse.ArgumentParser(description="Build the demo's toy artifacts (step 1) under WORKDIR/artifacts.")
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--size", choices=sorted(SIZES), required=True)
    parser.add_argument("--chat", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")  # xtcache.app.cli's format: the demo shows these lines
    if args.chat:
        log.info("chat templates on both tokenizers, teacher pre-trained on rendered conversations")
    _setup(Path(args.workdir), SIZES[args.size], chat=args.chat)


if __name__ == "__main__":
    main()
