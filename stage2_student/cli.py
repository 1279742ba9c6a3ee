"""`xtcache train-student`: parse flags (and an optional --config file) into a TrainConfig and train.

    xtcache train-student --cache CACHE --student STUDENT_DIR --out RUN --max-steps 1000
    xtcache train-student --config run.yaml --lr 3e-4          # flags override the file
    torchrun --standalone --nproc_per_node 2 -m stage2_student --cache CACHE --student DIR --out RUN
    deepspeed --num_gpus 8 --module stage2_student --cache CACHE --student DIR --out RUN

The options are made by `xtcache.cliconfig` from the fields of `stage2_student.config.TrainConfig`
(same name, dashes for underscores, the field docstring as help); a YAML/TOML/JSON `--config` file
uses the same keys, flat or nested by section. torch, DeepSpeed and transformers are imported
inside the function so `xtcache --help` stays fast.
"""

from __future__ import annotations

import os

import typer

from stage2_student.config import TrainConfig
from xtcache.cliconfig import command
from xtcache.errors import ConfigError, XtcacheError


def _train(cfg: TrainConfig) -> None:
    import json

    from stage2_student.config import deepspeed_config

    deepspeed_config(cfg)  # a --deepspeed file that is not a JSON object fails here, before DeepSpeed is imported
    checked = check_inputs(cfg)
    from stage2_student.trainer import train  # lazy: loads torch only when called

    summary = train(cfg, checked=checked)  # the trainer does not check the stores again
    if summary is not None and os.environ.get("RANK", "0") == "0":
        typer.echo(json.dumps({k: summary[k] for k in ("steps", "final_eval_kl", "final_eval_ce", "metrics")}))
        for t in summary.get("teachers") or []:  # several teachers: one line each, and the mixture's
            typer.echo(json.dumps(t))


def check_inputs(cfg: TrainConfig):
    """Refuse, in a few seconds and one line, a store without a valid manifest (--cache, --eval-cache,
    --corpus-cache), an --out holding an earlier run's checkpoint or export without --resume, a --student
    directory without a tokenizer or a model config, and a student tokenizer a store holds no alignment for
    (`stage2_student.data.check_stores`): before DeepSpeed is imported and the process group starts (10-30 s
    on a CPU host), where the trainer would meet them (or overwrite the earlier run), with the flag named.
    Returns what the store check passed for (`CheckedStores`: the config and the student tokenizer, loaded for
    it), for the trainer to use instead of checking again. Every rank of a launch runs this once, in its own
    process."""
    from stage2_student.checkpoint import earlier_run
    from xtcache.store.reader import read_manifest
    from xtcache.tokenizer import require_tokenizer_files

    stores = [("--cache", u) for u in cfg.cache] + [("--eval-cache", u) for u in cfg.eval.eval_cache]
    stores += [("--corpus-cache", cfg.loader.corpus_cache)] if cfg.loader.corpus_cache else []
    for flag, url in stores:
        try:
            read_manifest(url, cfg.loader.storage_options)
        except XtcacheError as err:
            raise type(err)(f"{flag} {err}") from None
    if cfg.checkpoint.resume is None and (held := earlier_run(cfg.out)):
        raise ConfigError(f"--out {cfg.out} holds {held}, or give another --out: a fresh run would overwrite it")
    require_tokenizer_files(cfg.student, "--student")
    if os.path.isdir(cfg.student) and not os.path.isfile(os.path.join(cfg.student, "config.json")):
        raise ConfigError(f"--student {cfg.student}: the directory holds no model (no config.json); pass the student's "
                          "Hugging Face model directory")
    from stage2_student.data import check_stores  # torch and transformers, not DeepSpeed
    from stage2_student.student import load_tokenizer

    return check_stores(cfg, load_tokenizer(cfg.student))


train_student = command(
    TrainConfig, _train, name="train_student",
    help="Train a student on a teacher cache with DeepSpeed (KD + CE), evaluate, export to Hugging Face.",
    panels={None: "Run", "loader": "Loader", "loss": "Loss", "optim": "Optimization", "deepspeed": "DeepSpeed",
            "checkpoint": "Checkpoints", "eval": "Evaluation"},
    paths={"cache": "dir", "student": "dir", "eval_cache": "dir", "projection": "file", "corpus_cache": "dir",
           "deepspeed": "file", "init_from": "dir"})
