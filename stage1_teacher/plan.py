"""What `xtcache teacher-dump` resolves before the teacher runs, and the lookup of a store to reuse.

`make_plan` loads the tokenizers, sizes the windows, obtains the shard plan, digests this job's
corpus files and combines the fingerprints into the cache key; `find_reusable` finds a complete
store for that key (at --out or under --cache-dir); `manifest_for` is the manifest a new store gets.

    python -c "from stage1_teacher.plan import make_plan"   # used by stage1_teacher.dump
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass

import xtcache
from schemas.models import DRAWN_MODES, AlignGroupMeta, Manifest, support_width
from stage1_teacher.cache_inputs import capture_identity, share_digests
from stage1_teacher.capture import preflight
from stage1_teacher.capture.head import read_config, weight_files
from stage1_teacher.config import DEFAULT_MAX_SEQ_LEN, TeacherDumpConfig, settings_for_fingerprint
from stage1_teacher.corpus import Corpus
from stage1_teacher.prep import StudentSide
from stage1_teacher.shard_plan import PLAN_FILE, obtain_plan
from xtcache import fingerprint as fpr
from xtcache.chat.side import tokenizer_side
from xtcache.cliconfig import leaf_fields
from xtcache.errors import ConfigError, StoreError
from xtcache.location import Location
from xtcache.store import CacheReader, cache_path_for, find_cache

log = logging.getLogger(__name__)


@dataclass
class Plan:
    """Everything resolved before the teacher runs."""

    teacher_tok: object
    students: list[StudentSide]
    vocab_size: int
    k: int  # the store's k: --top-k in topk mode, V in full, min(--num-samples, V) in sampled
    window_len: int
    max_model_len: int
    cache_key: str
    fingerprints: dict
    settings: dict
    out: str
    shard_plan: object  # shard_plan.ShardPlan
    messages_field: str | None = None  # conversation corpus: the field holding the messages
    corpus: Corpus | None = None  # --data, resolved once
    corpus_digests: object = None  # cache_inputs.ShareDigests: this job's files, checked against the store
    part_positions: int | None = None  # parts also end at this many positions (part_position_limit)


PART_BYTES = 1 << 30  # most target bytes of a limited part (several parts are in flight: queued, posted, written)
LIMIT_FROM = 8 << 30  # the limit applies where --docs-per-part windows of targets could pass this
TARGET_BYTES = 8  # per entry: an int32 id and a float32 value


def part_position_limit(docs_per_part: int, window_len: int, k: int) -> int | None:
    """Most positions of one part where `docs_per_part` documents of one window each could hold more than LIMIT_FROM
    bytes of `k`-wide targets (full mode on a real vocabulary: 49,152 ids make 384 KiB a position, 2,730 positions
    a part; a top-k of thousands), so that the parts in flight fit in memory; None elsewhere (parts end at
    `docs_per_part` documents alone, and the store's fingerprint is what it was before the limit existed). A part
    never splits a document."""
    if docs_per_part * window_len * k * TARGET_BYTES <= LIMIT_FROM:
        return None
    return max(1, PART_BYTES // (k * TARGET_BYTES))


def make_plan(cfg: TeacherDumpConfig, corpus: Corpus | None = None) -> Plan:
    """Resolve everything before the teacher runs; `corpus`: --data already resolved (by
    `preflight.check_inputs`), else resolved here."""
    t, c = cfg.teacher, cfg.capture
    if not os.path.isdir(t.teacher):
        raise ConfigError(f"--teacher {t.teacher}: no such directory")
    model_cfg = read_config(t.teacher)
    weight_files(t.teacher)
    corpus = corpus or preflight.open_corpus(cfg)
    messages_field = corpus.messages_field
    # every model renders a conversation with its own template: one without is refused before the teacher loads
    teacher = tokenizer_side(t.teacher, "teacher tokenizer", conversation=bool(messages_field))
    teacher_tok, t_fp = teacher.tokenizer, teacher.tokenizer_fp
    vocab_size = len(teacher_tok)
    conversation = None
    if messages_field:
        conversation = {"messages_field": messages_field, "teacher_chat": teacher.fingerprint,
                        "teacher_turn_markers": list(teacher.turn_markers)}
    students = []
    for path in cfg.student_tokenizer:
        side = tokenizer_side(path, "student tokenizer", conversation=bool(messages_field))
        if any(s.fingerprint == side.fingerprint for s in students):
            continue
        students.append(StudentSide(name=path, tokenizer=side.tokenizer, fingerprint=side.fingerprint,
                                    identity=side.fingerprint == teacher.fingerprint))

    try:
        k = support_width(c.mode, c.top_k, c.num_samples, vocab_size)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    max_pos = int(model_cfg.get("max_position_embeddings") or model_cfg.get("text_config", {}).get(
        "max_position_embeddings") or (c.max_seq_len + 1))
    max_model_len = t.max_model_len or min(c.max_seq_len + 1, max_pos)
    window_len = min(c.max_seq_len, max_model_len - 1)
    if window_len < c.max_seq_len:  # the context less one: --max-model-len must exceed the window
        if c.max_seq_len > max_pos and c.max_seq_len != DEFAULT_MAX_SEQ_LEN:  # asked for more than the context
            log.warning("--max-seq-len %d exceeds the teacher's context (%d positions): windows of %d tokens",
                        c.max_seq_len, max_pos, window_len)
        else:  # the default, a cap, or the context itself
            log.info("windows of %d tokens: the teacher's context (%d positions) less one", window_len, max_pos)
    if c.window_overlap > window_len - 3:
        raise ConfigError(f"--window-overlap {c.window_overlap}: must be below the window of {window_len} - 2")
    part_positions = part_position_limit(cfg.store.docs_per_part, window_len, k)
    if part_positions:
        log.info("parts end at %d documents or %d positions (%.1f GiB of %d-wide targets held until a part is "
                 "written), whichever comes first", cfg.store.docs_per_part, part_positions,
                 part_positions * k * TARGET_BYTES / (1 << 30), k)
    boundary = sorted(s.fingerprint for s in students if not s.identity)
    s = cfg.store
    shards = obtain_plan(corpus, corpus.field, num_jobs=s.num_shards, job=s.shard_index,
                         out=s.out,
                         storage_options=cfg.data_options, store_options=s.storage_options, dry_run=cfg.dry_run)
    if s.num_shards > 1:  # this job's own files, before the teacher's weights are hashed
        preflight.check_job_files(corpus, sorted({r.file for r in shards.jobs[s.shard_index]}))
    settings = settings_for_fingerprint(cfg, window_len=window_len, boundary_tokenizers=boundary,
                                        shard_plan=shards.fingerprint, conversation=conversation,
                                        part_positions=part_positions)
    settings["capture_engine"] = capture_identity(t)
    # one job: every byte's digest is in the key; several: each job checks its files against the store
    share = None if s.num_shards > 1 else share_digests(
        corpus, shards, 0, s.out, storage_options=cfg.data_options, store_options=s.storage_options)
    fingerprints = {"teacher_model": fpr.model_fingerprint(t.teacher), "teacher_tokenizer": t_fp,
                    "corpus": shards.corpus_fingerprint if share is None else fpr.content_fingerprint(
                        share.files.values()), "settings": fpr.settings_fingerprint(settings)}
    key = fpr.cache_key(**fingerprints)
    out = s.out or cache_path_for(s.cache_dir, key)
    share = share or share_digests(corpus, shards, s.shard_index, out, storage_options=cfg.data_options,
                                   store_options=s.storage_options)
    log.info("corpus check, job %d: %s", s.shard_index, share.stats.line())
    return Plan(teacher_tok=teacher_tok, students=students, vocab_size=vocab_size, k=k,
                window_len=window_len, max_model_len=max_model_len, cache_key=key, fingerprints=fingerprints,
                settings=settings, out=out, shard_plan=shards, messages_field=messages_field, corpus_digests=share,
                corpus=corpus, part_positions=part_positions)


def manifest_for(cfg: TeacherDumpConfig, plan: Plan):
    groups = [AlignGroupMeta(fingerprint=s.fingerprint, tokenizer_name=s.name, vocab_size=len(s.tokenizer),
                             identity=s.identity) for s in plan.students]
    return Manifest(cache_key=plan.cache_key, mode=cfg.capture.mode, k=plan.k, teacher_vocab_size=plan.vocab_size,
                    num_samples=cfg.capture.num_samples if cfg.capture.mode in DRAWN_MODES else None,
                    top_k=cfg.capture.top_k if cfg.capture.mode == "headtail" else None,
                    num_writers=cfg.store.num_shards, teacher_name=os.path.abspath(cfg.teacher.teacher),
                    fingerprints=plan.fingerprints, settings=plan.settings, alignment_groups=groups,
                    xtcache_version=getattr(xtcache, "__version__", ""),
                    shard_plan=plan.shard_plan.meta() if cfg.store.num_shards > 1 else None,
                    conversation=plan.messages_field is not None)


def find_reusable(cfg: TeacherDumpConfig, plan: Plan) -> str | None:
    """URL of a complete store for this cache key (at --out or under --cache-dir), else None."""
    try:
        r = CacheReader(plan.out, cfg.store.storage_options)
    except StoreError:
        r = None
        preflight.refuse_foreign(plan.out, cfg.store.storage_options)
    if r is not None:
        if r.manifest.cache_key != plan.cache_key and preflight.replace_stub(r, plan.out):
            return None
        had = r.manifest.shard_plan
        if had is not None and had.fingerprint != plan.shard_plan.fingerprint:
            raise StoreError(f"--out {plan.out} was filled under another shard plan ({had.num_jobs} jobs, fingerprint "
                             f"{had.fingerprint[:12]}..); a store keeps one plan: use another --out")
        if r.manifest.cache_key != plan.cache_key:
            raise StoreError(f"--out {plan.out} holds a cache of another key "
                             f"({'; '.join(key_differences(r.manifest, plan))}); use another --out, rerun with the "
                             "store's settings, or delete that store")
        if r.is_complete():
            return plan.out
    if cfg.store.cache_dir:
        return find_cache(cfg.store.cache_dir, plan.cache_key, cfg.store.storage_options)
    return None



def key_differences(stored, plan: Plan) -> list[str]:
    """What makes a store's cache key (manifest `stored`) differ from this run's: each differing
    component fingerprint, and each capture setting by its flag, "in the store" vs "now"."""
    names = {"teacher_model": "--teacher (the model's weights or config)", "teacher_tokenizer": "the teacher tokenizer",
             "corpus": "--data (the corpus files' names, sizes or bytes)"}
    out = [f"{what}: {str(stored.fingerprints.get(c))[:12]}.. in the store, {str(plan.fingerprints.get(c))[:12]}.. now"
           for c, what in names.items() if stored.fingerprints.get(c) != plan.fingerprints.get(c)]
    leaves = leaf_fields(TeacherDumpConfig)
    flags = {"max_seq_len": "window length (--max-seq-len, within the teacher's context)",
             "window_cut_tokenizers": "--student-tokenizer", "capture_engine": "--engine",
             "shard_plan": "--num-shards (the shard plan)"}
    for k in sorted(set(stored.settings) | set(plan.settings)):
        a, b = stored.settings.get(k), plan.settings.get(k)
        if a != b:
            flag = flags.get(k) or (leaves[k].flag if k in leaves else f"setting {k}")
            out.append(f"{flag}: {_brief(a)} in the store, {_brief(b)} now")
    if not out and stored.fingerprints.get("settings") != plan.fingerprints.get("settings"):
        out.append("capture settings")
    return out or ["cache key"]


def _brief(value) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 60 else text[:57] + "..."


def store_plan(plan: Plan, storage_options: dict) -> None:
    """The store keeps the plan its writers read by (written here when no writer 0 stored it first)."""
    loc = Location(plan.out, storage_options)
    if loc.read_json(PLAN_FILE) is None:
        loc.create_exclusive(PLAN_FILE, plan.shard_plan.as_json())
