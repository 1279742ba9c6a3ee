"""From the cache to what the trainer consumes: the loaders, the objective and the evaluation measure.

    data = open_stage_data(cfg, tokenizer, rank, world)   # called by stage2_student.trainer.train

Reads the cache manifest, decides the KD kind (`objective.resolve_kind`), loads the projection W
for cross-tokenizer caches (from --projection, or built from both tokenizers), builds this rank's
training stream and held-out stream (`stage2_student.loader`), the training `Objective` and the
evaluation's measure: the KL to the teacher computed the same way for every run, whatever the
training loss (`objective.measure_definition`).
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from stage2_student.config import LossConfig, TrainConfig
from stage2_student.loader import CacheDataset, CacheLoader, student_fingerprint
from stage2_student.losses import ProjectionOperator
from stage2_student.mix import TeacherMix
from stage2_student.objective import Capabilities, Objective, measure_definition, resolve_kind
from stage2_student.rollout_mix import MixedLoader
from stage2_student.student import load_tokenizer
from xtcache import projection as xproj
from xtcache.errors import ConfigError, StoreError
from xtcache.fingerprint import tokenizer_fingerprint
from xtcache.store import CacheReader
from xtcache.store.tokenizer import TOKENIZER_DIR, load_store_tokenizer

log = logging.getLogger(__name__)

CORPUS_CE_WEIGHT = 1.0  # --corpus-loss ce: the weight of CE on the corpus text, as `--loss ce` trains it


@dataclass
class StageData:
    """What the trainer needs from the cache side.

    `train` yields this rank's micro-batches (the "Stage 2 batch" of docs/architecture.md) in
    global order: step s, rank r, accumulation index a reads global micro-batch
    `s * world * grad_accum + r * grad_accum + a`, and has `state_dict()` / `load_state_dict()`.
    `make_eval` returns a fresh finite iterable of this rank's held-out micro-batches (or None).
    `objective` is the training objective over the teachers (`TeacherMix`, one teacher: N = 1);
    `measures[i]` the evaluation's KL to teacher i (None when it cannot be computed, e.g. a
    cross-tokenizer cache without a projection map), defined by `measure_definition`;
    `mixture_measure` the KL to the teachers' mixture (teachers sharing a vocabulary, else None).
    `tokenizer` is the student tokenizer the caches were opened for (the export saves it beside the weights).
    `corpus_objective`: with `--corpus-loss ce` or `auto`, the objective of the --corpus-cache's micro-batches (those
    the mixed stream marks, `rollout_mix.CORPUS_OBJECTIVE_KEY`); else None (they train `objective`).
    """

    train: Any
    objective: TeacherMix
    tokenizer: Any
    make_eval: Callable[[], Iterable[dict]] | None = None
    measures: list[Objective | None] = field(default_factory=list)
    measure_definition: str | None = None
    mixture_measure: Objective | None = None
    info: dict = field(default_factory=dict)
    corpus_objective: TeacherMix | None = None

    @property
    def measure(self) -> Objective | None:
        """The first teacher's measure (the one measure of a single-teacher run)."""
        return self.measures[0] if self.measures else None


