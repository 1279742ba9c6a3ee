"""`xtcache rounds`: on-policy distillation in rounds, generate -> teacher-dump -> train-student.

    xtcache rounds --student S --teacher T --prompts prompts.jsonl --rounds 3 --workdir W \\
        --steps-per-round 200 --train-on last-assistant -- --lr 1e-5 --seq-len 1024

Round r (r = 0, 1, ...) runs three `xtcache` commands as subprocesses, under W/round-RRR/ (each under
`torchrun --standalone` with --nproc-per-node N above 1: generate as N jobs, one GPU each, teacher-dump as
N / TP jobs of --tensor-parallel-size TP GPUs each, train-student on N ranks):

1. `generate --student S_r --out rollouts`: S_0 is --student, S_r is round r-1's export (train/hf);
2. `teacher-dump --data 'rollouts/parts/*.jsonl' --out cache`: the teacher scores the rollouts in
   its own template, aligned to the student's tokenizer (with vLLM, round r > 0 trusts round 0's
   first-batch check of the same teacher: `--trust-check-from`, one engine start less);
3. `train-student --cache cache --out train --max-steps (r+1) x --steps-per-round`, from round
   r-1's last checkpoint (`--init-from`: weights, optimizer, LR schedule and step; the new cache's
   data from its start), which exports train/hf.

The stages share nothing but directories: every command is printed and appended to W/commands.sh,
so each can instead run on its own cluster. A stage that finished writes W/round-RRR/done/STAGE.json
last (atomically: temp file + rename) with its command and its outputs' fingerprints; a rerun skips
it (refusing when its command or outputs changed) and continues an interrupted stage with that
command's own resume (`generate --resume`, `teacher-dump --resume`, `train-student --resume CKPT`),
so the driver killed with SIGKILL at any point resumes to the weights of an uninterrupted run.
A rerun may change the settings of the stages that have not finished (a failed stage's fixed flag):
a stage started with another command (W/round-RRR/started/STAGE.json) starts again from nothing. A
change that reaches a finished stage is refused, naming the setting, that stage and what to remove
to redo it.
Per-round metrics go to W/metrics.jsonl (TensorBoard: each train/ writes its own), and a table is
printed at the end. docs/on-policy.md, "Rounds".

Before any stage runs, every round's three command lines are built into their stages' configs, as the
stages will build them (`check_commands`): a --prompts file that is not there, a typo or a refused value in
--generate-args, --dump-args or after `--`, or a path they name that does not exist, fails the run there, not after
round 0's generate and teacher-dump; so do rollouts too few to fill one optimizer step of train-student, as far as
they can be bounded before they exist (`check_windows`).
This module composes the stages' command lines and reads their command-line definitions only: it runs no
stage in its own process.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import typer

from schemas.models import DRAWN_MODES
from xtcache.app.store_commands import part_counts, rollout_summary
from xtcache.cliconfig import command
from xtcache.devices import cuda_device_count
from xtcache.errors import ConfigError, XtcacheError
from xtcache.fingerprint import sha256_file, tokenizer_fingerprint
from xtcache.reaper import guard_children
from xtcache.store import CacheReader
from xtcache.tokenizer import load_tokenizer

log = logging.getLogger(__name__)
STAGES = ("generate", "teacher-dump", "train-student")
ROLLOUT_CE_WEIGHT = 0.1  # train-student --ce-weight on a round's rollouts unless given after `--` (docs/on-policy.md)
SETTINGS_FILE = "rounds.json"
DIVERGENCES = {"forward": "kl", "reverse": "rkl", "jsd": "jsd"}  # rounds' --loss -> train-student's same-tokenizer loss
# train-student's mix flags that rounds' --corpus-cache sets unless given after `--` (as measured: docs/on-policy.md)
CORPUS_MIX = {"--rollout-fraction": "0.5", "--corpus-loss": "ce"}
# generate's and teacher-dump's flags that rounds sets itself (its own options, the round's paths), that would split a
# round's stage otherwise than into its --nproc-per-node jobs, or (--config) a file that could set any of them
GENERATE_OWNED = frozenset({"--student", "--data", "--out", "--engine", "--resume", "--samples-per-prompt",
                            "--max-new-tokens", "--temperature", "--seed", "--shard-index", "--num-shards", "--no-resume",
                            "--config"})
DUMP_OWNED = frozenset({"--teacher", "--student-tokenizer", "--data", "--out", "--engine", "--resume", "--no-resume",
                        "--shard-index", "--num-shards", "--config"})


def flag_names(args: list[str]) -> set[str]:
    """The flags among command-line arguments, `--flag=value` read as `--flag`."""
    return {a.split("=")[0] for a in args}


def flag_value(args: list[str], flag: str) -> str | None:
    """The value of the last `flag` among command-line arguments (`--flag value` or `--flag=value`), or None."""
    value = None
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(flag + "="):
            value = a.split("=", 1)[1]
    return value


@dataclass(kw_only=True)
class RoundsConfig:
    """The settings of one rounds work directory (recorded in WORKDIR/rounds.json)."""

    student: str
    """Student model directory (Hugging Face layout with its tokenizer): round 0's policy and the architecture every round trains."""
    teacher: str
    """Teacher model directory (scores every round's rollouts)."""
    prompts: list[str]
    """Prompt files for generate's --data (repeatable): conversations ending with the user's message, or text prefixes."""
    rounds: int = 2
    """Rounds of generate -> teacher-dump -> train-student."""
    workdir: str
    """Work directory: round-RRR/{rollouts,cache,train,done}, commands.sh, metrics.jsonl, rounds.json. Rerun the same command to resume."""
    engine: str = "vllm"
    """Engine of generate and teacher-dump: vllm or hf (reproducible)."""
    samples_per_prompt: int = 4
    """generate --samples-per-prompt."""
    max_new_tokens: int = 256
    """generate --max-new-tokens."""
    temperature: float = 1.0
    """generate --temperature (sampling)."""
    seed: int = 0
    """train-student --seed; round r generates with --seed SEED + r."""
    steps_per_round: int = 100
    """Optimizer steps per round (round r trains to (r+1) x this)."""
    loss: str | None = None
    """forward: the forward KL on the teacher's stored support + rest (train-student --loss kl with the teacher's tokenizer, else --loss pkl --pkl-divergence forward); reverse: the reverse KL (rkl, or P-KL's reverse divergence); jsd: the generalized JSD (jsd, or P-KL's jsd divergence); any other value is train-student's --loss with its defaults (auto: the KL / P-KL of a corpus cache; rkl-pg: the policy gradient). Default, as measured (docs/on-policy.md): across tokenizers jsd + 0.1 CE (top-k or full caches: on the real teacher it beat continued off-policy KD where forward lost); with the teacher's tokenizer reverse without CE on conversation prompts and forward on text prefixes; forward on drawn caches."""
    train_on: str = "last-assistant"
    """train-student --train-on: the generated turn (of a conversation, or the completion of a text prefix)."""
    projection: str | None = None
    """train-student --projection (cross-tokenizer)."""
    eval_cache: str | None = None
    """train-student --eval-cache: a held-out store, for the table's final eval KL."""
    corpus_cache: str | None = None
    """A corpus cache (same teacher tokenizer, aligned for the student) mixed into every round's training: train-student --corpus-cache, with --rollout-fraction 0.5 and --corpus-loss ce unless given after `--` (half the micro-batches CE alone on its text, its teacher values unread; with --loss jsd the mix that beat continued off-policy KD on the toy conversations across tokenizers). On the cache the student was distilled from, `-- --corpus-loss auto --rollout-fraction 0.25` (a quarter rollouts, the rest that cache under train-student's defaults) beat it on the real teacher's conversations: docs/on-policy.md."""
    generate_args: str = ""
    """Extra generate flags of every round, one shell-quoted string (e.g. '--top-p 0.95 --dtype bfloat16 --gpu-memory-utilization 0.5')."""
    dump_args: str = ""
    """Extra teacher-dump flags of every round, one shell-quoted string (e.g. '--top-k 32 --dtype bfloat16 --mode sampled')."""
    nproc_per_node: int = 1
    """GPUs of this node that each stage uses, one process per GPU: above 1, each stage runs under `torchrun --standalone` with the same flags: generate as N jobs (one GPU each, the prompts split between them), teacher-dump as N / TP jobs (TP: its --tensor-parallel-size in --dump-args; TP GPUs each), train-student on N ranks (the global batch grows with N)."""
    train_args: list[str] = field(default_factory=list, metadata={"after_dashes": True})
    """Flags after `--`: passed to every train-student command (e.g. -- --lr 1e-5 --seq-len 1024)."""

    @property
    def generate_flags(self) -> list[str]:
        return shlex.split(self.generate_args)

    @property
    def dump_flags(self) -> list[str]:
        return shlex.split(self.dump_args)

    @property
    def tensor_parallel_size(self) -> int:
        """teacher-dump's --tensor-parallel-size in --dump-args (1 when not given)."""
        value = flag_value(self.dump_flags, "--tensor-parallel-size")
        try:
            return 1 if value is None else int(value)
        except ValueError:
            raise ValueError(f"--dump-args {self.dump_args!r}: --tensor-parallel-size {value}: give a whole number") \
                from None

    @property
    def dump_mode(self) -> str:
        """teacher-dump's --mode in --dump-args (its default, topk, when not given)."""
        return flag_value(self.dump_flags, "--mode") or "topk"

    def jobs(self, stage: str) -> int:
        """The processes `stage` runs on: --nproc-per-node, teacher-dump's divided by its tensor-parallel size."""
        return self.nproc_per_node // self.tensor_parallel_size if stage == "teacher-dump" else self.nproc_per_node

    def __post_init__(self) -> None:
        if self.rounds < 1:
            raise ValueError(f"--rounds {self.rounds}: must be at least 1")
        if self.steps_per_round < 1:
            raise ValueError(f"--steps-per-round {self.steps_per_round}: must be at least 1")
        if self.nproc_per_node < 1:
            raise ValueError(f"--nproc-per-node {self.nproc_per_node}: must be at least 1")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"--dump-args {self.dump_args!r}: --tensor-parallel-size must be at least 1")
        if self.nproc_per_node % self.tensor_parallel_size:
            raise ValueError(f"--nproc-per-node {self.nproc_per_node} with --dump-args '--tensor-parallel-size "
                             f"{self.tensor_parallel_size}': teacher-dump runs N / TP jobs of TP GPUs each; give an N "
                             "that TP divides")
        if self.engine not in ("vllm", "hf"):
            raise ValueError(f"--engine {self.engine!r}: use vllm or hf")
        if not self.prompts:
            raise ValueError("--prompts: give at least one prompt file")
        owned = {"--cache", "--student", "--out", "--max-steps", "--resume", "--init-from", "--loss", "--train-on",
                 "--projection", "--eval-cache", "--corpus-cache"}
        if self.loss in (None, *DIVERGENCES):  # rounds sets the divergence itself
            owned.add("--pkl-divergence")
        clash = sorted(flag_names(self.train_args) & owned)
        if clash:
            raise ValueError(f"extra train-student flags {', '.join(clash)}: set by xtcache rounds itself; use its "
                             "own options (--loss, --train-on, --projection, --eval-cache, --corpus-cache, "
                             "--steps-per-round; "
                             "another P-KL divergence: --loss pkl -- --pkl-divergence D)")
        mode = self.dump_mode
        if self.loss in ("reverse", "jsd") and mode in DRAWN_MODES:
            raise ValueError(f"--loss {self.loss} with --dump-args '--mode {mode}': the {self.loss} divergence takes "
                             "the log of the teacher's probabilities, which a drawn cache only estimates; use --mode "
                             "topk or full, or "
                             "--loss forward (the default: the forward KL, linear in the estimate)")
        clash = sorted(flag_names(self.generate_flags) & GENERATE_OWNED)
        if clash:
            raise ValueError(f"--generate-args {self.generate_args!r}: {', '.join(clash)} set by xtcache rounds itself "
                             "(--student: round 0's, then each round's export; the prompts, the round's rollouts, "
                             "--engine, and its own --samples-per-prompt, --max-new-tokens, --temperature, --seed; "
                             "its jobs: --nproc-per-node; no --config file, which could set any of them)")
        clash = sorted(flag_names(self.dump_flags) & DUMP_OWNED)
        if clash:
            raise ValueError(f"--dump-args {self.dump_args!r}: {', '.join(clash)} set by xtcache rounds "
                             "itself (--teacher, --student, the round's rollouts and cache, --engine; its jobs: "
                             "--nproc-per-node; no --config file, which could set any of them)")


