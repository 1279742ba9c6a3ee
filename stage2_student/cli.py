"""`xtcache train-student`: parse flags (and an optional --config file) into a TrainConfig and train.

    xtcache train-student --cache CACHE --student STUDENT_DIR --out RUN --max-steps 1000
    xtcache train-student --config run.yaml --lr 3e-4          # flags override the file
    torchrun --standalone --nproc_per_node 2 -m stage2_student --cache CACHE --student DIR --out RUN
    deepspeed --num_gpus 8 --module stage2_student --cache CACHE --student DIR --out RUN

Every option mirrors one field of `stage2_student.config.TrainConfig` (same name, dashes for
underscores); a YAML/TOML/JSON `--config` file uses the same keys, flat or nested by section. torch,
DeepSpeed and transformers are imported inside the function so `xtcache --help` stays fast.
"""

from __future__ import annotations

from typing import Optional

import typer


def train_student(
    ctx: typer.Context,
    config: Optional[str] = typer.Option(None, "--config", help="YAML/TOML/JSON file of settings (keys as the flags); flags given here win.", rich_help_panel="Run"),
    cache: Optional[str] = typer.Option(None, "--cache", help='The teacher cache store (local path or fsspec URL).', rich_help_panel="Run"),
    student: Optional[str] = typer.Option(None, "--student", help='Student model directory (Hugging Face format, with its tokenizer).', rich_help_panel="Run"),
    out: Optional[str] = typer.Option(None, "--out", help='Output directory: metrics.jsonl, checkpoints/, hf/, summary.json.', rich_help_panel="Run"),
    seed: int = typer.Option(0, "--seed", help='Seed of the data order and of torch.', rich_help_panel="Run"),
    seq_len: int = typer.Option(512, "--seq-len", help='Student tokens per packed window.', rich_help_panel="Loader"),
    micro_batch_size: int = typer.Option(4, "--micro-batch-size", help='Windows per micro-batch on each data-parallel rank.', rich_help_panel="Loader"),
    num_workers: int = typer.Option(0, "--num-workers", help='DataLoader worker processes per rank (0: read in the training process).', rich_help_panel="Loader"),
    storage_options: Optional[str] = typer.Option(None, "--storage-options", help='JSON object of fsspec storage options for remote stores, e.g. \'{"anon": true}\'.', rich_help_panel="Loader"),
    allow_incomplete: bool = typer.Option(False, "--allow-incomplete/--no-allow-incomplete", help='Train on the committed parts of an incomplete store (a dump still running), saying how many of how many.', rich_help_panel="Loader"),
    loss: Optional[str] = typer.Option('auto', "--loss", help='KD loss: auto|pkl|kl|rkl|jsd|sampled|alm|ce (ce: cross entropy only).', rich_help_panel="Loss"),
    kd_weight: float = typer.Option(1.0, "--kd-weight", help='Weight of the KD term.', rich_help_panel="Loss"),
    ce_weight: float = typer.Option(0.1, "--ce-weight", help='Weight of the next-token cross-entropy term (0 drops it).', rich_help_panel="Loss"),
    dynamic_scaling: bool = typer.Option(False, "--dynamic-scaling/--no-dynamic-scaling", help="Scale KD to CE's magnitude each micro-batch: w = --kd-weight * stop_grad(|CE| / |KD|).", rich_help_panel="Loss"),
    temperature: float = typer.Option(1.0, "--temperature", help='Distillation temperature T (teacher and student softened alike, loss times T^2).', rich_help_panel="Loss"),
    jsd_beta: float = typer.Option(0.5, "--jsd-beta", help='Mixing weight beta of the generalized JSD loss.', rich_help_panel="Loss"),
    alm_tau: float = typer.Option(100.0, "--alm-tau", help='Temperature tau of the ALM chunk-likelihood loss.', rich_help_panel="Loss"),
    projection: Optional[str] = typer.Option(None, "--projection", help='Projection map (`xtcache projection build`) for cross-tokenizer caches; built on the fly when absent.', rich_help_panel="Loss"),
    lr: float = typer.Option(0.0001, "--lr", help='Peak learning rate.', rich_help_panel="Optimization"),
    min_lr_ratio: float = typer.Option(0.1, "--min-lr-ratio", help='Final learning rate as a fraction of --lr at the end of the cosine.', rich_help_panel="Optimization"),
    warmup_steps: int = typer.Option(0, "--warmup-steps", help='Optimizer steps of linear warmup from 0 to --lr.', rich_help_panel="Optimization"),
    max_steps: int = typer.Option(1000, "--max-steps", help='Optimizer steps to train for.', rich_help_panel="Optimization"),
    grad_accum: int = typer.Option(1, "--grad-accum", help='Micro-batches accumulated per optimizer step on each rank.', rich_help_panel="Optimization"),
    weight_decay: float = typer.Option(0.0, "--weight-decay", help='AdamW decoupled weight decay.', rich_help_panel="Optimization"),
    grad_clip: float = typer.Option(1.0, "--grad-clip", help='Clip the global gradient norm to this value (0: no clipping).', rich_help_panel="Optimization"),
    zero_stage: int = typer.Option(2, "--zero-stage", help='ZeRO stage 0|1|2|3 (ignored where --deepspeed sets zero_optimization.stage).', rich_help_panel="DeepSpeed"),
    deepspeed: Optional[str] = typer.Option(None, "--deepspeed", help='A DeepSpeed JSON config to start from; batch sizes, optimizer and clipping still follow the flags.', rich_help_panel="DeepSpeed"),
    bf16: bool = typer.Option(False, "--bf16/--no-bf16", help='Train in bf16 mixed precision (fp32 master weights).', rich_help_panel="DeepSpeed"),
    save_every: int = typer.Option(0, "--save-every", help='Save a checkpoint every N optimizer steps (0: only at the end).', rich_help_panel="Checkpoints"),
    resume: Optional[str] = typer.Option(None, "--resume", help="Resume from a checkpoint directory, or 'latest' for the newest one under OUT/checkpoints. A checkpoint is code (DeepSpeed loads it with torch.load(weights_only=False)): resume only from checkpoints you wrote or trust.", rich_help_panel="Checkpoints"),
    export_every: int = typer.Option(0, "--export-every", help='Also write a Hugging Face directory OUT/hf-stepN every N steps (0: only OUT/hf at the end).', rich_help_panel="Checkpoints"),
    keep_checkpoints: int = typer.Option(0, "--keep-checkpoints", help='Keep only the newest N checkpoints (0: keep all).', rich_help_panel="Checkpoints"),
    eval_every: int = typer.Option(0, "--eval-every", help='Evaluate every N optimizer steps (0: only at the end).', rich_help_panel="Evaluation"),
    eval_fraction: float = typer.Option(0.0, "--eval-fraction", help="Hold out this fraction of the cache's documents for evaluation (by document id).", rich_help_panel="Evaluation"),
    eval_cache: Optional[str] = typer.Option(None, "--eval-cache", help='A separate store to evaluate on (instead of --eval-fraction).', rich_help_panel="Evaluation"),
    eval_batches: int = typer.Option(0, "--eval-batches", help='Evaluate on at most N micro-batches per rank (0: the whole held-out set).', rich_help_panel="Evaluation"),
) -> None:
    """Train a student on a teacher cache with DeepSpeed (KD + CE), evaluate, export to Hugging Face."""
    import json
    import os

    from stage2_student.config import TrainConfig, read_config_file
    from xtcache.errors import ConfigError

    values = read_config_file(config) if config else {}
    for name in TrainConfig.leaf_fields():
        source = getattr(ctx.get_parameter_source(name), "name", "")  # typer may ship its own click enum
        if name not in values or source in ("COMMANDLINE", "ENVIRONMENT"):
            values[name] = ctx.params[name]
    missing = [f"--{n}" for n in ("cache", "student", "out") if not values.get(n)]
    if missing:
        raise ConfigError(f"missing {', '.join(missing)}: give them as flags or in the --config file")
    try:
        cfg = TrainConfig.from_flat(values)
    except (ValueError, TypeError) as err:
        raise ConfigError(str(err)) from None

    from stage2_student.trainer import train

    summary = train(cfg)
    if summary is not None and os.environ.get("RANK", "0") == "0":
        typer.echo(json.dumps({k: summary[k] for k in ("steps", "final_eval_kl", "final_eval_ce", "metrics")}))
