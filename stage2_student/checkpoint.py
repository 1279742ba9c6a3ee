"""Checkpoints of a stage 2 run: save, resume (same or another world size) and the trainer-state record.

    path = save(trainer)                       # OUT/checkpoints/stepN/, every rank calls it
    point = resume_point(out, "latest", rank=r, world=w, grad_accum=a)
    load(trainer, point)                       # engine, loader position, RNG, step

A checkpoint is DeepSpeed's own directory plus, per rank, `trainer_state_rank{R}.json` (the
versioned record below), `rng_rank{R}.pt` (torch RNG states, loaded with weights_only=True) and
rank 0's `train_config.json`, written last, after every rank's files: its presence marks the checkpoint
complete (`xtcache rounds` resumes from the newest checkpoint that has it).

Trainer-state record, version 3: {"version": 3, "step": int, "world": int, "loader": the
loader's state_dict, "objective": the objective trained, as summary.json records it
(`Objective.describe()`: the loss and every setting that shapes it)}. Version 2 recorded the KD kind
alone (read as {"kind": kind}); version 1 (before the objective was its own object) had no "version"
and no "objective" field and is read as such; a newer version is refused with a message naming the
version needed. Resuming under another objective is allowed (a changed loss is a choice), and logged
with every setting that changed.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from xtcache.errors import ConfigError

log = logging.getLogger(__name__)

CKPT_DIR = "checkpoints"
SUMMARY_FILE = "summary.json"  # a finished run's summary, written last, beside its Hugging Face export
HF_DIR = "hf"
CONVERT_WAIT_S = 6 * 3600  # ranks wait this long for rank 0 to convert a checkpoint
TRAINER_STATE_VERSION = 3


def trainer_state_record(*, step: int, world: int, loader: dict, objective: dict | None) -> dict:
    """The per-rank trainer state written next to DeepSpeed's checkpoint (current version)."""
    return {"version": TRAINER_STATE_VERSION, "step": step, "world": world, "loader": loader,
            "objective": objective}


def read_trainer_state(path: Path) -> dict:
    """A trainer-state record of any known version, upgraded to the current one."""
    state = json.loads(path.read_text())
    version = state.get("version", 1)
    if not isinstance(version, int) or version > TRAINER_STATE_VERSION:
        raise ConfigError(f"--resume: {path} is a version {version} trainer state; this xtcache reads versions "
                          f"1-{TRAINER_STATE_VERSION}: resume it with an xtcache that writes version {version}")
    if version < 3:  # version 1: no objective recorded; version 2: its KD kind alone
        kind = state.get("objective")
        state = trainer_state_record(step=state["step"], world=state["world"], loader=state["loader"],
                                     objective=None if version == 1 else {"kind": kind})
    return state


def objective_changes(was: dict | None, objective) -> list[str]:
    """`setting old -> new` for each setting of the recorded objective `was` that the run's `objective` (its
    `describe()`) sets otherwise. A version 2 record holds the KD kind alone and is compared with the objective's
    `kind` (several teachers: their kinds joined by '+'); a version 1 record, nothing."""
    now = {"kind": objective.kind} if was is not None and set(was) == {"kind"} else objective.describe()
    return [f"{k} {was[k]!r} -> {now.get(k)!r}" for k in sorted(was or {}) if was[k] != now.get(k)]


@dataclass
class ResumePoint:
    """Where --resume continues: the checkpoint, its trainer state and this rank's loader state."""

    ckpt: Path
    state: dict
    loader: dict | None  # None: --init-from, this run's data stream starts at its beginning
    reshard: bool  # saved with another number of ranks
    carried: dict | None = None  # --init-from on its ranks: its loader state, where a --corpus-cache continues


def complete_checkpoint(out: Path) -> Path | None:
    """The newest checkpoint under OUT/checkpoints that train-student finished writing: its train_config.json is
    written last (after DeepSpeed's files, which update checkpoints/latest, and the trainer state and RNG)."""
    steps = [p for p in (Path(out) / CKPT_DIR).glob("step*") if p.name[4:].isdigit()]
    done = sorted((p for p in steps if (p / "train_config.json").is_file()), key=lambda p: int(p.name[4:]))
    return done[-1] if done else None