def round_dir(cfg: RoundsConfig, r: int) -> Path:
    return Path(cfg.workdir) / f"round-{r:03d}"


# how a round's stage runs on several processes: torchrun's own rendezvous on this machine, each process
# `python -m stage2_student` with train-student's flags (a rank), or `python -m xtcache.app.cli generate ...` (a job
# of a sharded generate or teacher-dump, its index from torchrun's RANK and WORLD_SIZE, its GPUs from LOCAL_RANK)
TORCHRUN = ("torchrun", "--standalone", "--nproc-per-node")
TRAIN_MODULE, CLI_MODULE = "stage2_student", "xtcache.app.cli"


def stage_command(cfg: RoundsConfig, r: int, stage: str) -> list[str]:
    """The command of `stage` in round `r`, without its resume flag: `xtcache` arguments (`train-student ...`), or
    where the stage runs on several processes its torchrun command line (`torchrun ... -m stage2_student ...`,
    `torchrun ... -m xtcache.app.cli generate ...`)."""
    args = _stage_args(cfg, r, stage)
    jobs = cfg.jobs(stage)
    if jobs == 1:
        return args
    if stage == "train-student":
        return [*TORCHRUN, str(jobs), "-m", TRAIN_MODULE, *args[1:]]
    return [*TORCHRUN, str(jobs), "-m", CLI_MODULE, *args]