def load_projection(cfg: TrainConfig, url: str, manifest, student_tokenizer, student_fp: str, model_vocab: int,
                    path: str | None = None):
    """The projection W as a sparse [V_model, V_t] tensor, checked against both tokenizer fingerprints, and where
    it came from: {"cache", "map" (the --projection file, or "built"), "sha256" (`ProjectionMap.digest`),
    "unreached_teacher_ids" (how many teacher ids no row of W points at: P-KL has no student probability for
    them, `xtcache.projection.unreached_teacher_ids`, docs/losses.md)}.

    `path`: the --projection of the cache at `url`. Without one, W is built on the fly from the
    student tokenizer and the teacher tokenizer the store carries (`xtcache.store.tokenizer`), or,
    in a store without one, the tokenizer at the store's recorded teacher path (its fingerprint must
    match the cache); otherwise the run stops and says how to build one.
    """
    import torch

    teacher_fp = manifest.fingerprints.get("teacher_tokenizer")
    if path:
        pm = xproj.ProjectionMap.load(path, expect_student=student_fp, expect_teacher=teacher_fp)
    else:
        teacher_tok, where = load_store_tokenizer(url, manifest, cfg.loader.storage_options), f"{url}/{TOKENIZER_DIR}"
        if teacher_tok is None:  # a store written before teacher-dump stored its teacher's tokenizer
            recorded = Path(manifest.teacher_name) if manifest.teacher_name else None
            teacher_tok = load_tokenizer(recorded) if recorded and (recorded / "tokenizer.json").is_file() else None
            where = str(recorded)
        if teacher_tok is None or tokenizer_fingerprint(teacher_tok) != teacher_fp:
            raise ConfigError(
                f"cross-tokenizer cache {url} and no --projection: the store carries no teacher tokenizer and the one "
                f"recorded in it ({manifest.teacher_name or 'none'}) is not here or differs; build a map with "
                "`xtcache projection build --student-tokenizer STUDENT --teacher-tokenizer TEACHER --out "
                "w.safetensors` and pass --projection w.safetensors")
        log.warning("no --projection: building the projection map from %s and the student tokenizer", where)
        pm = xproj.build_projection(student_tokenizer, teacher_tok)
    unreached = int(xproj.unreached_teacher_ids(pm, manifest.teacher_vocab_size).size)
    source = {"cache": url, "map": str(path) if path else "built", "sha256": pm.digest(),
              "unreached_teacher_ids": unreached}
    if unreached:
        log.info("projection of %s: %d of the %d teacher ids no student row reaches: at a chunk's first row P-KL "
                 "has no student probability to set against theirs (`xtcache projection inspect` names some; "
                 "docs/losses.md)", url, unreached,
                 pm.teacher_vocab_size if pm.teacher_vocab_size >= 0 else manifest.teacher_vocab_size)
    w = pm.to_torch_sparse(manifest.teacher_vocab_size).coalesce()
    if model_vocab < w.shape[0]:
        raise ConfigError(f"the student model has {model_vocab} logits, fewer than its tokenizer's {w.shape[0]} tokens")
    if model_vocab > w.shape[0]:  # padded lm_head columns: rows that map nowhere
        w = torch.sparse_coo_tensor(w.indices(), w.values(), (model_vocab, w.shape[1]),
                                    check_invariants=True).coalesce()
    return w, source


