"""`xtcache teacher-dump`: run the teacher once over a corpus and write the teacher-cache store.

`run_teacher_dump` checks the inputs (`preflight`: --data resolved once into a `corpus.Corpus`,
its first rows, the output location), resolves the plan and cache key (`dump_plan`), and runs the
teacher in a pipeline of threads (`pipeline`: reading and aligning, the teacher, its targets and
the writer overlap, so the teacher never waits for the disk). Before any teacher work the cache key
(teacher, tokenizers, corpus and capture settings fingerprints) is looked up: a complete store
for the same request is reused and the run says so. `--resume` keeps committed parts (checked
against the corpus) and recomputes the rest; part boundaries are fixed runs of the writer's
document stream, so the finished store equals an uninterrupted run.

    xtcache teacher-dump --teacher T --student-tokenizer S --data corpus.jsonl --out store
"""

from __future__ import annotations

import logging
import time

from stage1_teacher.align_cmd import ensure_groups
from stage1_teacher.cache_inputs import record_digests
from stage1_teacher.capture import preflight
from stage1_teacher.capture.run import needs_check
from stage1_teacher.check_records import DEFERRED, CheckRecords
from stage1_teacher.config import TeacherDumpConfig
from stage1_teacher.dry_run import DryRun, dry_run
from stage1_teacher.pipeline import run_pipeline
from stage1_teacher.placement import place_job
from stage1_teacher.plan import find_reusable, make_plan, manifest_for, store_plan
from stage1_teacher.summary import Summary
from xtcache.errors import ConfigError
from xtcache.store import CacheWriter
from xtcache.store.tokenizer import save_teacher_tokenizer

log = logging.getLogger(__name__)


def run_teacher_dump(cfg: TeacherDumpConfig, *, engines=None, progress: bool = True) -> Summary | DryRun:
    """Run `xtcache teacher-dump`; returns the Summary (or the dry-run counts with --dry-run).

    `engines`: an optional `capture.EngineCache` shared between several dumps in one process
    (tests); without it the engines are started here and always shut down before returning.
    """
    t_start = time.perf_counter()
    place_job(cfg.teacher.tensor_parallel_size)
    corpus = preflight.check_inputs(cfg)  # corpus rows and output location, before the teacher is hashed or loaded
    plan = make_plan(cfg, corpus)
    if cfg.dry_run:
        return dry_run(cfg, plan)
    summary = Summary(store=plan.out)
    reusable = find_reusable(cfg, plan)
    if reusable is not None:
        summary.store, summary.reused = reusable, True
        if reusable != plan.out:
            summary.notes.append(f"--out {plan.out} was not written: the cache for this request is {reusable}")
        summary.alignment_groups_added = ensure_groups(reusable, plan.students, plan.teacher_tok,
                                                       cfg.store.storage_options)
        save_teacher_tokenizer(reusable, cfg.teacher.teacher, cfg.store.storage_options)  # a store without one
        log.info("complete cache for this request found at %s: no teacher work", reusable)
        return summary
    if cfg.store.cache_dir and not cfg.store.out:
        log.info("writing cache %s", plan.out)
    log.info("job %d of %d (index from %s): %d corpus ranges, %d of %d bytes", cfg.store.shard_index,
             cfg.store.num_shards, cfg.store.shard_source, len(plan.shard_plan.jobs[cfg.store.shard_index]),
             plan.shard_plan.job_bytes()[cfg.store.shard_index], plan.shard_plan.corpus_bytes())
    writer = CacheWriter(plan.out, manifest_for(cfg, plan), writer_index=cfg.store.shard_index,
                         storage_options=cfg.store.storage_options, resume=cfg.store.resume)
    try:
        if cfg.store.num_shards > 1:
            store_plan(plan, cfg.store.storage_options)
        save_teacher_tokenizer(plan.out, cfg.teacher.teacher, cfg.store.storage_options)  # what its readers need
        record_digests(plan.out, plan.corpus_digests, plan.shard_plan.fingerprint, cfg.store.storage_options)
        committed = {m.part_index: m for m in writer.committed_parts()}
        if committed and not cfg.store.resume:
            raise ConfigError(f"--out {plan.out}: writer {cfg.store.shard_index} already has {len(committed)} "
                              "committed parts from an earlier run; pass --resume to continue it")
        checks = CheckRecords(cfg, plan) if needs_check(cfg) else None
        run_pipeline(cfg, plan, writer, committed, summary, engines, progress, checks)
        # parts captured on the strength of another writer's check (deferred here, or by an earlier
        # run of this writer when nothing was left to capture) wait for its passed record
        if checks is not None and (summary.check_source == DEFERRED or
                                   (summary.check_source == "" and not checks.checker)):
            rec = checks.wait_for_passed()
            summary.check_gap, summary.check_source = rec.max_gap, f"checked by writer {rec.writer_index}"
        summary.wall_s = time.perf_counter() - t_start
        if summary.documents == 0 and not committed and summary.skipped:
            reasons = ", ".join(f"{n} {r}" for r, n in sorted(summary.skipped.items()))
            field_flag = (f"--messages-field {plan.messages_field!r}" if plan.messages_field else
                          f"--text-field {cfg.input.text_field!r}")
            raise ConfigError(f"no usable document in --data (skipped: {reasons}); check {field_flag} and the "
                              "corpus files")
        writer.finish(summary.as_dict())
    finally:
        writer.close()
    return summary
