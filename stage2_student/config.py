"""The stage 2 (`xtcache train-student`) configuration: one dataclass, nested by concern, and
what follows from it alone (the DeepSpeed JSON, the learning-rate schedule).

Every leaf field has exactly one command-line flag, its name with dashes (`kd_weight` ->
`--kd-weight`), whose help text is the field's docstring: `xtcache.cliconfig` makes the typer
options of `xtcache train-student` from these fields. Flag names are unique across sections, so a
config file may use flat keys (`kd-weight: 0.5`) or nested sections (`loss: {kd_weight: 0.5}`).
Precedence: flags given on the command line, then the `--config` file, then the defaults below.

    from stage2_student.config import TrainConfig
    cfg = TrainConfig.from_flat({"cache": "s3://b/c", "student": "dir", "out": "run", "lr": 1e-4})
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from xtcache.cliconfig import flatten, from_flat
from xtcache.errors import ConfigError

PKL_DIVERGENCES = ("forward", "reverse", "jsd", "forward-reverse")
"""`--pkl-divergence` choices (stage2_student.projected)."""
LOSSES = ("auto", "pkl", "kl", "rkl", "jsd", "sampled", "alm", "rkl-pg", "ce")
"""`--loss` choices. auto: pkl for cross-tokenizer caches (sampled ones too), sampled for same-tokenizer sampled and headtail caches, kl otherwise;
rkl-pg: the reverse-KL policy gradient on rollouts (docs/on-policy.md); ce: next-token cross entropy only (no teacher term)."""
CORPUS_LOSSES = ("kd", "auto", "ce")
"""`--corpus-loss` choices: the run's objective, train-student's off-policy defaults for the corpus cache, CE alone."""


@dataclass(kw_only=True)
class LoaderConfig:
    """How the cache is streamed into micro-batches."""

    seq_len: int = 512
    """Student tokens per packed window."""
    micro_batch_size: int = 4
    """Windows per micro-batch on each data-parallel rank."""
    num_workers: int = 0
    """DataLoader worker processes per rank (0: read in the training process)."""
    storage_options: dict[str, Any] | None = None
    """JSON object of fsspec storage options for remote stores, e.g. '{"anon": true}'."""
    allow_incomplete: bool = False
    """Train on the committed parts of an incomplete store (a dump still running), saying how many of how many."""
    train_on: str | None = None
    """Conversation caches: KD and CE only on positions that predict these tokens: assistant (every assistant message, end-of-turn included; the default), last-assistant (the final one) or all. Plain-text caches: unset or all."""
    teachers_missing: str = "drop"
    """Several --cache: drop the documents some cache lacks, or train them (partial) with the teachers present."""
    corpus_cache: str | None = None
    """An off-policy corpus cache (same teacher tokenizer) mixed into the rollouts of --cache at 1 - --rollout-fraction of the micro-batches (GKD's lambda, docs/on-policy.md)."""
    rollout_fraction: float = 1.0
    """With --corpus-cache: the fraction lambda of the micro-batches read from --cache (the rollouts), on a stratified schedule (any n consecutive micro-batches hold lambda n of them, rounded; --seed sets its phase)."""
    corpus_loss: str = "kd"
    """With --corpus-cache: what its micro-batches train: kd (the run's objective, GKD's lambda), auto (train-student's off-policy defaults for that cache, --loss auto at its default divergence and CE weight, whatever the run's loss flags: the rollouts' objective on the rollouts, the corpus's on the corpus) or ce (cross-entropy on the corpus text alone, at weight 1 as with --loss ce; its teacher values unused: docs/on-policy.md)."""

    def __post_init__(self) -> None:
        if self.seq_len < 2:
            raise ValueError(f"--seq-len {self.seq_len}: a window needs at least 2 tokens")
        if self.micro_batch_size < 1:
            raise ValueError(f"--micro-batch-size {self.micro_batch_size}: must be at least 1")
        if self.num_workers < 0:
            raise ValueError(f"--num-workers {self.num_workers}: must not be negative")
        if self.teachers_missing not in ("drop", "partial"):
            raise ValueError(f"--teachers-missing {self.teachers_missing!r}: choose drop or partial")


@dataclass(kw_only=True)
class LossConfig:
    """The training objective: w_kd * KD + w_ce * CE."""

    loss: str = "auto"
    """KD loss: auto|pkl|kl|rkl|jsd|sampled|alm|rkl-pg|ce (sampled: forward KL to the teacher estimated from a sampled or headtail cache; rkl-pg: reverse-KL policy gradient on the student's own rollouts, docs/on-policy.md; ce: cross entropy only)."""
    kd_weight: float = 1.0
    """Weight of the KD term."""
    ce_weight: float | None = None
    """Weight of the next-token cross-entropy term (0 drops it); default 0.1 with a KD loss on a same-tokenizer cache, 0.5 on a cross-tokenizer cache, 1.0 with --loss ce (measured on the real pair: docs/losses.md)."""
    dynamic_scaling: bool = False
    """Scale KD to CE's magnitude each micro-batch: w = --kd-weight * stop_grad(|CE| / |KD|)."""
    temperature: float = 1.0
    """Distillation temperature T (teacher and student softened alike, loss times T^2)."""
    jsd_beta: float = 0.5
    """Mixing weight beta of the generalized JSD loss."""
    alm_tau: float = 100.0
    """Temperature tau of the ALM chunk-likelihood loss."""
    chunk_rows: str = "first"
    """--loss pkl: which rows of a chunk are compared: first (its first student position and first teacher row: the distributions of the first teacher token of the text that follows, read through a `projection build --pieces first` map) or mean (the mean of all its student rows against the mean of all its teacher rows)."""
    pkl_divergence: str | None = None
    """--loss pkl: the divergence between the teacher's and the projected student's distributions over the stored support and the rest: forward (KL(teacher || student), mass covering), reverse (KL(student || teacher), mode seeking: on-policy rollouts), jsd (generalized JSD with --jsd-beta) or forward-reverse ((1 - w) forward + w reverse, w = --pkl-reverse-weight; the default on top-k and full caches: measured on the real pair, docs/losses.md); docs/on-policy.md."""
    pkl_reverse_weight: float | None = None
    """--pkl-divergence forward-reverse: the weight w of the reverse KL in (1 - w) forward + w reverse, strictly between 0 and 1 (default 0.5, the mean, measured on the real pair: docs/losses.md; towards 1 more mode seeking)."""
    is_cap: float = 2.0
    """--loss rkl-pg: cap C of the truncated importance ratio min(p_student / p_sampler, C) per chunk (>= 1; 0: no ratio, for rollouts sampled by the weights being trained)."""
    projection: list[str] = field(default_factory=list)
    """Projection map (`xtcache projection build`) for cross-tokenizer caches; built on the fly when absent. Several --cache: one per cross-tokenizer cache, in --cache order."""
    teacher_weights: str | None = None
    """Several --cache: static weight of each teacher, comma-separated in --cache order (e.g. 0.7,0.3); default equal."""
    teacher_combine: str = "sum"
    """Several --cache: how the teachers' KD terms combine per chunk group: sum|dynamic|select|mean-probs (docs/losses.md)."""
    teacher_score: str = "likelihood"
    """--teacher-combine dynamic: each teacher's score of a chunk group: likelihood (of the realized text)|entropy|max-prob."""
    teacher_alpha: float = 1.0
    """--teacher-combine dynamic: weights softmax(alpha * score) over the teachers."""


@dataclass(kw_only=True)
class OptimConfig:
    """AdamW with linear warmup then cosine decay."""

    lr: float = 1e-4
    """Peak learning rate."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of --lr at the end of the cosine."""
    warmup_steps: int = 0
    """Optimizer steps of linear warmup from 0 to --lr."""
    max_steps: int = 1000
    """Optimizer steps to train for."""
    grad_accum: int = 1
    """Micro-batches accumulated per optimizer step on each rank."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0: no clipping)."""


@dataclass(kw_only=True)
class DeepSpeedConfig:
    """The DeepSpeed engine."""

    zero_stage: int = 2
    """ZeRO stage 0|1|2|3 (ignored where --deepspeed sets zero_optimization.stage)."""
    deepspeed: str | None = None
    """A DeepSpeed JSON config to start from; batch sizes, optimizer and clipping still follow the flags."""
    bf16: bool = False
    """Train in bf16 mixed precision (fp32 master weights)."""


@dataclass(kw_only=True)
class CheckpointConfig:
    """Checkpoints, resume and the Hugging Face export."""

    save_every: int = 0
    """Save a checkpoint every N optimizer steps (0: only at the end)."""
    resume: str | None = None
    """Resume from a checkpoint directory, or 'latest' for the newest one under OUT/checkpoints. A checkpoint is code (DeepSpeed loads it with torch.load(weights_only=False)): resume only from checkpoints you wrote or trust."""
    init_from: str | None = None
    """Start from another run's checkpoint directory (weights, optimizer, LR schedule, step and RNG) on this run's own data from its start (a --corpus-cache that checkpoint read, on the same --seed and ranks, continues where it left it): the next round of `xtcache rounds`; --resume, when given, wins. Trust as for --resume."""
    export_every: int = 0
    """Also write a Hugging Face directory OUT/hf-stepN every N steps (0: only OUT/hf at the end)."""
    keep_checkpoints: int = 0
    """Keep only the newest N checkpoints (0: keep all)."""


@dataclass(kw_only=True)
class EvalConfig:
    """Held-out evaluation: KD measure to the teacher and CE."""

    eval_every: int = 0
    """Evaluate every N optimizer steps (0: only at the end)."""
    eval_fraction: float = 0.0
    """Hold out this fraction of the cache's documents for evaluation (by document id)."""
    eval_cache: list[str] = field(default_factory=list)
    """A separate store to evaluate on (instead of --eval-fraction); several --cache: one per cache, in --cache order."""
    eval_batches: int = 0
    """Evaluate on at most N micro-batches per rank (0: the whole held-out set)."""


@dataclass(kw_only=True)
class TrainConfig:
    """Everything `xtcache train-student` needs."""

    cache: list[str]
    """The teacher cache store (local path or fsspec URL); repeat it to distill several teachers at once."""
    student: str
    """Student model directory (Hugging Face format, with its tokenizer)."""
    out: str
    """Output directory: metrics.jsonl, checkpoints/, hf/, summary.json. One that holds an earlier run's complete checkpoint or export is refused unless --resume is given."""
    seed: int = 0
    """Seed of the data order and of torch."""
    deterministic: bool = False
    """Deterministic algorithms only (torch.use_deterministic_algorithms, cuDNN, CUBLAS_WORKSPACE_CONFIG=:4096:8): bit-identical resume on GPU, at some speed; off by default."""
    loader: LoaderConfig = field(default_factory=LoaderConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def __post_init__(self) -> None:
        o, lo, loss, d, c, e = self.optim, self.loader, self.loss, self.deepspeed, self.checkpoint, self.eval
        positive = {"--grad-accum": o.grad_accum, "--max-steps": o.max_steps}
        for flag, value in positive.items():
            if value < 1:
                raise ValueError(f"{flag} {value}: must be at least 1")
        non_negative = {"--warmup-steps": o.warmup_steps,
                        "--save-every": c.save_every, "--eval-every": e.eval_every,
                        "--export-every": c.export_every, "--keep-checkpoints": c.keep_checkpoints,
                        "--eval-batches": e.eval_batches, "--grad-clip": o.grad_clip,
                        "--weight-decay": o.weight_decay, "--kd-weight": loss.kd_weight,
                        "--ce-weight": 0.0 if loss.ce_weight is None else loss.ce_weight}
        for flag, value in non_negative.items():
            if value < 0:
                raise ValueError(f"{flag} {value}: must not be negative")
        if o.lr <= 0:
            raise ValueError(f"--lr {o.lr}: must be positive")
        if not 0.0 <= o.min_lr_ratio <= 1.0:
            raise ValueError(f"--min-lr-ratio {o.min_lr_ratio}: must lie in [0, 1]")
        if o.warmup_steps > o.max_steps:
            raise ValueError(f"--warmup-steps {o.warmup_steps}: more than --max-steps {o.max_steps}")
        if loss.loss not in LOSSES:
            raise ValueError(f"--loss {loss.loss!r}: choose one of {', '.join(LOSSES)}")
        if loss.temperature <= 0:
            raise ValueError(f"--temperature {loss.temperature}: must be positive")
        if loss.pkl_divergence is not None and loss.pkl_divergence not in PKL_DIVERGENCES:
            raise ValueError(f"--pkl-divergence {loss.pkl_divergence!r}: use {', '.join(PKL_DIVERGENCES)}")
        if loss.pkl_reverse_weight is not None and not 0.0 < loss.pkl_reverse_weight < 1.0:
            raise ValueError(f"--pkl-reverse-weight {loss.pkl_reverse_weight}: must lie strictly between 0 and 1 "
                             "(0 is --pkl-divergence forward, 1 is reverse)")
        if not 0.0 < loss.jsd_beta < 1.0:
            raise ValueError(f"--jsd-beta {loss.jsd_beta}: must lie strictly between 0 and 1")
        if loss.is_cap != 0 and not loss.is_cap >= 1:
            raise ValueError(f"--is-cap {loss.is_cap}: 0 (no importance ratio) or at least 1 (a cap below 1 "
                             "down-weights even tokens of an unchanged policy)")
        if loss.alm_tau <= 0:
            raise ValueError(f"--alm-tau {loss.alm_tau}: must be positive")
        if loss.loss == "ce" and loss.ce_weight == 0:
            raise ValueError("--loss ce with --ce-weight 0: nothing to train on; give --ce-weight > 0")
        if loss.loss != "ce" and loss.kd_weight == 0 and not loss.dynamic_scaling and loss.ce_weight == 0:
            raise ValueError("--kd-weight 0 and --ce-weight 0: nothing to train on")
        if d.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"--zero-stage {d.zero_stage}: choose 0, 1, 2 or 3")
        if not 0.0 <= e.eval_fraction < 1.0:
            raise ValueError(f"--eval-fraction {e.eval_fraction}: must lie in [0, 1)")
        if e.eval_fraction > 0 and e.eval_cache:
            raise ValueError("--eval-fraction and --eval-cache both given: choose one")
        if e.eval_cache and len(e.eval_cache) != len(self.cache):
            raise ValueError(f"{len(e.eval_cache)} --eval-cache for {len(self.cache)} --cache: give one per cache")
        if lo.corpus_cache is not None:
            if not 0.0 < lo.rollout_fraction < 1.0:
                raise ValueError(f"--rollout-fraction {lo.rollout_fraction} with --corpus-cache: must lie strictly "
                                 "between 0 and 1 (1: leave out --corpus-cache)")
            if len(self.cache) > 1:
                raise ValueError("--corpus-cache mixes into one rollout --cache; give one --cache")
            if loss.loss == "rkl-pg":
                raise ValueError("--corpus-cache with --loss rkl-pg: the policy gradient needs text the student "
                                 "sampled; mix with a distribution loss (kl, jsd, pkl, auto)")
        elif lo.rollout_fraction != 1.0:
            raise ValueError(f"--rollout-fraction {lo.rollout_fraction} needs --corpus-cache (the corpus to mix in)")
        if lo.corpus_loss not in CORPUS_LOSSES:
            raise ValueError(f"--corpus-loss {lo.corpus_loss!r}: choose kd, auto or ce")
        if lo.corpus_loss != "kd" and lo.corpus_cache is None:
            raise ValueError(f"--corpus-loss {lo.corpus_loss} needs --corpus-cache (the corpus it trains on)")
        if loss.teacher_combine not in ("sum", "dynamic", "select", "mean-probs"):
            raise ValueError(f"--teacher-combine {loss.teacher_combine!r}: choose sum, dynamic, select or mean-probs")
        if loss.teacher_score not in ("likelihood", "entropy", "max-prob"):
            raise ValueError(f"--teacher-score {loss.teacher_score!r}: choose likelihood, entropy or max-prob")
        if loss.teacher_combine == "mean-probs" and lo.teachers_missing == "partial":
            raise ValueError("--teacher-combine mean-probs needs every teacher on every document: "
                             "use --teachers-missing drop")
        self.teacher_weights()  # checked here, before anything loads

    def teacher_weights(self) -> list[float]:
        """The --teacher-weights, one per --cache (equal when not given)."""
        text = self.loss.teacher_weights
        if not text:
            return [1.0] * len(self.cache)
        try:
            w = [float(x) for x in str(text).split(",")]
        except ValueError:
            raise ValueError(f"--teacher-weights {text!r}: comma-separated numbers, e.g. 0.7,0.3") from None
        if len(w) != len(self.cache):
            raise ValueError(f"--teacher-weights {text!r}: {len(w)} weights for {len(self.cache)} --cache")
        if any(x < 0 or not math.isfinite(x) for x in w) or sum(w) <= 0:
            raise ValueError(f"--teacher-weights {text!r}: non-negative and not all 0")
        return w

    @property
    def has_eval(self) -> bool:
        return self.eval.eval_fraction > 0 or bool(self.eval.eval_cache)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_flat(cls, values: dict[str, Any]) -> "TrainConfig":
        """Build from flat keys (field names; dashes allowed); unknown keys raise ValueError."""
        return from_flat(cls, values)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TrainConfig":
        """Build from `to_dict()` output or a config file's mapping (nested sections and flat keys mixed)."""
        return from_flat(cls, flatten(cls, data))


def deepspeed_config(cfg: TrainConfig, num_params: int | None = None) -> dict:
    """The DeepSpeed JSON: --deepspeed file as the base, the flags on top for what they name.

    ZeRO communication buckets default to DeepSpeed's 5e8 elements (a 2 GB fp32 gradient buffer);
    unless the file sets them they are capped at the model's parameter count.
    """
    base: dict = {}
    if cfg.deepspeed.deepspeed:
        path = cfg.deepspeed.deepspeed
        try:
            base = json.loads(Path(path).read_text())
        except json.JSONDecodeError as err:
            raise ConfigError(f"--deepspeed {path}: not JSON ({err})") from None
        if not isinstance(base, dict):
            raise ConfigError(f"--deepspeed {path}: a DeepSpeed config is a JSON object, not {type(base).__name__}")
    o = cfg.optim
    base.pop("train_batch_size", None)
    base["train_micro_batch_size_per_gpu"] = cfg.loader.micro_batch_size
    base["gradient_accumulation_steps"] = o.grad_accum
    base["gradient_clipping"] = o.grad_clip
    base.setdefault("steps_per_print", 10**9)
    base.setdefault("wall_clock_breakdown", False)
    base["optimizer"] = {"type": "AdamW", "params": {
        "lr": o.lr, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": o.weight_decay, "torch_adam": True}}
    zero = base.setdefault("zero_optimization", {})
    if not isinstance(zero, dict):
        raise ConfigError(f"--deepspeed {cfg.deepspeed.deepspeed}: zero_optimization is a JSON object, "
                          f"not {type(zero).__name__}")
    zero.setdefault("stage", cfg.deepspeed.zero_stage)
    if num_params:
        bucket = int(min(5e8, max(num_params, 1_000_000)))
        for key in ("reduce_bucket_size", "allgather_bucket_size"):
            zero.setdefault(key, bucket)
        if zero["stage"] == 3:
            zero.setdefault("stage3_prefetch_bucket_size", bucket)
    if zero["stage"] == 3:
        zero.setdefault("stage3_param_persistence_threshold", 0)
        zero.setdefault("stage3_gather_16bit_weights_on_model_save", True)
    if cfg.deepspeed.bf16:
        base["bf16"] = {"enabled": True}
        base.pop("fp16", None)
    return base


def lr_lambda(cfg: TrainConfig) -> Callable[[int], float]:
    """Linear warmup from 0 to 1 over --warmup-steps, then cosine down to --min-lr-ratio."""
    o = cfg.optim

    def scale(step: int) -> float:
        if step < o.warmup_steps:
            return (step + 1) / o.warmup_steps
        span = max(1, o.max_steps - o.warmup_steps)
        progress = min(1.0, (step - o.warmup_steps) / span)
        return o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return scale