def open_stage_data(cfg: TrainConfig, tokenizer, rank: int, world: int, *,
                    checked: CheckedStores | None = None) -> StageData:
    """Open the caches (and the held-out set), pick each teacher's KD kind, load W, build this rank's loaders.
    `checked`: what `check_stores` returned for this config and tokenizer (stage2_student.cli runs it before
    DeepSpeed starts); without it, or when it covers another config or tokenizer, the stores are checked here."""
    manifests = [CacheReader(c, storage_options=cfg.loader.storage_options).manifest for c in cfg.cache]
    student_fp = tokenizer_fingerprint(tokenizer)
    if checked is None or not checked.covers(cfg, tokenizer):
        check_stores(cfg, tokenizer)
    train, make_eval = make_loaders(cfg, tokenizer, rank, world)
    caps = [Capabilities(same_tokenizer=student_fp == m.fingerprints.get("teacher_tokenizer"), mode=m.mode)
            for m in manifests]
    combine = cfg.loss.teacher_combine if len(cfg.cache) > 1 else "sum"
    if combine == "mean-probs":
        fps = {m.fingerprints.get("teacher_tokenizer") for m in manifests}
        if len(fps) > 1 or len({m.teacher_vocab_size for m in manifests}) > 1:
            raise ConfigError("--teacher-combine mean-probs mixes distributions over one vocabulary, and the caches' "
                              "teachers have different tokenizers: use --teacher-combine sum, dynamic or select")
    names, projections, maps = _kinds_and_projections(cfg, manifests, caps, tokenizer, student_fp, combine)
    corpus = None
    if cfg.loader.corpus_cache:
        corpus = corpus_objective(cfg, check_corpus(cfg, manifests[0], names[0], student_fp), projections[0])
    if "rkl-pg" in names and (foreign := train.dataset.foreign_rows()):  # --corpus-cache is refused with rkl-pg
        raise ConfigError(f"--loss rkl-pg trains the student on its own samples, and the cache {foreign} are no "
                          "rollouts of it (corpus rows, or samples of another policy): keep them in a cache of their "
                          "own and train on it with another --loss")
    weights = cfg.teacher_weights()
    kinds = names[:1] if combine == "mean-probs" else names
    objectives = [Objective.from_config(cfg.loss, caps[i], projections[i], kind=None if cfg.loss.loss == "ce" else
                                        kinds[i], with_ce=i == 0) for i in range(len(kinds))]
    objective = TeacherMix(objectives, combine=combine, weights=weights, score=cfg.loss.teacher_score,
                           alpha=cfg.loss.teacher_alpha, vocab_sizes=[m.teacher_vocab_size for m in manifests])
    measures = [Objective("kl" if c.same_tokenizer else "pkl", ce_weight=0.0, projection=p, with_ce=False)
                if (c.same_tokenizer or p is not None) else None for c, p in zip(caps, projections)]
    mixture = None
    if len(cfg.cache) > 1 and measures[0] is not None and len({m.fingerprints.get("teacher_tokenizer")
                                                                for m in manifests}) == 1:
        mixture = measures[0]  # teachers of one tokenizer: their mixture is measured with teacher 0's measure
    if combine == "mean-probs":
        measures = [measures[0]] * len(cfg.cache)
    info = _run_info(cfg, manifests, caps, names, objective, weights, combine, student_fp, train.dataset)
    if maps:  # which projection each cross-tokenizer cache was read through: a summary names its map by content
        info["projections"] = maps
    if corpus is not None:
        log.info("--corpus-loss %s: the corpus cache's micro-batches train %s", cfg.loader.corpus_loss,
                 corpus.describe())
    # held-out batches from --eval-cache are measured over what that store holds (e.g. a full cache: exact)
    eval_caps = caps[0]
    if cfg.eval.eval_fraction <= 0 and cfg.eval.eval_cache:
        eval_mode = CacheReader(cfg.eval.eval_cache[0], storage_options=cfg.loader.storage_options).manifest.mode
        eval_caps = Capabilities(same_tokenizer=caps[0].same_tokenizer, mode=eval_mode)
    return StageData(train=train, objective=objective, tokenizer=tokenizer, make_eval=make_eval, measures=measures,
                     measure_definition=measure_definition(eval_caps) if measures[0] is not None else None,
                     mixture_measure=mixture, info=info, corpus_objective=corpus)


@dataclass(frozen=True)
class CheckedStores:
    """What `check_stores` passed for: a copy of the config and the student tokenizer object. Handed to
    `open_stage_data` (through `trainer.train`) so that a process checks its stores once."""

    config: TrainConfig
    tokenizer: Any

    def covers(self, cfg: TrainConfig, tokenizer) -> bool:
        """Whether the check was of this config (as it is now) and this tokenizer."""
        return self.tokenizer is tokenizer and self.config == cfg