def earlier_run(out: str | Path) -> str | None:
    """What of an earlier run the directory `out` holds that a fresh run there would overwrite (a finished run's
    summary and export, or a complete checkpoint), with the way to continue it; None: nothing, or a run killed
    before its first checkpoint."""
    out = Path(out)
    if (out / SUMMARY_FILE).is_file():
        return f"a finished run ({SUMMARY_FILE}, {HF_DIR}/): train it further with --resume latest and a larger " \
               "--max-steps"
    ckpt = complete_checkpoint(out)
    return f"a run's checkpoint {ckpt.relative_to(out)}: continue it with --resume latest" if ckpt else None


def checkpoint_dir(out: Path, where: str) -> Path:
    if where != "latest":
        return Path(where)
    latest = out / CKPT_DIR / "latest"
    if not latest.exists():
        raise ConfigError(f"--resume latest: no checkpoint under {out / CKPT_DIR}; drop --resume to start fresh")
    return out / CKPT_DIR / latest.read_text().strip()


def resume_point(out: Path, where: str, *, rank: int, world: int, grad_accum: int,
                 fresh_data: bool = False) -> ResumePoint:
    """The checkpoint `where` names, this rank's trainer state in it (rank 0's when the checkpoint
    had fewer ranks) and the loader state for this rank layout (none with `fresh_data`: --init-from)."""
    from stage2_student.loader import reshard_state  # lazy: loads torch only when called

    ckpt = checkpoint_dir(out, where)
    for name in (f"trainer_state_rank{rank}.json", "trainer_state_rank0.json"):
        if (ckpt / name).exists():
            state = read_trainer_state(ckpt / name)
            break
    else:
        raise ConfigError(f"--resume: {ckpt} is not an xtcache checkpoint (no trainer_state_rank0.json)")
    if fresh_data:
        same = state["world"] == world
        return ResumePoint(ckpt, state, None, reshard=not same, carried=state["loader"] if same else None)
    if state["world"] == world:
        return ResumePoint(ckpt, state, state["loader"], reshard=False)
    loader = reshard_state(state["loader"], rank=rank, world_size=world, grad_accum=grad_accum)
    return ResumePoint(ckpt, state, loader, reshard=True)


def save(trainer) -> Path:
    """OUT/checkpoints/stepN: DeepSpeed state, per-rank trainer state and RNG, the config."""
    import torch
    import torch.distributed as dist

    root = trainer.out / CKPT_DIR
    tag = f"step{trainer.step}"
    if trainer.rank == 0:  # a tag written again (after a rollback) must not keep files of the old one
        for stale in (root / tag, root / f"{tag}_universal"):
            shutil.rmtree(stale, ignore_errors=True)
    dist.barrier()
    trainer.engine.save_checkpoint(str(root), tag=tag, client_state={"step": trainer.step, "world": trainer.world})
    state = trainer_state_record(step=trainer.step, world=trainer.world, loader=trainer.data.train.state_dict(),
                                 objective=trainer.data.objective.describe())
    (root / tag / f"trainer_state_rank{trainer.rank}.json").write_text(json.dumps(state))
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    torch.save(rng, root / tag / f"rng_rank{trainer.rank}.pt")
    dist.barrier()  # every rank's files are written before train_config.json marks the checkpoint complete
    if trainer.rank == 0:
        (root / tag / "train_config.json").write_text(trainer.cfg.to_json())
    dist.barrier()
    keep = trainer.cfg.checkpoint.keep_checkpoints
    if trainer.rank == 0 and keep:
        tags = sorted((p for p in root.glob("step*") if p.is_dir() and p.name[4:].isdigit()),
                      key=lambda p: int(p.name[4:]))
        for old in tags[:-keep]:
            shutil.rmtree(old)
            shutil.rmtree(old.parent / f"{old.name}_universal", ignore_errors=True)
    log.info("saved checkpoint %s", root / tag)
    return root / tag


