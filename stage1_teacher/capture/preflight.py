"""Checks of `xtcache teacher-dump`'s inputs that run before anything expensive, and creates nothing.

`check_inputs` runs first in `run_teacher_dump`, before the teacher is hashed or loaded: it resolves
`--data` once into the run's `corpus.Corpus` (`open_corpus`, which returns it for the rest of the
run), every file exists and its first rows hold documents under `--text-field` (an empty file, a binary
file or a wrong field name is refused here, not after the engine started; with several jobs each job
checks only the files of its share, `check_job_files`, once it has the plan), and the output location
(`--out`, or `--cache-dir`) is a directory that can be written. `replace_stub` lets a rerun replace
a store that a failed run left behind without a single committed part. `check_device_memory` runs
in `capture.open_capture` before the teacher's lm_head loads or any engine starts: on CUDA it
refuses a configuration whose device memory budget (`stage1_teacher.capture.budget`) does not fit.

    python -c "from stage1_teacher.capture.preflight import writable_location; writable_location('--out', 'out/s', None)"
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections import Counter

from stage1_teacher.capture import budget as b
from stage1_teacher.capture.head import HEAD_ARCHITECTURES, read_config
from stage1_teacher.corpus import Corpus, Skipped, iter_file
from xtcache import devices
from xtcache.errors import ConfigError
from xtcache.location import Location, is_local, local_path
from xtcache.store.reader import foreign_entries, shown_entries

log = logging.getLogger(__name__)

FIRST_ROWS = 64  # rows read from each corpus file before any model loads


def open_corpus(cfg) -> Corpus:
    """`--data` resolved once (every file exists, has a known format and a unique base name; sizes
    kept) with its document field: --messages-field, or 'messages' when the first file's first row
    has no --text-field but a 'messages' field (recorded in cfg, logged once)."""
    corpus = Corpus.resolve(cfg.input.data, cfg.input.text_field, messages_field=cfg.input.messages_field,
                            storage_options=cfg.data_options)
    if corpus.messages_field is None:
        found = corpus.detect_messages_field()
        if found:
            log.info("--data %s holds conversations in field %r (no %r field): rendering them with each model's "
                     "chat template", cfg.input.data[0], found, cfg.input.text_field)
            cfg.input.messages_field = corpus.messages_field = found
    return corpus


def check_inputs(cfg, corpus: Corpus | None = None) -> Corpus:
    """Refuse bad --data files and an unwritable output location (a TeacherDumpConfig), one line each;
    returns the resolved corpus (`corpus`, or `open_corpus(cfg)`)."""
    corpus = corpus or open_corpus(cfg)
    if cfg.store.num_shards == 1:  # several jobs: each checks its own files once it has the plan
        check_job_files(corpus, range(len(corpus.files)))
    if cfg.dry_run:
        return corpus
    if cfg.store.out:
        writable_location("--out", cfg.store.out, cfg.store.storage_options)
    elif cfg.store.cache_dir:
        writable_location("--cache-dir", os.path.expanduser(cfg.store.cache_dir), cfg.store.storage_options)
    return corpus


def check_job_files(corpus: Corpus, files) -> None:
    """The first rows of each of `files` (indices into `corpus.files`) hold a usable document.

    A job checks only the files its share reads: with 1,000 jobs over 10,000 Parquet files, every
    job opening every file's first row group would read the corpus' first row groups 1,000 times.
    """
    for fi in files:
        _check_first_rows(corpus, fi)


def check_first_rows(url: str, text_field: str, storage_options: dict | None, messages_field: str | None = None) -> None:
    """The file exists and at least one of its first FIRST_ROWS rows is a usable document."""
    _check_first_rows(Corpus.resolve([url], text_field, messages_field=messages_field,
                                     storage_options=storage_options), 0)


def _check_first_rows(corpus: Corpus, fi: int) -> None:
    url, messages_field = corpus.files[fi].url, corpus.messages_field
    skipped: Counter[str] = Counter()
    rows = iter_file(corpus, fi)
    try:
        for n, row in enumerate(rows):
            if not isinstance(row, Skipped):
                return
            skipped[row.reason] += 1
            if n + 1 >= FIRST_ROWS:
                break
    finally:
        rows.close()
    if not skipped:
        raise ConfigError(f"--data {url}: the file is empty (no rows); give a corpus with documents")
    reasons = ", ".join(f"{n} {r}" for r, n in skipped.most_common())
    raise ConfigError(f"--data {url}: none of its first {sum(skipped.values())} rows is a usable document "
                      f"({reasons}); check " + (f"--messages-field {messages_field!r}" if messages_field else
                                                f"--text-field {corpus.text_field!r}") + " and the file's format")


def writable_location(flag: str, url: str, storage_options: dict | None) -> None:
    """A local output path is a directory (or can be created as one) where files can be written.

    Probes with a temporary file in the nearest existing directory and removes it: nothing stays
    behind. Remote URLs are checked when first written (their permissions cannot be probed for free).
    """
    if not is_local(url):
        return
    path = local_path(url)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"{flag} {url} is an existing file; give a directory for the store")
    parent = path
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ConfigError(f"{flag} {url}: {parent} is a file, so the store cannot be created there")
    try:
        fd, probe = tempfile.mkstemp(prefix=".tmp-xtcache-probe-", dir=parent)
    except OSError as e:
        raise ConfigError(f"{flag} {url}: cannot write under {parent} ({e.strerror or e})") from None
    os.close(fd)
    os.unlink(probe)


def replace_stub(reader, url: str) -> bool:
    """Remove the store at `url` when a failed run left it with nothing in it: no committed part, no
    writer claim, no done marker. True when removed (the caller then writes a fresh store). A directory that
    also holds entries that are not the store's is refused, never removed."""
    loc = reader.loc
    if reader.shards or loc.listdir("claims") or loc.listdir("done") or any(
            loc.listdir(f"align/{fp}/index") for fp in loc.groups()):
        return False
    if extra := foreign_entries(loc):
        raise ConfigError(f"--out {url} holds a store of another cache key without any committed part, beside entries "
                          f"that are not the store's ({shown_entries(extra)}): nothing removed; use another --out")
    log.warning("--out %s holds a store of another cache key without any committed part (left by a failed "
                "run): replacing it", url)
    loc.remove_tree("")
    return True