def check_stores(cfg: TrainConfig, tokenizer) -> CheckedStores:
    """Refuse an --eval-cache that cannot measure the distance to the --cache's teacher (`check_eval_caches`),
    and a --cache, --corpus-cache or --eval-cache without an alignment group for the student tokenizer or,
    without --allow-incomplete, not complete or not aligned in every part: one line naming the flag and the
    store, before any model loads. The loader refuses the same (`CacheDataset`), for callers without this.
    Returns the record of what passed (`CheckedStores`)."""
    opts = cfg.loader.storage_options
    readers = [CacheReader(url, storage_options=opts) for url in cfg.cache]
    named = [("--cache", r) for r in readers]
    if cfg.loader.corpus_cache:
        named.append(("--corpus-cache", CacheReader(cfg.loader.corpus_cache, storage_options=opts)))
    if cfg.eval.eval_fraction <= 0 and cfg.eval.eval_cache:
        held = [CacheReader(url, storage_options=opts) for url in cfg.eval.eval_cache]
        check_eval_caches(cfg, [r.manifest for r in readers], [r.manifest for r in held])
        named += [("--eval-cache", r) for r in held]
    for flag, reader in named:
        fp = student_fingerprint(tokenizer, chat=reader.manifest.conversation)
        group = reader.student_group(fp, f"{flag} {reader.url}")
        if not cfg.loader.allow_incomplete:
            try:
                reader.usable_parts(None if group is None else fp)
            except StoreError as err:
                raise StoreError(f"{flag} {err}") from None
    return CheckedStores(copy.deepcopy(cfg), tokenizer)


def check_eval_caches(cfg: TrainConfig, manifests, held_manifests) -> None:
    """Refuse an --eval-cache whose held-out KL would not measure the distance to the --cache's teacher.

    The evaluation reads eval store i through training store i's teacher vocabulary, projection map
    and student alignment, so eval store i must agree with training store i on what those rely on:
    the teacher (model and tokenizer, hence the teacher vocabulary and any --projection, which is
    checked against the training store) and the kind of corpus (conversations or plain text); its
    alignment group for this student is checked with the other stores' (`check_stores`). One line
    naming --eval-cache and what differs, before any model loads.
    """
    for url, train_url, train, held in zip(cfg.eval.eval_cache, cfg.cache, manifests, held_manifests):
        differ = [f"{what} {_short(a)} vs {_short(b)}" for what, a, b in (
            ("teacher tokenizer", held.fingerprints.get("teacher_tokenizer"), train.fingerprints.get("teacher_tokenizer")),
            ("teacher vocabulary", held.teacher_vocab_size, train.teacher_vocab_size),
            ("teacher model", held.fingerprints.get("teacher_model"), train.fingerprints.get("teacher_model")))
            if a != b]
        if differ:
            raise ConfigError(
                f"--eval-cache {url} was written by another teacher than --cache {train_url} ({'; '.join(differ)}): "
                f"its KL would not be the distance to the teacher being distilled; evaluate on a held-out store of "
                f"the same teacher ({train.teacher_name or 'see `xtcache inspect ' + train_url + '`'})")
        if held.conversation != train.conversation:
            kinds = ("conversations", "plain text")
            raise ConfigError(f"--eval-cache {url} holds {kinds[not held.conversation]} and --cache {train_url} "
                              f"{kinds[not train.conversation]}: evaluate on a store of the same kind")


def _short(value) -> str:
    """A fingerprint cut to 12 characters; other values as they are; None as 'none'."""
    if value is None:
        return "none"
    return f"{value[:12]}.." if isinstance(value, str) and len(value) == 64 else str(value)


