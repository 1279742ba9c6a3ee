"""The test suite's toy setup, shared by tests/conftest.py and the benchmarks that reuse it.

Artifacts are cached in `.xtcache_test_cache/` at the repository root (git-ignored; override with
XTCACHE_TEST_CACHE), so a second `make test` or benchmark run reuses them.
"""

from __future__ import annotations

import os
from pathlib import Path

from xtcache.testing import toy

REPO = Path(__file__).resolve().parents[2]
VLLM_PROCESSES = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
"""Environment of a command that runs vLLM with its own process model (engine core and worker apart), as on CUDA;
on a CPU host with one worker xtcache otherwise runs the engine in the calling process
(stage1_teacher.capture.vllm_engine.engine_in_process)."""

TEST_CACHE = Path(os.environ.get("XTCACHE_TEST_CACHE", REPO / ".xtcache_test_cache"))

# Small enough to build in well under a minute on 2 CPU cores, trained enough that the teacher's
# distributions are far from uniform (real top-k structure for codecs and distillation tests).
TEST_SPEC = toy.ToySpec(num_docs=300, doc_chars=1200, teacher_vocab=2048, student_vocab=1536,
                        teacher_hidden=64, teacher_layers=2, student_hidden=64, student_layers=2,
                        teacher_steps=150, teacher_seq_len=128)