def refuse_foreign(url: str, storage_options: dict | None) -> None:
    """Refuse an --out that holds no store (no manifest) but other entries: the store would be written among
    files that are not its own, and a later replacement of it (`replace_stub`) would have to leave them."""
    if extra := foreign_entries(Location(url, storage_options)):
        raise ConfigError(f"--out {url} holds no xtcache store but other entries ({shown_entries(extra)}); give a new "
                          "or empty directory for the store")


def check_device_memory(cfg, opts, *, window_len: int, k: int, reference_check: bool) -> object | None:
    """On CUDA with --engine vllm: refuse (ConfigError, one line with the numbers and the flag to
    change) a configuration whose memory budget does not fit cuda:0; returns the Budget (None when
    not checked). `opts`: the engines' `capture_vllm.VllmOptions`. Device memory comes from NVML, so CUDA stays uninitialised for vLLM's fork."""
    t, c = cfg.teacher, cfg.capture
    if t.engine != "vllm" or not devices.cuda_present():
        return None  # on a CPU host vLLM's share is host memory: nothing to budget on a device
    if not t.memory_check:
        log.warning("--no-memory-check: device memory not budgeted; an over-budget configuration fails when vLLM "
                    "or the lm_head runs out of memory")
        return None
    try:
        (total, used, reserved), = b.nvml_memory(b.physical_indices(1))
    except Exception as e:  # no NVML library or driver: vLLM will report what it finds
        log.warning("FALLBACK: device memory budget not checked, NVML unavailable (%s)", e)
        return None
    arch = (read_config(t.teacher).get("architectures") or ["?"])[0]
    run = b.Run(dtype=opts.dtype, tensor_parallel_size=t.tensor_parallel_size,
                gpu_memory_utilization=opts.llm_kwargs()["gpu_memory_utilization"], max_model_len=opts.max_model_len,
                window_len=window_len, batched_tokens=opts.max_num_batched_tokens, mode=c.mode, k=k,
                fast_path=t.fast_path and arch in HEAD_ARCHITECTURES, reference_check=reference_check)
    shape = b.TeacherShape.read(t.teacher)
    if reserved is None:  # NVML version 1: `used` includes the driver's reserve, which `usable` takes off already
        used = max(0, used - b.reserve_estimate(total))
    budget = b.device_budget(shape, run, total, in_use=used, reserved=reserved)
    problem = b.refusal(shape, run, budget)
    if problem:
        raise ConfigError(f"{problem} (or --no-memory-check to start anyway: the budget is an estimate)")
    log.info("device memory: vLLM share %.1f GiB holds an estimated %.1f GiB; %.1f GiB of cuda:0 left "
             "outside it for an estimated %.1f GiB", budget.share / b.GiB, budget.need_inside() / b.GiB,
             budget.rest / b.GiB, budget.need_outside() / b.GiB)
    return budget