def _kinds_and_projections(cfg: TrainConfig, manifests, caps: list[Capabilities], tokenizer, student_fp: str,
                           combine: str) -> tuple[list[str], list, list[dict]]:
    """Each cache's KD kind (`resolve_kind`) and projection operator (None for same-tokenizer caches,
    and for cross-tokenizer ones without a map when the loss does not need one: logged), and the sources of the
    maps loaded (`load_projection`)."""
    import deepspeed
    from transformers import AutoConfig

    cross = [i for i, c in enumerate(caps) if not c.same_tokenizer]
    paths = list(cfg.loss.projection)
    if paths and len(paths) != len(cross):
        raise ConfigError(f"{len(paths)} --projection for {len(cross)} cross-tokenizer cache(s) "
                          f"({', '.join(cfg.cache[i] for i in cross) or 'none'}): give one per cross-tokenizer cache, "
                          "in --cache order, or none to build them on the fly")
    model_vocab = AutoConfig.from_pretrained(cfg.student).vocab_size if cross else None
    device = deepspeed.get_accelerator().current_device_name()
    names, projections, maps = [], [], []
    for i, (m, c) in enumerate(zip(manifests, caps)):
        name = resolve_kind(cfg.loss.loss, c)
        projection = None
        if not c.same_tokenizer and (combine != "mean-probs" or i == 0):
            try:
                w, source = load_projection(cfg, cfg.cache[i], m, tokenizer, student_fp, model_vocab,
                                            paths[cross.index(i)] if paths else None)
            except ConfigError as e:
                if name == "pkl":
                    raise ConfigError(f"{cfg.cache[i]}: {e}" if len(cfg.cache) > 1 else str(e)) from None
                log.warning("%s: no projection map: the evaluation's KL to this teacher and top-1 agreement are not "
                            "measured", cfg.cache[i])
            else:
                projection = ProjectionOperator(w).to(device)
                maps.append(source)
        names.append(name)
        projections.append(projection)
    return names, projections, maps


def _run_info(cfg: TrainConfig, manifests, caps: list[Capabilities], names: list[str], objective: TeacherMix,
              weights: list[float], combine: str, student_fp: str, train_ds) -> dict:
    """The run's description (the trainer's start line and run summary), logged per cache."""
    info = {"cache": cfg.cache[0] if len(cfg.cache) == 1 else list(cfg.cache), "mode": manifests[0].mode,
            "k": manifests[0].k, "same_tokenizer": caps[0].same_tokenizer,
            "teacher_vocab": manifests[0].teacher_vocab_size, "student_fingerprint": student_fp,
            "kd_loss": objective.kind, "trained_on": "ce" if cfg.loss.loss == "ce" else objective.kind,
            "train_on": train_ds.train_on, "trained_positions": train_ds.plan_tokens["trained"],
            "context_tokens": train_ds.plan_tokens["context"]}
    if len(cfg.cache) > 1:
        info["teachers"] = [{"cache": u, "mode": m.mode, "k": m.k, "same_tokenizer": c.same_tokenizer,
                             "teacher_vocab": m.teacher_vocab_size, "kd_loss": k, "weight": w}
                            for u, m, c, k, w in zip(cfg.cache, manifests, caps, names, objective.lam
                                                     if combine != "mean-probs" else weights)]
        info["teacher_combine"] = combine
    for u, m, c, k in zip(cfg.cache, manifests, caps, names):
        log.info("cache %s: mode %s k=%d, %s-tokenizer, KD loss %s%s", u, m.mode, m.k,
                 "same" if c.same_tokenizer else "cross", k, " (training on CE only)" if cfg.loss.loss == "ce" else "")
    if len(cfg.cache) > 1:
        log.info("%d teachers, combined per chunk group by %s, weights %s", len(cfg.cache), combine,
                 ", ".join(f"{w:.3g}" for w in weights))
    return info