def _stage_args(cfg: RoundsConfig, r: int, stage: str) -> list[str]:
    d = round_dir(cfg, r)
    if stage == "generate":
        policy = cfg.student if r == 0 else str(round_dir(cfg, r - 1) / "train" / "hf")
        return ["generate", "--student", policy, *[a for p in cfg.prompts for a in ("--data", p)],
                "--out", str(d / "rollouts"), "--engine", cfg.engine, "--samples-per-prompt",
                str(cfg.samples_per_prompt), "--max-new-tokens", str(cfg.max_new_tokens), "--temperature",
                str(cfg.temperature), "--seed", str(cfg.seed + r), *cfg.generate_flags]
    if stage == "teacher-dump":
        args = ["teacher-dump", "--teacher", cfg.teacher, "--student-tokenizer", cfg.student, "--data",
                str(d / "rollouts" / "parts" / "*.jsonl"), "--out", str(d / "cache"), "--engine", cfg.engine]
        if cfg.engine == "vllm" and r > 0 and not flag_names(cfg.dump_flags) & {"--no-fast-path", "--trust-check-from"}:
            # the same teacher every round: round 0's first-batch check holds
            args += ["--trust-check-from", str(round_dir(cfg, 0) / "cache")]
        return [*args, *cfg.dump_flags]
    args = ["train-student", "--cache", str(d / "cache"), "--student", cfg.student, "--out", str(d / "train"),
            "--max-steps", str((r + 1) * cfg.steps_per_round), *loss_flags(cfg), "--train-on", cfg.train_on,
            "--seed", str(cfg.seed)]
    if r > 0:  # the checkpoint train-student saves at its last step
        args += ["--init-from", str(round_dir(cfg, r - 1) / "train" / "checkpoints" / f"step{r * cfg.steps_per_round}")]
    if cfg.projection:
        args += ["--projection", cfg.projection]
    if cfg.eval_cache:
        args += ["--eval-cache", cfg.eval_cache]
    if cfg.corpus_cache:
        given = flag_names(cfg.train_args)
        args += ["--corpus-cache", cfg.corpus_cache,
                 *[x for flag, value in CORPUS_MIX.items() if flag not in given for x in (flag, value)]]
    if "--ce-weight" not in flag_names(cfg.train_args):
        # on the student's own fresh samples CE has no expected gradient: a small anchor, not train-student's
        # cross-tokenizer corpus default (docs/on-policy.md: measured with the forward KL and the JSD); none beside
        # the reverse KL that rounds picks itself (measured without it)
        picked_reverse = cfg.loss is None and resolved_loss(cfg) == "reverse"
        args += ["--ce-weight", "0.0" if picked_reverse else str(ROLLOUT_CE_WEIGHT)]
    return [*args, *cfg.train_args]


def stage_flags(command: list[str]) -> list[str]:
    """A stage command's own flags: after the `xtcache` command name, or after torchrun's module (and the command
    name the xtcache module is given)."""
    if command[0] != TORCHRUN[0]:
        return command[1:]
    at = command.index("-m") + 1
    return command[at + 1:] if command[at] == TRAIN_MODULE else command[at + 2:]


def shown(command: list[str]) -> str:
    """A stage command as a shell runs it."""
    return shlex.join(command) if command[0] == TORCHRUN[0] else "xtcache " + shlex.join(command)


def resolved_loss(cfg: RoundsConfig) -> str:
    """rounds' --loss, or without one the measured choice (docs/on-policy.md, bench/quality.py's converged sections):
    on drawn caches `forward` (the reverse KL and the JSD need the teacher's top-k or full support); across
    tokenizers `jsd` (on the real teacher's text prefixes the generalized JSD + 0.1 CE beat continued off-policy KD
    on both measures on every seed, where the forward P-KL lost on every seed; on the toy pair's conversations it
    did as well as the forward P-KL, which won the toy's text prefixes); with the teacher's tokenizer `reverse` on
    conversation prompts (the reverse KL without CE beat continued KD on both measures, every seed) and `forward`
    on text prefixes (no loss tried beat continued KD; it came as close as any)."""
    if cfg.loss is not None:
        return cfg.loss
    if cfg.dump_mode in DRAWN_MODES:
        return "forward"
    if not same_tokenizer(cfg):
        return "jsd"
    return "reverse" if conversation_prompts(cfg) else "forward"


