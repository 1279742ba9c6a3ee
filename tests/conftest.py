"""Shared test fixtures: the toy corpus, two different tokenizers and tiny models, built once.

The setup itself (`TEST_SPEC`, cached under `TEST_CACHE`) lives in `xtcache.testing.suite` so the
benchmarks reuse it; a second local `make test` reuses the artifacts, CI builds them once per
fresh clone.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import settings

from xtcache.testing import toy
from xtcache.testing.suite import TEST_CACHE, TEST_SPEC

# Each pytest-xdist worker, and every process it starts (the xtcache CLIs, torchrun ranks, vLLM
# engines), gets an equal share of the cores: OpenMP threads of two workers oversubscribing the same
# cores spin against each other. On 2 cores, the whole suite took 12 min 18 s with the default
# threads and 7 min 07 s with one thread per worker. An explicit OMP_NUM_THREADS wins. (Nothing
# above imports torch, which reads it once.)
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, _cores // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))

# vLLM's engine runs inside the process that starts it: xtcache's default on a CPU host with one worker
# (stage1_teacher.capture.vllm_engine.engine_in_process), so the tests run the production process model.
# tests/test_stage1_vllm.py's killed dump runs vLLM's own one, as on CUDA (`xtcache.testing.suite.VLLM_PROCESSES`):
# its engine processes must exit with it. Its other dumps run in a fresh interpreter (tests/vllm_dump_jobs.py):
# vLLM's in-process start scans the modules loaded in its process, and a pytest worker holds those other test
# files imported (flask, moto).

# vLLM compiles its sampler's helper functions (log-prob ranks, top-k/top-p) with torch.compile in every
# process that samples or returns log-probs: on the CPU an inductor C++ build, 10-22 s a process while
# the inductor cache (/tmp/torchinductor_$USER) is cold, as on a fresh CI machine, and about 2 s with a
# warm one (the vLLM generate test, 2026-11-27: 37 s cold, 15 s warm, 14 s without). The tests run those
# functions eagerly, the same operations; the engine itself already runs eagerly on the CPU (xtcache's
# default there), and nothing in xtcache calls torch.compile. Production and `make gpu-check` keep it.
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

# Property tests draw the same examples on every run, so `make test` cannot flake; set
# HYPOTHESIS_PROFILE=explore to search with fresh random examples while developing.
settings.register_profile("repeatable", derandomize=True, print_blob=True)
settings.register_profile("explore", derandomize=False, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))


@pytest.fixture(scope="session")
def toy_setup() -> toy.ToySetup:
    """Corpus files, teacher (Qwen2) and student (Llama) tokenizers and models."""
    return toy.build_toy_setup(TEST_CACHE, TEST_SPEC)


@pytest.fixture(scope="session")
def teacher_tokenizer(toy_setup):
    from xtcache.tokenizer import load_tokenizer

    return load_tokenizer(toy_setup.teacher_tokenizer)


@pytest.fixture(scope="session")
def student_tokenizer(toy_setup):
    from xtcache.tokenizer import load_tokenizer

    return load_tokenizer(toy_setup.student_tokenizer)


@pytest.fixture(scope="session")
def sp_tokenizer(toy_setup, tmp_path_factory):
    """A SentencePiece-style student tokenizer (Metaspace, byte fallback), trained once."""
    import json

    from transformers import AutoTokenizer

    texts = [json.loads(line)["text"] for line in toy_setup.train_jsonl.read_text().splitlines()[:150]]
    out = tmp_path_factory.mktemp("sp")
    toy.train_sentencepiece_style_tokenizer(texts, 1024, out)
    return AutoTokenizer.from_pretrained(str(out))


@pytest.fixture(scope="session")
def teacher(toy_setup) -> str:
    """A vLLM-servable teacher with a padded lm_head, next to the toy setup (built once)."""
    from xtcache.testing.toy_teacher import build_vllm_teacher

    return str(build_vllm_teacher(toy_setup.root))


def teacher_dump(out: Path, toy_setup, jsonl: Path, n_docs: int) -> str:
    """Stage 1 itself (`xtcache teacher-dump --engine hf`, in this process) on the first `n_docs` documents of `jsonl`."""
    data = out.with_suffix(".jsonl")
    data.write_text("".join(Path(jsonl).read_text().splitlines(keepends=True)[:n_docs]))
    from tests.commands import xtcache

    proc = xtcache("teacher-dump", "--teacher", toy_setup.teacher_model, "--student-tokenizer",
                   toy_setup.student_tokenizer, "--data", data, "--out", out, "--mode", "topk", "--top-k", "16",
                   "--engine", "hf", "--docs-per-part", "16")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return str(out)


@pytest.fixture(scope="session")
def kd_caches(toy_setup, tmp_path_factory):
    """(train store, held-out store) of the toy teacher, aligned for the toy student's tokenizer.

    Defined here, once, so that every stage 2 test module shares the two stage 1 runs."""
    root = tmp_path_factory.mktemp("kd_cache")
    return (teacher_dump(root / "train", toy_setup, toy_setup.train_jsonl, 48),
            teacher_dump(root / "held", toy_setup, toy_setup.heldout_jsonl, 12))


@pytest.fixture(scope="session")
def two_doc_store(toy_setup, tmp_path_factory) -> Path:
    """A real store of two documents, aligned for the toy student's tokenizer."""
    return Path(teacher_dump(tmp_path_factory.mktemp("two_doc") / "store", toy_setup, toy_setup.train_jsonl, 2))


@pytest.fixture(scope="session")
def manifest_only(two_doc_store, tmp_path_factory) -> Path:
    """A directory holding only the manifest.json of a real store: a valid manifest, no parts, no alignment.
    train-student reads the manifest and refuses the missing alignment before DeepSpeed starts."""
    bare = tmp_path_factory.mktemp("manifest_only")
    (bare / "manifest.json").write_bytes((two_doc_store / "manifest.json").read_bytes())
    return bare


@pytest.fixture(scope="session")
def procs():
    """The warm process server of this pytest worker (`tests.commands.WarmProcs`, CPU-pinned like every
    stage 2 run of the suite): stage 2 runs and `xtcache` commands that must be processes of their own
    are forked from it, so DeepSpeed, torch and transformers are imported once per worker, not once per
    test file. A module that needs another environment defines its own `procs`."""
    from tests.commands import WarmProcs

    with WarmProcs() as server:
        yield server


def has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


# The longest files first (measured `--durations`, longest first): pytest-xdist hands whole files to
# the workers in collection order (the Makefile turns off xdist's own reordering by test count, which
# put the one-test demo files last, running alone at the end), so a long file collected last would
# run alone at the end. The plain demo goes second: it builds its own artifacts, so the other worker
# runs it while the first builds the suite's toy setup (a lock: a second test needing it would wait).
LONGEST_FIRST = ["test_rounds.py", "test_demo.py", "test_stage1_vllm.py", "test_demo_chat.py", "test_s3_walkthrough.py", "test_real_teacher.py",
                 "test_train_distributed.py", "test_device_stage2.py", "test_generate.py", "test_stage1_dump.py",
                 "test_train_multi.py", "test_gpu_check.py", "test_chat.py", "test_policy_eval.py", "test_shard_plan.py",
                 "test_codec_v3.py", "test_rollout_cache.py", "test_train_kd.py", "test_store_transient.py"]


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the order within a file stays
    if has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