def make_loaders(cfg: TrainConfig, tokenizer, rank: int, world: int):
    """This rank's resumable training stream and a factory of its held-out stream (or None): what
    `xtcache train-student` reads, from a TrainConfig. Refuses, before any model loads, a --seq-len
    above the student's max_position_embeddings and a store that is incomplete or damaged in what
    planning reads (unless --allow-incomplete)."""
    from transformers import AutoConfig

    limit = getattr(AutoConfig.from_pretrained(cfg.student), "max_position_embeddings", None)
    if limit is not None and cfg.loader.seq_len > limit:
        raise ConfigError(f"--seq-len {cfg.loader.seq_len} is above the student's max_position_embeddings {limit} "
                          f"({cfg.student}/config.json); use --seq-len {limit} or less")
    common = dict(rank=rank, world_size=world, seed=cfg.seed,
                  pad_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)
    fraction = cfg.eval.eval_fraction
    train_ds = CacheDataset(cfg.cache, tokenizer, cfg.loader, grad_accum=cfg.optim.grad_accum, split="train",
                            holdout_fraction=fraction, **common)
    train = CacheLoader(train_ds, num_workers=cfg.loader.num_workers)
    if cfg.loader.corpus_cache:  # GKD's lambda: each micro-batch from the rollouts or the corpus

        corpus_ds = CacheDataset([cfg.loader.corpus_cache], tokenizer, cfg.loader, grad_accum=cfg.optim.grad_accum,
                                 split="train", holdout_fraction=fraction, **common)
        train = MixedLoader(train, CacheLoader(corpus_ds, num_workers=cfg.loader.num_workers),
                            fraction=cfg.loader.rollout_fraction, seed=cfg.seed,
                            corpus_loss=cfg.loader.corpus_loss)
    if fraction > 0:
        eval_ds = CacheDataset(cfg.cache, tokenizer, cfg.loader, split="eval", holdout_fraction=fraction, **common)
    elif cfg.eval.eval_cache:
        eval_ds = CacheDataset(cfg.eval.eval_cache, tokenizer, cfg.loader, split="all", epochs=1, shuffle=False, **common)
    else:
        return train, None
    return train, lambda: CacheLoader(eval_ds, num_workers=0)


def check_corpus(cfg: TrainConfig, rollouts, kind: str, student_fp: str) -> Capabilities:
    """--corpus-cache: the same teacher tokenizer as the rollouts and, where it trains the run's objective
    (--corpus-loss kd), the same KD kind. Returns the corpus cache's capabilities."""
    corpus = CacheReader(cfg.loader.corpus_cache, storage_options=cfg.loader.storage_options).manifest
    fp = corpus.fingerprints.get("teacher_tokenizer")
    if fp != rollouts.fingerprints.get("teacher_tokenizer"):
        raise ConfigError(f"--corpus-cache {cfg.loader.corpus_cache}: its teacher tokenizer differs from the rollout "
                          "cache's; mix caches scored by one teacher tokenizer")
    caps = Capabilities(same_tokenizer=student_fp == fp, mode=corpus.mode)
    if cfg.loader.corpus_loss != "kd":
        return caps
    corpus_kind = resolve_kind(cfg.loss.loss, caps)
    if corpus_kind != kind:
        raise ConfigError(f"--corpus-cache {cfg.loader.corpus_cache}: --loss {cfg.loss.loss} gives {corpus_kind} on it "
                          f"(mode {corpus.mode}) and {kind} on the rollouts; give --loss explicitly, or mix caches of "
                          "one mode")
    return caps


def corpus_objective(cfg: TrainConfig, caps: Capabilities, projection: ProjectionOperator | None
                     ) -> TeacherMix | None:
    """The objective of the corpus cache's micro-batches under --corpus-loss, whatever the run's loss flags: None
    (kd: the run's own), cross-entropy alone at CORPUS_CE_WEIGHT (ce: as `--loss ce` trains, its teacher values
    unread), or train-student's off-policy defaults for the cache (auto: `--loss auto` at the default divergence,
    weights and CE weight, read through the rollouts' projection; both caches hold one teacher tokenizer)."""
    if cfg.loader.corpus_loss == "kd":
        return None
    if cfg.loader.corpus_loss == "ce":
        return TeacherMix([Objective(None, ce_weight=CORPUS_CE_WEIGHT)])
    loss = LossConfig(projection=list(cfg.loss.projection))
    if resolve_kind(loss.loss, caps) == "pkl" and projection is None:
        raise ConfigError(f"--corpus-loss auto: the corpus cache {cfg.loader.corpus_cache} trains the projected KL, "
                          "and the run has no projection map; give --projection")
    return TeacherMix([Objective.from_config(loss, caps, projection)])