def same_tokenizer(cfg: RoundsConfig) -> bool:
    """Whether the student's tokenizer is the teacher's (the same fingerprint, as the store compares them)."""
    return _tokenizer_fingerprint(cfg.student) == _tokenizer_fingerprint(cfg.teacher)


def conversation_prompts(cfg: RoundsConfig) -> bool:
    """Whether the prompts are conversations, as generate reads them: a `--messages-field` in --generate-args, else
    the first prompt file's first row (or schema) with a `messages` field and no text field (`--text-field`)."""
    flags = cfg.generate_flags
    if flag_value(flags, "--messages-field"):
        return True
    return _conversations(cfg.prompts[0], flag_value(flags, "--text-field") or "text", _prompt_options(cfg))


def _prompt_options(cfg: RoundsConfig) -> str | None:
    """The fsspec options (JSON) generate reads the prompt files with: --data-storage-options in --generate-args,
    else --storage-options."""
    flags = cfg.generate_flags
    return flag_value(flags, "--data-storage-options") or flag_value(flags, "--storage-options")


@functools.lru_cache(maxsize=8)
def _conversations(prompts: str, text_field: str, options: str | None) -> bool:
    from stage1_teacher.corpus import detect_messages_field

    with _as_prompts():
        return detect_messages_field(prompts, text_field, json.loads(options) if options else None) is not None


@contextlib.contextmanager
def _as_prompts():
    """The corpus's errors name its --data: read for rounds, the files are its --prompts."""
    try:
        yield
    except (XtcacheError, ValueError) as e:
        raise ConfigError(str(e).replace("--data", "--prompts", 1)) from None


def check_prompts(cfg: RoundsConfig) -> None:
    """Every --prompts file there, of a known format, as generate resolves its --data (globs expanded), before
    anything runs: a ConfigError naming --prompts and the file."""
    from stage1_teacher.config import expand_globs
    from stage1_teacher.corpus import Corpus

    options = _prompt_options(cfg)
    with _as_prompts():
        options = json.loads(options) if options else None
        Corpus.resolve(expand_globs(cfg.prompts, options), storage_options=options)


def loss_flags(cfg: RoundsConfig) -> list[str]:
    """train-student's loss flags for rounds' loss (`resolved_loss`): `forward` and `reverse` are that KL on the
    teacher's stored support, `kl` / `rkl` when the student's tokenizer is the teacher's, else P-KL with that
    divergence; another --loss passes through."""
    loss = resolved_loss(cfg)
    if loss not in DIVERGENCES:
        return ["--loss", loss]
    if same_tokenizer(cfg):  # the forward KL of a drawn cache is train-student's sampled-target estimate
        return ["--loss", "sampled" if loss == "forward" and cfg.dump_mode in DRAWN_MODES else DIVERGENCES[loss]]
    return ["--loss", "pkl", "--pkl-divergence", loss]


@functools.lru_cache(maxsize=8)
def _tokenizer_fingerprint(model_dir: str) -> str:
    """The fingerprint of the tokenizer loaded from a model directory (as teacher-dump and train-student load it)."""
    return tokenizer_fingerprint(load_tokenizer(model_dir, f"tokenizer of {model_dir}"))


def resume_flags(cfg: RoundsConfig, r: int, stage: str) -> list[str]:
    """The flags that continue an interrupted `stage` from what it left on disk (none for a fresh start)."""
    d = round_dir(cfg, r)
    if stage == "generate":
        return ["--resume"] if (d / "rollouts" / "manifest.json").exists() else []
    if stage == "teacher-dump":
        return ["--resume"] if (d / "cache").exists() and any((d / "cache").iterdir()) else []
    from stage2_student.checkpoint import complete_checkpoint

    ckpt = complete_checkpoint(d / "train")  # a driver killed while a checkpoint was saved resumes from the one before
    if ckpt is not None:
        return ["--resume", str(ckpt)]
    if (d / "train").exists():  # killed before its first checkpoint: nothing of it is kept
        log.info("round %d: train-student left no checkpoint; starting it again in %s", r, d / "train")
        shutil.rmtree(d / "train")
    return []


def stage_outputs(cfg: RoundsConfig, r: int, stage: str) -> dict[str, str]:
    """sha256 of the files that make a stage's result (what the next stage reads; small files only for
    the cache: its manifest and writers' done markers, which name and count every committed part)."""
    d = round_dir(cfg, r)
    if stage == "generate":
        files = sorted((d / "rollouts" / "parts").glob("*.jsonl")) + [d / "rollouts" / "manifest.json"]
    elif stage == "teacher-dump":
        files = [d / "cache" / "manifest.json", *sorted((d / "cache" / "done").glob("*.json"))]
    else:
        files = sorted((d / "train" / "hf").glob("*.safetensors")) + [d / "train" / "summary.json"]
    missing = [str(f) for f in files if not f.is_file()]
    if missing or not files:
        raise ConfigError(f"round {r} {stage}: exited 0 but {missing or d} is missing; rerun xtcache rounds")
    return {str(f.relative_to(d)): sha256_file(f) for f in files}


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _die_with_parent(sig: int):
    """What a stage's child runs before its exec (`preexec_fn`): receive `sig` when the driver dies, so a killed
    driver leaves no stage running. libc is loaded here, in the driver, not in the forked child."""
    import ctypes

    prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
    return lambda: prctl(1, sig)  # PR_SET_PDEATHSIG


# A launcher's job index and process group: each stage reads them as its own (teacher-dump and generate as
# their shard of a sharded job, train-student as one rank of a process group that never forms), while a
# round's stage is a job of its own (one process, or torchrun's own process group). A driver started inside a
# launcher's job (a Slurm array running one rounds run per seed, a shell under torchrun) passes none of them on.
LAUNCHER_ENV = ("SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_MIN", "SLURM_ARRAY_TASK_MAX", "SLURM_ARRAY_TASK_COUNT",
                "JOB_COMPLETION_INDEX", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                "MASTER_ADDR", "MASTER_PORT")


