"""From the cache to what the trainer consumes: the loaders, the objective and the evaluation measure.

    data = open_stage_data(cfg, tokenizer, rank, world)   # called by stage2_student.trainer.train

Reads the cache manifest, decides the KD kind (`objective.resolve_kind`), loads the projection W
for cross-tokenizer caches (from --projection, or built from both tokenizers), builds this rank's
training stream and held-out stream (`stage2_student.loader`), the training `Objective` and the
evaluation's measure: the KL to the teacher computed the same way for every run, whatever the
training loss (`objective.measure_definition`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from stage2_student.config import TrainConfig
from stage2_student.objective import Capabilities, Objective, measure_definition, resolve_kind
from stage2_student.student import load_tokenizer
from xtcache.errors import ConfigError

log = logging.getLogger(__name__)


@dataclass
class StageData:
    """What the trainer needs from the cache side.

    `train` yields this rank's micro-batches (the "Stage 2 batch" of docs/architecture.md) in
    global order: step s, rank r, accumulation index a reads global micro-batch
    `s * world * grad_accum + r * grad_accum + a`, and has `state_dict()` / `load_state_dict()`.
    `make_eval` returns a fresh finite iterable of this rank's held-out micro-batches (or None).
    `objective` is the training objective; `measure` the evaluation's KL to the teacher (None
    when it cannot be computed, e.g. a cross-tokenizer cache without a projection map), defined
    by `measure_definition`.
    """

    train: Any
    objective: Objective
    make_eval: Callable[[], Iterable[dict]] | None = None
    measure: Objective | None = None
    measure_definition: str | None = None
    info: dict = field(default_factory=dict)


def load_projection(cfg: TrainConfig, manifest, student_tokenizer, student_fp: str, model_vocab: int):
    """The projection W as a sparse [V_model, V_t] tensor, checked against both tokenizer fingerprints.

    Without --projection, W is built on the fly from the student tokenizer and the teacher
    tokenizer found at the cache's recorded teacher path (its fingerprint must match the cache);
    otherwise the run stops and says how to build one.
    """
    import torch

    from xtcache import projection as xproj
    from xtcache.fingerprint import tokenizer_fingerprint

    teacher_fp = manifest.fingerprints.get("teacher_tokenizer")
    if cfg.loss.projection:
        pm = xproj.ProjectionMap.load(cfg.loss.projection, expect_student=student_fp, expect_teacher=teacher_fp)
    else:
        where = Path(manifest.teacher_name) if manifest.teacher_name else None
        teacher_tok = load_tokenizer(where) if where and (where / "tokenizer.json").is_file() else None
        if teacher_tok is None or tokenizer_fingerprint(teacher_tok) != teacher_fp:
            raise ConfigError(
                f"cross-tokenizer cache and no --projection: the teacher tokenizer recorded in the cache "
                f"({manifest.teacher_name or 'none'}) is not here or differs; build a map with `xtcache projection "
                "build --student-tokenizer STUDENT --teacher-tokenizer TEACHER --out w.safetensors` and pass "
                "--projection w.safetensors")
        log.warning("no --projection: building the projection map from %s and the student tokenizer", where)
        pm = xproj.build_projection(student_tokenizer, teacher_tok)
    w = pm.to_torch_sparse(manifest.teacher_vocab_size).coalesce()
    if model_vocab < w.shape[0]:
        raise ConfigError(f"the student model has {model_vocab} logits, fewer than its tokenizer's {w.shape[0]} tokens")
    if model_vocab > w.shape[0]:  # padded lm_head columns: rows that map nowhere
        w = torch.sparse_coo_tensor(w.indices(), w.values(), (model_vocab, w.shape[1])).coalesce()
    return w


def open_stage_data(cfg: TrainConfig, tokenizer, rank: int, world: int) -> StageData:
    """Open the cache (and the held-out set), pick the KD kind, load W, build this rank's loaders."""
    import deepspeed
    from transformers import AutoConfig

    from stage2_student.losses import ProjectionOperator
    from xtcache.fingerprint import tokenizer_fingerprint
    from xtcache.store import CacheReader

    manifest = CacheReader(cfg.cache, storage_options=cfg.loader.storage_options).manifest
    student_fp = tokenizer_fingerprint(tokenizer)
    # the loader refuses a student tokenizer the cache has no alignment for, with what to run
    train, make_eval = make_loaders(cfg, tokenizer, rank, world)
    caps = Capabilities(same_tokenizer=student_fp == manifest.fingerprints.get("teacher_tokenizer"),
                        mode=manifest.mode)
    name = resolve_kind(cfg.loss.loss, caps)
    projection = None
    if not caps.same_tokenizer:
        model_vocab = AutoConfig.from_pretrained(cfg.student).vocab_size
        try:
            w = load_projection(cfg, manifest, tokenizer, student_fp, model_vocab)
        except ConfigError:
            if name == "pkl":
                raise
            log.warning("no projection map: the evaluation's KL to the teacher and top-1 agreement are not measured")
        else:
            projection = ProjectionOperator(w).to(deepspeed.get_accelerator().current_device_name())
    objective = Objective.from_config(cfg.loss, caps, projection)
    measure = None
    if caps.same_tokenizer or projection is not None:
        measure = Objective("kl" if caps.same_tokenizer else "pkl", ce_weight=0.0, projection=projection)
    info = {"cache": cfg.cache, "mode": manifest.mode, "k": manifest.k, "same_tokenizer": caps.same_tokenizer,
            "teacher_vocab": manifest.teacher_vocab_size, "student_fingerprint": student_fp, "kd_loss": name,
            "trained_on": "ce" if cfg.loss.loss == "ce" else name}
    log.info("cache %s: mode %s k=%d, %s-tokenizer, KD loss %s%s", cfg.cache, manifest.mode, manifest.k,
             "same" if caps.same_tokenizer else "cross", name,
             " (training on CE only)" if cfg.loss.loss == "ce" else "")
    # held-out batches from --eval-cache are measured over what that store holds (e.g. a full cache: exact)
    eval_caps = caps
    if cfg.eval.eval_fraction <= 0 and cfg.eval.eval_cache:
        eval_mode = CacheReader(cfg.eval.eval_cache, storage_options=cfg.loader.storage_options).manifest.mode
        eval_caps = Capabilities(same_tokenizer=caps.same_tokenizer, mode=eval_mode)
    return StageData(train=train, objective=objective, make_eval=make_eval, measure=measure,
                     measure_definition=measure_definition(eval_caps) if measure is not None else None, info=info)