def load(trainer, point: ResumePoint) -> int:
    """Continue from `point`; returns the step. Bit-exact at the same world size. At another world
    size, ZeRO states go through DeepSpeed's universal checkpoint (converted once, next to the
    checkpoint; OUT must be on storage every node sees) and the data stream is re-cut for the
    new ranks: the global batch (ranks x grad-accum x micro-batch) must stay the same, so that
    every step sees the samples it would have seen."""
    import numpy as np
    import torch

    from stage2_student.rollout_mix import MixedLoader

    ckpt, state = point.ckpt, point.state
    tag = ckpt.name
    if point.reshard:
        if trainer.ds_config["checkpoint"]["load_universal"]:
            tag = universal_checkpoint(ckpt, trainer.rank)
        log.info("resuming a %d-rank checkpoint on %d ranks from %s", state["world"], trainer.world, tag)
    path, _ = trainer.engine.load_checkpoint(str(ckpt.parent), tag=tag)
    if path is None:
        raise ConfigError(f"--resume {ckpt}: DeepSpeed could not load {ckpt.parent / tag}")
    if point.loader is not None:
        trainer.data.train.load_state_dict(point.loader)
    elif isinstance(trainer.data.train, MixedLoader):  # --init-from: a --corpus-cache it read continues
        trainer.data.train.continue_corpus(point.carried, ckpt)
    rng_file = ckpt / f"rng_rank{trainer.rank}.pt"
    if not point.reshard and rng_file.exists():
        rng = torch.load(rng_file, weights_only=True)
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    else:  # no saved stream for this rank layout: a fresh one, reproducible from (seed, step, rank)
        seed = np.random.SeedSequence([trainer.cfg.seed, state["step"], trainer.rank]).generate_state(1)[0]
        torch.manual_seed(int(seed))
        log.warning("random state re-seeded for the new rank layout (dropout masks differ from an "
                    "uninterrupted run)")
    if changed := objective_changes(state["objective"], trainer.data.objective):
        log.warning("resuming under another objective than the checkpoint's: %s", ", ".join(changed))
    log.info("resumed from %s at step %d", ckpt, state["step"])
    return state["step"]


def universal_checkpoint(ckpt: Path, rank: int) -> str:
    """Tag of `ckpt` converted by `deepspeed.checkpoint.ds_to_universal`.

    Rank 0 converts (once; the result is kept next to the checkpoint) while the other ranks
    wait for the converted directory or rank 0's error file on the shared filesystem, not in a
    collective: a large model converts for longer than a collective's timeout.
    """
    import subprocess
    import sys

    target = ckpt.parent / f"{ckpt.name}_universal"
    error = ckpt.parent / f".{target.name}.error"
    if rank == 0 and not target.exists():
        error.unlink(missing_ok=True)
        for old in ckpt.parent.glob(f".{target.name}.tmp-*"):  # debris of a killed conversion
            shutil.rmtree(old, ignore_errors=True)
        tmp = ckpt.parent / f".{target.name}.tmp-{os.getpid()}"
        # --inject_missing_state: ZeRO-1/2 states need a version marker that xtcache does not save
        workers = str(max(1, min(8, (os.cpu_count() or 2) // 2)))
        proc = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                               str(ckpt), "--output_folder", str(tmp), "--inject_missing_state",
                               "--num_extract_workers", workers, "--num_merge_workers", workers],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            shutil.rmtree(tmp, ignore_errors=True)
            message = (f"--resume {ckpt}: converting it for another world size failed "
                       f"(deepspeed.checkpoint.ds_to_universal): {proc.stderr.strip()[-1500:]}")
            error.write_text(message)
            raise ConfigError(message)
        os.replace(tmp, target)  # a crash mid-conversion leaves only hidden debris
        (ckpt.parent / "latest_universal").unlink(missing_ok=True)  # names the temp directory
    started = time.time()
    deadline = started + CONVERT_WAIT_S
    while not target.exists():
        if error.exists() and error.stat().st_mtime >= started - 5:  # older ones are from another attempt
            raise ConfigError(error.read_text())
        if time.time() > deadline:
            raise ConfigError(f"--resume {ckpt}: {target} did not appear within {CONVERT_WAIT_S // 3600} h; "
                              "resuming on another world size needs OUT on storage every node sees")
        time.sleep(2.0)
    return target.name