def stage_env(environ) -> dict[str, str]:
    """The environment of a stage: the driver's, without a launcher's job index and process group."""
    return {**{k: v for k, v in environ.items() if k not in LAUNCHER_ENV}, "PYTHONUNBUFFERED": "1"}


def run_xtcache(cfg: RoundsConfig, args: list[str]) -> None:
    """Print a stage's command, append it to WORKDIR/commands.sh, run it; raise on a failed exit.

    On Linux the stage dies with the driver (PR_SET_PDEATHSIG): an `xtcache` stage by SIGKILL; torchrun by
    SIGTERM, on which it stops its ranks, and its ranks are also guarded by xtcache's process watcher
    (`xtcache.reaper`), which ends them should torchrun itself be killed first."""
    line = shown(args)
    typer.echo(f"$ {line}", err=True)
    with open(Path(cfg.workdir) / "commands.sh", "a") as f:
        f.write(line + "\n")
    linux = sys.platform.startswith("linux")
    if not linux:
        log.warning("not Linux: a stage keeps running if this driver is killed; stop it before rerunning")
    torchrun = args[0] == TORCHRUN[0]
    argv = [sys.executable, "-m", "torch.distributed.run", *args[1:]] if torchrun else \
        [sys.executable, "-m", "xtcache.app.cli", *args]
    sig = signal.SIGTERM if torchrun else signal.SIGKILL
    with guard_children() if torchrun else contextlib.nullcontext():
        rc = subprocess.run(argv, env=stage_env(os.environ),
                            preexec_fn=_die_with_parent(sig) if linux else None).returncode
    if rc != 0:
        raise ConfigError(f"{line}: exit {rc}; fix the cause and rerun xtcache rounds (finished stages are kept; "
                          "flags that change only unfinished stages may change)")


def run_stage(cfg: RoundsConfig, r: int, stage: str) -> dict:
    """Run (or skip, when done) one stage of round r; returns its done record."""
    done_path = round_dir(cfg, r) / "done" / f"{stage}.json"
    command = stage_command(cfg, r, stage)
    if done_path.exists():
        done = json.loads(done_path.read_text())
        if done["command"] != command:
            raise ConfigError(f"{done_path}: round {r} {stage} was run as `{shown(done['command'])}`, "
                              f"not as these settings give; to redo it: rm -r {shlex.join(redo_paths(cfg, r, stage))}"
                              "; or use another --workdir")
        if stage_outputs(cfg, r, stage) != done["outputs"]:
            raise ConfigError(f"{done_path}: the outputs of round {r} {stage} changed since it finished; "
                              f"delete {done_path.parent} and rerun to redo the round")
        log.info("round %d %s: done, skipped", r, stage)
        return done
    restart_if_changed(cfg, r, stage, command)
    run_xtcache(cfg, [*command, *resume_flags(cfg, r, stage)])
    done = {"stage": stage, "round": r, "command": command, "outputs": stage_outputs(cfg, r, stage)}
    if stage == "train-student":
        done["objective"] = json.loads((round_dir(cfg, r) / "train" / "summary.json").read_text()).get("objective")
        done["loss_settings"] = loss_settings(cfg)
    _write_atomic(done_path, json.dumps(done, indent=1))
    return done


def loss_settings(cfg: RoundsConfig) -> dict:
    """The settings a round's train-student resolves its loss from: rounds' loss (`resolved_loss`) and the flags
    after `--`."""
    return {"loss": resolved_loss(cfg), "train_args": list(cfg.train_args)}


# the resolved objective's settings (`Objective.describe`) as train-student's flags, to pin one
OBJECTIVE_FLAGS = {"ce_weight": "--ce-weight", "kd_weight": "--kd-weight", "temperature": "--temperature",
                   "pkl_divergence": "--pkl-divergence", "pkl_reverse_weight": "--pkl-reverse-weight",
                   "chunk_rows": "--chunk-rows", "jsd_beta": "--jsd-beta", "alm_tau": "--alm-tau", "is_cap": "--is-cap",
                   "dynamic_scaling": "--dynamic-scaling"}  # the kind is rounds' own --loss: not pinned after --


def _pin(key: str, value) -> str:
    flag = OBJECTIVE_FLAGS[key]
    if isinstance(value, bool):
        return flag if value else flag.replace("--", "--no-", 1)
    return f"{flag} {value}"


def check_objective(cfg: RoundsConfig, r: int, done: dict) -> None:
    """Round r's train-student must train the loss that the first earlier round run with the same loss settings
    trained: the same command resolving to another objective means the xtcache that ran the earlier round
    filled in other defaults (an upgrade between runs of one work directory); refused, naming the settings."""
    mine = done.get("objective")
    if mine is None:
        return  # a round finished by an xtcache that did not record its objective
    for q in range(r):
        path = round_dir(cfg, q) / "done" / "train-student.json"
        was = json.loads(path.read_text()) if path.exists() else {}
        if was.get("objective") is None or was.get("loss_settings") != done.get("loss_settings"):
            continue
        if was["objective"] == mine:
            return
        keys = sorted(k for k in set(was["objective"]) | set(mine) if was["objective"].get(k) != mine.get(k))
        diff = "; ".join(f"{k} {was['objective'].get(k)} -> {mine.get(k)}" for k in keys)
        divergence_owned = resolved_loss(cfg) in DIVERGENCES  # rounds sets --pkl-divergence itself
        pins = [_pin(k, was["objective"][k]) for k in keys if k in OBJECTIVE_FLAGS
                and was["objective"].get(k) is not None and not (k == "pkl_divergence" and divergence_owned)]
        again = f" with `-- {' '.join(pins)}` among the flags after -- to train as round {q} did" if pins else ""
        raise ConfigError(
            f"round {r} train-student resolved another loss than round {q} from the same settings ({diff}): the "
            f"xtcache that ran round {q} filled in other defaults. Finish the run with that xtcache (after rm -r "
            f"{shlex.join(redo_paths(cfg, r, 'train-student'))}), or start the rounds again in another "
            f"--workdir{again}")


def rollout_counts(reader) -> list[dict[str, int]]:
    """The sampled-turn counts (`rollout_summary`) of each alignment group of a round cache that has rollouts."""
    return [c for fp in reader.alignment_groups() if (c := rollout_summary(part_counts(reader, fp)))]