def make_loaders(cfg: TrainConfig, tokenizer, rank: int, world: int):
    """This rank's resumable training stream and a factory of its held-out stream (or None): what
    `xtcache train-student` reads, from a TrainConfig. Refuses, before any model loads, a --seq-len
    above the student's max_position_embeddings and a store that is incomplete or damaged in what
    planning reads (unless --allow-incomplete)."""
    from transformers import AutoConfig

    from stage2_student.loader import CacheDataset, CacheLoader

    limit = getattr(AutoConfig.from_pretrained(cfg.student), "max_position_embeddings", None)
    if limit is not None and cfg.loader.seq_len > limit:
        raise ConfigError(f"--seq-len {cfg.loader.seq_len} is above the student's max_position_embeddings {limit} "
                          f"({cfg.student}/config.json); use --seq-len {limit} or less")
    common = dict(seq_len=cfg.loader.seq_len, micro_batch_size=cfg.loader.micro_batch_size, rank=rank,
                  world_size=world, seed=cfg.seed, storage_options=cfg.loader.storage_options,
                  pad_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0,
                  allow_incomplete=cfg.loader.allow_incomplete, train_on=cfg.loader.train_on)
    fraction = cfg.eval.eval_fraction
    train_ds = CacheDataset(cfg.cache, tokenizer, grad_accum=cfg.optim.grad_accum, split="train",
                            holdout_fraction=fraction, **common)
    train = CacheLoader(train_ds, num_workers=cfg.loader.num_workers)
    if fraction > 0:
        eval_ds = CacheDataset(cfg.cache, tokenizer, split="eval", holdout_fraction=fraction, **common)
    elif cfg.eval.eval_cache:
        eval_ds = CacheDataset(cfg.eval.eval_cache, tokenizer, split="all", epochs=1, shuffle=False, **common)
    else:
        return train, None
    return train, lambda: CacheLoader(eval_ds, num_workers=0)
