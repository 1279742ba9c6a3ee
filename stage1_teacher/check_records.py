"""The store's first-batch check records of the vLLM fast path (`capture_checks/<key>.json`): who
runs the check, who trusts whose record, and the wait for writer 0's record.

    python -c "from stage1_teacher.check_records import CheckRecords"   # used by stage1_teacher.dump
"""

from __future__ import annotations

import logging

from schemas.models import CaptureCheck
from stage1_teacher.capture.run import check_key
from stage1_teacher.config import TeacherDumpConfig
from stage1_teacher.plan import Plan
from stage1_teacher.polling import poll_until
from xtcache.errors import CaptureError, CorruptionError
from xtcache.location import Location, now_iso, read_model

log = logging.getLogger(__name__)


class CheckRecords:
    """The store's first-batch checks of the vLLM fast path (`capture_checks/<key>.json`).

    The check costs a second engine start (the prompt-log-probs reference), so a store runs it
    once per (teacher, vLLM version, dtype, tensor-parallel size): writer 0 (or a single job) runs
    it when no record exists and records it; the other writers start only the hidden-state engine
    and, before marking themselves done, wait for a passed record. A writer whose key differs from
    the recorded ones runs its own check. A failed record stops every writer. With
    `--trust-check-from STORE` a writer whose store holds no record for its key trusts STORE's
    passed record instead (one teacher filling several stores checks once) and writer 0 keeps a
    copy in this store, naming STORE in its `reference`, for the other writers (`keep_borrowed`);
    STORE without one is an error before any engine starts.
    """

    def __init__(self, cfg: TeacherDumpConfig, plan: Plan):
        t = cfg.teacher
        self.what = check_key(plan.fingerprints["teacher_model"], t)
        self.loc = Location(plan.out, cfg.store.storage_options)
        self.rel = f"capture_checks/{self.what['key']}.json"
        self.writer = cfg.store.shard_index
        self.checker = cfg.store.shard_index == 0 or cfg.store.num_shards == 1
        self.trust_from = t.trust_check_from
        self.borrowed_from: str | None = None  # the other store whose record `read` returned
        self.borrowed = None  # that record
        self.storage_options = cfg.store.storage_options

    def runs_here(self) -> bool:
        """No record for this key: writer 0 checks; another writer checks only when the store holds
        records for other keys only (writer 0 checked another vLLM version, dtype or TP size)."""
        return self.checker or any(n.endswith(".json") for n in self.loc.listdir("capture_checks"))

    def read(self):
        raw = self.loc.read_json(self.rel)
        rec = None if raw is None else read_model(CaptureCheck, raw, f"{self.loc.url}/{self.rel}")
        if rec is None and self.trust_from:
            other = Location(self.trust_from, self.storage_options)
            raw = other.read_json(self.rel)
            if raw is None:
                raise CaptureError(f"--trust-check-from {self.trust_from}: that store holds no first-batch check of "
                                   f"this teacher, vLLM {self.what['vllm_version']} on {self.what['platform']}, "
                                   f"{'eager' if self.what['enforce_eager'] else 'compiled'}, dtype "
                                   f"{self.what['dtype']} and tensor-parallel size "
                                   f"{self.what['tensor_parallel_size']} ({self.rel}); drop the option to run the "
                                   "check here")
            rec = read_model(CaptureCheck, raw, f"{other.url}/{self.rel}")
            self.borrowed, self.borrowed_from = rec, other.url
        if rec is not None and any(getattr(rec, f) != v for f, v in self.what.items()):
            raise CorruptionError(f"{self.rel}: the record names another teacher, vLLM, platform or settings than "
                                  f"its key ({rec.platform or 'no platform'}, vLLM {rec.vllm_version}, dtype "
                                  f"{rec.dtype}); it was not written by xtcache for this key: remove it")
        if rec is not None and not rec.passed:
            raise CaptureError(f"writer {rec.writer_index}'s first-batch check of the fast path failed for this teacher "
                               f"(vLLM {rec.vllm_version}, dtype {rec.dtype}); rerun the store with --no-fast-path")
        return rec

    def keep_borrowed(self) -> None:
        """Writer 0 copies the passed record `read` took from --trust-check-from into this store, so
        that the store's other writers and its resumes trust it without the option."""
        if self.borrowed is not None and self.borrowed.passed and self.checker:
            copy = self.borrowed.model_copy(update={"reference": f"{self.borrowed.reference}; recorded in "
                                                                 f"{self.borrowed_from}"})
            self.loc.create_exclusive(self.rel, copy.model_dump(mode="json"))

    def write(self, check: dict) -> None:
        rec = CaptureCheck(**self.what, **check, writer_index=self.writer, created=now_iso())
        if not self.loc.create_exclusive(self.rel, rec.model_dump(mode="json")):
            log.info("a first-batch check record already exists at %s/%s", self.loc.url, self.rel)

    def wait_for_passed(self):
        rec = self.read()
        if rec is None:
            log.info("waiting for writer 0's first-batch check record at %s/%s", self.loc.url, self.rel)
            rec = poll_until(self.read, timeout_s=CHECK_WAIT_S, poll_s=2.0, expired=lambda: CaptureError(
                f"no first-batch check of the fast path was recorded in {self.loc.url} within {CHECK_WAIT_S:.0f} s "
                "(writer 0 runs it); this writer's parts are committed but it is not marked done: rerun it with "
                "--resume once writer 0 has run"))
        return rec


CHECK_WAIT_S = 1800.0
DEFERRED = "deferred to writer 0's record"