def retokenized(counts: list[dict[str, int]]) -> int:
    """Generated turns kept on re-tokenized ids without sampling log-probs (their sampled ids do not spell the
    text: no splice), over `rollout_counts`."""
    return sum(c["sampled_mismatch"] - c["sampled_same_text"] for c in counts)


def _no_ratio(cap: str | None) -> bool:
    """Whether train-student's `--is-cap` value turns rkl-pg's ratio off (0); one that is no number counts as
    off here: train-student refuses it, naming it."""
    try:
        return cap is not None and float(cap) == 0
    except ValueError:
        return True


def check_sampled(cfg: RoundsConfig, r: int) -> None:
    """`--loss rkl-pg` with its importance ratio: say, before train-student starts, how many generated turns of
    round r's cache keep re-tokenized ids without sampling log-probs (their ids do not spell the text): those
    train without the ratio (`stage2_student.onpolicy.behaviour_rows`). The round's table counts them too."""
    if cfg.loss != "rkl-pg" or _no_ratio(flag_value(cfg.train_args, "--is-cap")):
        return
    cache = round_dir(cfg, r) / "cache"
    counts = rollout_counts(CacheReader(str(cache)))
    missing = retokenized(counts)
    if missing:
        turns = sum(c["sampled_turns"] for c in counts)
        log.warning("round %d: %d of the %d generated turns in %s keep re-tokenized ids without sampling log-probs "
                    "(their sampled ids do not spell the text: `xtcache inspect %s`); --loss rkl-pg trains them "
                    "without its importance ratio", r, missing, turns, cache, cache)


def round_metrics(cfg: RoundsConfig, r: int) -> dict:
    """What round r produced, read from its stages' outputs."""
    d = round_dir(cfg, r)
    rows = [json.loads(line) for p in sorted((d / "rollouts" / "parts").glob("*.jsonl"))
            for line in p.read_text().splitlines() if line.strip()]
    reader = CacheReader(str(d / "cache"))
    dump = [w.summary for w in reader.writer_summaries().values()]
    counts = rollout_counts(reader)
    summary = json.loads((d / "train" / "summary.json").read_text())
    start = r * cfg.steps_per_round
    train = [json.loads(line) for line in (d / "train" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [t for t in train if t.get("kind") == "train" and t["step"] > start]
    kd = [t["kd"] for t in steps if t.get("kd") is not None]
    stale = [t for t in steps if t.get("sampled_labels")]  # steps that trained on sampled tokens
    return {
        "round": r, "policy": rows[0]["policy"] if rows else None, "rollouts": len(rows),
        "generated_tokens": sum(len(x["sampled_ids"]) for x in rows),
        "stopped": sum(x["stop_reason"] == "stop" for x in rows),
        "teacher_positions": sum(int(s.get("positions") or 0) for s in dump),
        "train_steps": summary["steps"] - start, "step": summary["steps"], "loss": summary["kd_loss"],
        "final_eval_kl": summary.get("final_eval_kl"),
        "mean_train_kd": sum(kd) / len(kd) if kd else None,
        # generated turns trained on re-tokenized ids (their sampled ids do not spell the turn's text: no splice)
        "retokenized_turns": retokenized(counts) if counts else None,
        # how far the student moved from the policy that sampled the round's rollouts, at its last step
        "stale_mean_abs_log_ratio": stale[-1]["stale_mean_abs_log_ratio"] if stale else None,
        "stale_share_over_cap": stale[-1]["stale_share_over_cap"] if stale else None,
        "hf_dir": str(d / "train" / "hf"),
    }


COLUMNS = (("round", "round", "d"), ("rollouts", "rollouts", "d"), ("generated_tokens", "tokens scored", "d"),
           ("teacher_positions", "teacher positions", "d"), ("train_steps", "train steps", "d"),
           ("final_eval_kl", "final eval KL", ".4f"), ("mean_train_kd", "mean train KD", ".4f"),
           ("retokenized_turns", "re-tokenized turns", "d"),
           ("stale_mean_abs_log_ratio", "last step |log p/p_sampler|", ".3f"),
           ("stale_share_over_cap", "last step ratios > cap", ".3f"))


def summary_table(metrics: list[dict]) -> str:
    """The per-round table; 'mean train KD' is the mean reverse-KL signal under --loss rkl-pg."""
    lines = [" | ".join(title for _, title, _ in COLUMNS), " | ".join("---" for _ in COLUMNS)]
    for m in metrics:
        lines.append(" | ".join("-" if m.get(k) is None else format(m[k], spec) for k, _, spec in COLUMNS))
    return "\n".join(lines)


OUTPUT_DIRS = {"generate": "rollouts", "teacher-dump": "cache", "train-student": "train"}


def restart_if_changed(cfg: RoundsConfig, r: int, stage: str, command: list[str]) -> None:
    """Record the command an unfinished stage starts with (W/round-RRR/started/STAGE.json); when it was
    started before with another one, remove what it left: resuming would mix two settings in one output,
    which its done record's command would no longer describe."""
    started = round_dir(cfg, r) / "started" / f"{stage}.json"
    output = round_dir(cfg, r) / OUTPUT_DIRS[stage]
    if started.exists() and json.loads(started.read_text())["command"] != command and output.exists():
        log.warning("round %d %s: started as `%s`, now `%s`; starting it again (%s removed)", r,
                    stage, shown(json.loads(started.read_text())["command"]), shown(command), output)
        shutil.rmtree(output)
    _write_atomic(started, json.dumps({"stage": stage, "round": r, "command": command}, indent=1))


def redo_paths(cfg: RoundsConfig, r: int, stage: str) -> list[str]:
    """What to remove so that a rerun redoes round r's `stage` and every stage after it: their outputs and
    records in round r, and the later rounds' directories (those that exist)."""
    d = round_dir(cfg, r)
    later = STAGES[STAGES.index(stage):]
    paths = [p for s in later for p in (d / OUTPUT_DIRS[s], d / "done" / f"{s}.json", d / "started" / f"{s}.json")]
    paths += sorted(p for p in Path(cfg.workdir).glob("round-*") if p.name > d.name)
    return [str(p) for p in paths if p.exists()]


def _flags(key: str, value) -> str:
    """A setting as the command line gives it: `--max-new-tokens 8`, `-- --lr 1e-3`, `--dump-args '...'`."""
    if key == "train_args":
        return shlex.join(["--", *value]) if value else "no flags after --"
    flag = "--rounds" if key == "rounds" else "--" + key.replace("_", "-")
    if value is None or value == [] and key != "prompts":
        return f"no {flag}"
    if key in ("generate_args", "dump_args"):
        return f"{flag} {shlex.quote(value)}" if value else f"no {flag}"
    return " ".join(f"{flag} {shlex.quote(str(v))}" for v in (value if isinstance(value, list) else [value]))


def finished_stages_changed(was: RoundsConfig, cfg: RoundsConfig, changed: list[str]) -> list[tuple[int, str, list[str]]]:
    """(round, stage, settings) of each finished stage of the rounds `cfg` runs whose command the new
    settings change, with the changed settings that change it (all of them when none alone does)."""
    out, mine = [], asdict(cfg)
    for r in range(cfg.rounds):
        for stage in STAGES:
            done_path = round_dir(cfg, r) / "done" / f"{stage}.json"
            if not done_path.exists():
                continue
            if json.loads(done_path.read_text())["command"] == stage_command(cfg, r, stage):
                continue
            keys = [k for k in changed if stage_command(replace(was, **{k: mine[k]}), r, stage)
                    != stage_command(was, r, stage)]
            out.append((r, stage, keys or changed))
    return out


def check_settings(cfg: RoundsConfig) -> None:
    """Record the settings in WORKDIR/rounds.json. A rerun may change them where they change only stages
    that have not finished (--rounds may grow or shrink); one that changes a finished stage is refused,
    naming the setting, the stage, and the ways out."""
    path = Path(cfg.workdir) / SETTINGS_FILE
    if path.exists():
        recorded = json.loads(path.read_text())
        for key in ("generate_args", "dump_args"):  # a work directory without extra stage flags has none
            extra = recorded.get(key) or ""
            recorded[key] = shlex.join(extra) if isinstance(extra, list) else extra
        recorded.setdefault("nproc_per_node", 1)  # recorded before the option: one process
        mine = asdict(cfg)
        changed = sorted(k for k in set(recorded) | set(mine) if k != "rounds" and recorded.get(k) != mine.get(k))
        if changed:
            try:
                was = RoundsConfig(**recorded)
            except (TypeError, ValueError) as e:
                raise ConfigError(f"--workdir {cfg.workdir}: {path} is not a rounds.json this xtcache reads ({e}); "
                                  "use another --workdir") from None
            blocked = finished_stages_changed(was, cfg, changed)
            if blocked:
                r, stage, keys = blocked[0]
                now = "; ".join(f"{_flags(k, recorded.get(k))} -> {_flags(k, mine.get(k))}" for k in keys)
                back = " ".join(_flags(k, recorded.get(k)) for k in keys)
                raise ConfigError(
                    f"--workdir {cfg.workdir}: {now} changes round {r} {stage}, which has finished "
                    f"({round_dir(cfg, r) / 'done' / (stage + '.json')}). Settings of stages that have not "
                    f"finished may change on a rerun; this one may not. Rerun with {back} to go on; or, to redo "
                    f"round {r} {stage} and everything after it with the new settings: "
                    f"rm -r {shlex.join(redo_paths(cfg, r, stage))}; or use another --workdir")
            log.info("--workdir %s: settings changed since its last run (%s); no finished stage depends on them",
                     cfg.workdir, ", ".join(changed))
    _write_atomic(path, json.dumps(asdict(cfg), indent=1))


FLAGS_FROM = {"generate": "xtcache rounds' own options or --generate-args", "teacher-dump": "--dump-args",
              "train-student": "xtcache rounds' own options or the flags after --"}


def check_commands(cfg: RoundsConfig) -> None:
    """Each stage's command of every round built into its config as the stage will build it, and the paths
    it names outside the work directory checked (those inside are the rounds' own outputs): ConfigError
    naming the round, the stage, the flag and where it came from, before anything runs."""
    from stage1_teacher.cli import generate, teacher_dump
    from stage2_student.cli import train_student
    from xtcache.cliconfig import check_paths, config_of

    check_prompts(cfg)
    commands = {"generate": generate, "teacher-dump": teacher_dump, "train-student": train_student}
    gpus = cuda_device_count() if cfg.nproc_per_node > 1 else None  # the driver imports torch only then
    if gpus and gpus < cfg.nproc_per_node:
        raise ConfigError(f"--nproc-per-node {cfg.nproc_per_node}: this machine shows {gpus} GPUs, one for each "
                          "process of a stage (CUDA_VISIBLE_DEVICES applies); nothing has run")
    if gpus == 0:
        log.warning("--nproc-per-node %d on a machine without GPUs: each stage's %d processes share its CPU cores "
                    "(generate and teacher-dump jobs each start their own engine)", cfg.nproc_per_node,
                    cfg.nproc_per_node)
    work = Path(cfg.workdir).resolve()
    first = {}  # round 0's configs
    for r in range(cfg.rounds):
        for stage in STAGES:
            args = stage_flags(stage_command(cfg, r, stage))
            if stage == "teacher-dump":  # its --data, the round's rollouts, is not written yet: the prompts stand in
                at = args.index("--data")
                args[at:at + 2] = [a for p in cfg.prompts for a in ("--data", p)]
            try:
                built, paths = config_of(commands[stage], args)
                check_paths(built, paths, only=lambda path: not Path(path).resolve().is_relative_to(work))
            except ConfigError as err:
                raise ConfigError(f"round {r} {stage} would be refused: {err} (from {FLAGS_FROM[stage]}); "
                                  "nothing has run") from None
            first.setdefault(stage, built)
    check_windows(cfg, first["generate"], first["train-student"])
    check_corpus_roles(cfg, first["train-student"])


def check_windows(cfg: RoundsConfig, generate_cfg, train_cfg) -> None:
    """Refuse a plan whose rollouts cannot fill one optimizer step, which train-student's loader refuses
    (`stage2_student.loader.CacheDataset`: fewer windows of --seq-len than --micro-batch-size x ranks x
    --grad-accum) after the round's generate and teacher-dump. The windows are bounded before any sample exists:
    prompts x --samples-per-prompt rollouts (`rollout_size`: at most --max-new-tokens generated) make at most one
    window each when each fits in one, or when only the generated turn trains (--train-on last-assistant, or
    assistant after prompts without an assistant turn) and it fits with its context share; the chunk just before
    a turn is template text (`xtcache.chat.layout`: one token a chunk). Else the windows are not bounded, and
    nothing is refused. A --corpus-cache changes nothing here: the rollout cache is planned on its own, on the
    same ranks and --grad-accum (`stage2_student.data.make_loaders`). A prompt set with enough rows for a step's
    windows is read no further."""
    from stage1_teacher.capture.preflight import open_corpus
    from stage1_teacher.corpus import Skipped, iter_corpus
    from stage1_teacher.onpolicy.rollouts import prompt_of, rollout_size
    from xtcache.packing import most_windows

    loader, accum, ranks = train_cfg.loader, train_cfg.optim.grad_accum, cfg.jobs("train-student")
    need = loader.micro_batch_size * ranks * accum
    too_few = (need - 1) // cfg.samples_per_prompt  # the most prompts whose rollouts are fewer than `need`
    if too_few == 0:
        return
    with _as_prompts():
        rows = list(itertools.islice(iter_corpus(open_corpus(generate_cfg)), too_few + 1))
    if not rows or len(rows) > too_few or any(isinstance(row, Skipped) for row in rows):
        return  # enough prompts, or none usable: generate refuses the set itself
    tokenizer = load_tokenizer(cfg.student, "--student")
    try:
        prompts = [prompt_of(row, tokenizer, "--prompts") for row in rows]
    except ConfigError as err:
        raise ConfigError(f"round 0 generate would be refused: {err}; nothing has run") from None
    sizes = [rollout_size(p, tokenizer, cfg.max_new_tokens) for p in prompts]
    if None in sizes:
        return
    turns = [s.turn for s in sizes]
    only_turn = cfg.train_on == "last-assistant" or (cfg.train_on == "assistant" and not any(
        m.get("role") == "assistant" for p in prompts for m in (p.conversation or {}).get("messages", ())))
    rollouts = len(rows) * cfg.samples_per_prompt
    windows = most_windows(rollouts, loader.seq_len, longest=max(s.tokens for s in sizes),
                           trained_span=max(turns) if only_turn and None not in turns else None)
    if windows is None or windows >= need:
        return
    raise ConfigError(
        f"--prompts {' '.join(cfg.prompts)}: {len(rows)} prompt(s) x --samples-per-prompt {cfg.samples_per_prompt} "
        f"give at most {rollouts} rollouts, at most one window of --seq-len {loader.seq_len} each (--max-new-tokens "
        f"{cfg.max_new_tokens}), and train-student needs {need} windows for one optimizer step (--micro-batch-size "
        f"{loader.micro_batch_size} x --nproc-per-node {ranks} x --grad-accum {accum}): it would be refused after "
        "round 0's generate and teacher-dump. Give more prompts or a larger --samples-per-prompt, or a smaller "
        "--micro-batch-size or --grad-accum after --; nothing has run")


def check_corpus_roles(cfg: RoundsConfig, train_cfg) -> None:
    """Refuse a --corpus-cache that train-student's loader refuses under rounds' --train-on, after round 0's
    generate and teacher-dump: by role (assistant, last-assistant) on plain text without token roles
    (`stage2_student.loader.check_token_roles`): the rollouts and the corpus cache train under one --train-on."""
    from stage2_student.loader import check_token_roles

    loader = train_cfg.loader
    if not loader.corpus_cache:
        return
    try:
        reader = CacheReader(loader.corpus_cache, storage_options=loader.storage_options)
        # a plain-text cache's groups are keyed by the tokenizer alone (a conversation cache passes unread)
        check_token_roles(reader, _tokenizer_fingerprint(cfg.student), conversation=bool(reader.manifest.conversation),
                          train_on=loader.train_on, name=f"--corpus-cache {loader.corpus_cache}")
    except XtcacheError as err:
        raise ConfigError(f"round 0 train-student would be refused: {err} (from {FLAGS_FROM['train-student']}); "
                          "nothing has run") from None


def run_rounds(cfg: RoundsConfig) -> list[dict]:
    """All rounds, skipping finished stages; returns the per-round metrics (also WORKDIR/metrics.jsonl)."""
    check_commands(cfg)
    Path(cfg.workdir).mkdir(parents=True, exist_ok=True)
    check_settings(cfg)
    if dropped := [f"{k}={os.environ[k]}" for k in LAUNCHER_ENV if k in os.environ]:
        log.warning("each stage runs as a job of its own: its environment leaves out %s", ", ".join(dropped))
    metrics = []
    for r in range(cfg.rounds):
        for stage in STAGES:
            if stage == "train-student":
                check_sampled(cfg, r)
            done = run_stage(cfg, r, stage)
        check_objective(cfg, r, done)
        metrics.append(round_metrics(cfg, r))
        _write_atomic(Path(cfg.workdir) / "metrics.jsonl", "".join(json.dumps(m) + "\n" for m in metrics))
        log.info("round %d done: %s", r, json.dumps(metrics[-1]))
    return metrics


def _rounds(cfg: RoundsConfig) -> None:
    metrics = run_rounds(cfg)
    typer.echo(summary_table(metrics))
    typer.echo(f"final student: {metrics[-1]['hf_dir']}")


rounds = command(
    RoundsConfig, _rounds, name="rounds",
    help="On-policy distillation in rounds: generate -> teacher-dump -> train-student, resumable.\n\n"
         "Arguments after `--` go to every train-student command (e.g. -- --lr 1e-5 --seq-len 1024).",
    paths={"student": "dir", "teacher": "dir", "projection": "file", "eval_cache": "dir"})
