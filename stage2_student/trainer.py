"""The stage 2 student trainer: DeepSpeed ZeRO 1/2/3 over micro-batches streamed from a teacher cache.

    xtcache train-student --cache STORE --student DIR --out RUN                  # one process
    torchrun --standalone --nproc_per_node 2 -m stage2_student --cache ... --out RUN
    deepspeed --num_gpus 8 --module stage2_student --cache ... --out RUN

The same code runs on CPU (gloo) and GPU (nccl): DeepSpeed picks its accelerator and backend.
One optimizer step takes `--grad-accum` micro-batches on every rank. The loss of a step is
`w_kd * sum(KD over chunks) / N_chunks + w_ce * sum(CE over tokens) / N_tokens`, where both counts
are taken over the whole global batch (all ranks, all accumulated micro-batches): the counts are
all-reduced once before the step's first forward, so world 1 x grad-accum 2 and world 2 x
grad-accum 1 train the same model. Cross-tokenizer caches train with the projected KL: the map
comes from --projection (checked against both tokenizer fingerprints of the cache) or, without it,
is built on the fly from the student tokenizer and the teacher tokenizer at the cache's recorded
teacher path (logged; a clear error when that tokenizer is not there). Outputs under --out: `metrics.jsonl` (one line per step and per
evaluation), `tensorboard/` (when tensorboard is installed), `checkpoints/stepN/` (DeepSpeed state,
per-rank loader and RNG state, the config), `hf/` (a plain transformers directory) and
`summary.json`.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import shutil
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from stage2_student.config import TrainConfig, deepspeed_config, lr_lambda
from xtcache.errors import ConfigError

log = logging.getLogger(__name__)

CKPT_DIR = "checkpoints"
CONVERT_WAIT_S = 6 * 3600  # ranks wait this long for rank 0 to convert a checkpoint
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
HF_DIR = "hf"


@dataclass
class StageData:
    """What the trainer needs from the cache side: batch streams and the objective's pieces.

    `train` yields this rank's micro-batches (the "Stage 2 batch" of docs/architecture.md) in
    global order: step s, rank r, accumulation index a reads global micro-batch
    `s * world * grad_accum + r * grad_accum + a`, and has `state_dict()` / `load_state_dict()`.
    `make_eval` returns a fresh finite iterable of this rank's held-out micro-batches (or None).
    `kd` maps (logits [B, L, V] in the model's dtype, batch) to the SUM of the KD loss over the
    batch's valid chunks (None: no teacher term at all). `teacher_top1_of_student` maps student ids
    to teacher ids for the top-1 agreement metric (None: identity, same tokenizer).
    """

    train: Any
    make_eval: Callable[[], Iterable[dict]] | None = None
    kd: Callable[[Any, dict], Any] | None = None
    kd_name: str = "none"
    teacher_top1_of_student: Any = None
    measure_agreement: bool = True
    info: dict = field(default_factory=dict)


def setup_distributed() -> tuple[int, int, int]:
    """Start (or join) the process group; returns (rank, local rank, world size).

    Plain `python`/`xtcache` runs get single-process defaults for the env variables
    `deepspeed.init_distributed()` reads (it would otherwise look for MPI). The CPU shared-memory
    communication op is never built: training does not use it and it costs a JIT compile.
    """
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("LOCAL_RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        with socket.socket() as sock:  # a free port for this single-process group
            sock.bind(("127.0.0.1", 0))
            os.environ.setdefault("MASTER_PORT", str(sock.getsockname()[1]))
    os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    import deepspeed

    deepspeed.init_distributed()
    import torch.distributed as dist

    # this rank's GPU before anything lands on "the" device (a no-op on CPU)
    deepspeed.get_accelerator().set_device(int(os.environ["LOCAL_RANK"]))
    return dist.get_rank(), int(os.environ["LOCAL_RANK"]), dist.get_world_size()


def load_tokenizer(path: str | Path):
    """The student tokenizer exactly as stage 1 loaded it (see `xtcache.tokenizer`)."""
    from xtcache.tokenizer import load_tokenizer as load

    return load(path, "student tokenizer")


def teardown_distributed() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _to_device(batch: dict, device) -> dict:
    import torch

    return {k: (v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}


@dataclass
class ResumePoint:
    """Where --resume continues: the checkpoint, its trainer state and this rank's loader state."""

    ckpt: Path
    state: dict
    loader: dict
    reshard: bool  # saved with another number of ranks


class Trainer:
    """One training run: engine, data, metrics, checkpoints, export. Construct inside a process group."""

    def __init__(self, cfg: TrainConfig, data: StageData, *, rank: int, world: int):
        import deepspeed
        import torch

        self.cfg, self.data, self.rank, self.world = cfg, data, rank, world
        self.out = Path(cfg.out)
        torch.manual_seed(cfg.seed)
        self.tokenizer = load_tokenizer(cfg.student)
        self.num_params = count_parameters(cfg.student)
        self.ds_config = deepspeed_config(cfg, self.num_params)
        # read (and a layout the data stream cannot follow refused) before any expensive work
        self._resume = self._resume_point(cfg.checkpoint.resume) if cfg.checkpoint.resume else None
        if self._resume is not None:
            # only ZeRO-1/2/3 states are partitioned by world size; see load_checkpoint
            universal = self._resume.reshard and self.ds_config["zero_optimization"]["stage"] > 0
            self.ds_config.setdefault("checkpoint", {})["load_universal"] = universal
        model = load_student(cfg.student, self.ds_config)
        model.config.use_cache = False
        attn = getattr(model.config, "_attn_implementation", "")
        if str(attn).startswith("flash") and cfg.loader.micro_batch_size > 1:
            # transformers infers packed documents from position ids for flash attention only at batch size 1
            raise ConfigError(f"the student uses {attn}, which keeps packed documents apart only with "
                              "--micro-batch-size 1; use it (and raise --grad-accum), or attn_implementation sdpa")
        self.params_local_at_load = sum(int(getattr(p, "ds_tensor", p).numel()) for p in model.parameters())
        scheduler = None
        if "scheduler" not in self.ds_config:
            scale = lr_lambda(cfg)
            scheduler = lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, scale)  # noqa: E731
        else:
            log.warning("using the scheduler of %s, not --warmup-steps/--max-steps cosine", cfg.deepspeed.deepspeed)
        self.engine, _, _, _ = deepspeed.initialize(
            model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
            config=self.ds_config, lr_scheduler=scheduler)
        self.device = self.engine.device
        self.zero3 = self.engine.zero_optimization_stage() == 3
        self.step = 0
        self.metrics_path = self.out / METRICS_FILE
        self._tb = None
        self._eval_history: list[dict] = []

    # ----------------------------------------------------------------- loss of one micro-batch
    def _forward(self, batch: dict, n_chunks, n_tokens, *, train: bool) -> dict:
        """Loss terms of one micro-batch; `loss` is normalized by the global counts given."""
        import torch

        from stage2_student import losses

        out = self.engine(**model_inputs(batch))
        logits = out.logits  # [B, L, V] in the model's dtype; the losses work in fp32 blocks
        labels = batch["labels"]
        zero = torch.zeros((), dtype=torch.float32, device=logits.device)
        chunks = int(batch.get("num_chunks", 0))
        train_kd = self.cfg.loss.loss != "ce"
        kd_sum, fused = None, None
        if self.data.kd is not None and chunks and (train_kd or not train):
            # CE rides in the KD's pass over the vocabulary: one gradient buffer for the logits, not two
            with losses.fuse_cross_entropy(logits, labels) as fused:
                kd_sum = self.data.kd(logits, batch)  # sum over this micro-batch's valid chunks
        if fused is not None and fused.result is not None:
            ce_sum = fused.result.total
        else:
            ce_sum = losses.cross_entropy(logits, labels).total if int((labels != -100).sum()) else zero
        loss = logits.sum() * 0.0 + ce_sum * (self.cfg.loss.ce_weight / n_tokens)  # keeps the graph
        terms = {"ce_sum": ce_sum.detach(), "kd_sum": zero, "agree": zero, "agree_n": zero}
        if kd_sum is not None:
            terms["kd_sum"] = kd_sum.detach()
            if train_kd:
                w_kd = self.cfg.loss.kd_weight
                if self.cfg.loss.dynamic_scaling:  # w = sg(|CE| / |KD|), both as local means
                    ce_mean = ce_sum.detach() / max(1, int((labels != -100).sum()))
                    w_kd = w_kd * ce_mean.abs() / (kd_sum.detach() / chunks).abs().clamp_min(1e-12)
                loss = loss + kd_sum * (w_kd / n_chunks)
        if self.data.kd is not None and chunks and self.data.measure_agreement:
            score = batch["teacher_logprobs"] if "teacher_logprobs" in batch else batch["teacher_counts"]
            terms["agree"], terms["agree_n"] = losses.top1_agreement(
                logits.detach(), batch["student_chunk"], batch["teacher_ids"], score, batch["teacher_chunk"],
                chunks, student_to_teacher=self.data.teacher_top1_of_student)
        terms["loss"] = loss
        predicting, chunk_of = labels != -100, batch.get("student_chunk")
        terms["valid_pos"] = zero if chunk_of is None else ((chunk_of >= 0) & predicting).sum().float()
        terms["pred_pos"] = predicting.sum().float()
        return terms

    @staticmethod
    def _counts(batches: list[dict]) -> tuple[int, int]:
        chunks = sum(int(b.get("num_chunks", 0)) for b in batches)
        tokens = sum(int((b["labels"] != -100).sum()) for b in batches)
        return chunks, tokens

    def _all_reduce(self, values: list[float]) -> list[float]:
        import torch
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.tolist()

    # ----------------------------------------------------------------- one optimizer step
    def train_step(self, batches: list[dict]) -> dict:
        import torch

        t0 = time.perf_counter()
        chunks, tokens = self._all_reduce(list(self._counts(batches)))
        if chunks == 0 and self.data.kd is not None and self.cfg.loss.loss != "ce":
            from stage2_student.losses import NoValidChunksError

            # every rank sees the same all-reduced count, so every rank raises here together
            raise NoValidChunksError(
                f"optimizer step {self.step + 1}: no valid chunk in the whole accumulated batch on any rank, so "
                "the KD term would silently be zero: raise --seq-len, or check the cache with `xtcache inspect`")
        n_chunks, n_tokens = max(chunks, 1.0), max(tokens, 1.0)
        lr = self.engine.get_lr()[0]
        self.engine.train()
        sums = torch.zeros(7, dtype=torch.float64, device=self.device)
        for batch in batches:
            batch = _to_device(batch, self.device)
            terms = self._forward(batch, n_chunks, n_tokens, train=True)
            # the loss is already divided by the global counts: undo DeepSpeed's average over ranks
            self.engine.backward(terms["loss"] * self.world, scale_wrt_gas=False)
            self.engine.step()
            sums += torch.stack([terms["loss"].detach().double(), terms["kd_sum"].double(), terms["ce_sum"].double(),
                                 terms["agree"].double(), terms["agree_n"].double(), terms["valid_pos"].double(),
                                 terms["pred_pos"].double()])
        seq_tokens = float(sum(int(b["attention_mask"].sum()) for b in batches))
        loss, kd, ce, agree, agree_n, valid_pos, pred_pos, seq_tokens = self._all_reduce(sums.tolist() + [seq_tokens])
        self.step += 1
        dt = time.perf_counter() - t0
        grad_norm = self.engine.get_global_grad_norm()
        row = {"kind": "train", "step": self.step, "loss": loss, "ce": ce / n_tokens, "lr": lr,
               "grad_norm": None if grad_norm is None else float(grad_norm), "tokens": seq_tokens,
               "tokens_per_s": seq_tokens / dt, "step_s": dt, "chunks": chunks,
               "valid_share": valid_pos / pred_pos if pred_pos else None,
               "top1_agree": agree / agree_n if agree_n else None}
        if self.data.kd is not None and self.cfg.loss.loss != "ce":
            row["kd"] = kd / n_chunks
            row["kd_name"] = self.data.kd_name
        return row

    # ----------------------------------------------------------------- evaluation
    def evaluate(self) -> dict | None:
        """Held-out KD measure (sum over chunks / chunks) and CE; every rank runs the same forwards."""
        import torch

        if self.data.make_eval is None:
            return None
        self.engine.eval()
        sums = torch.zeros(6, dtype=torch.float64, device=self.device)
        it = iter(self.data.make_eval())
        last = None
        budget = self.cfg.eval.eval_batches or 10**12
        with torch.no_grad():
            for _ in range(budget):
                batch = next(it, None)
                if not self._all_reduce([float(batch is not None)])[0]:
                    break
                # a rank out of held-out batches repeats a forward at weight 0 (ZeRO-3 gathers in lockstep)
                last = batch if batch is not None else (last or _dummy_batch(self.tokenizer))
                use = _to_device(last, self.device)
                chunks, tokens = self._counts([use])
                terms = self._forward(use, 1.0, 1.0, train=False)
                if batch is not None:
                    sums += torch.tensor([float(terms["kd_sum"]), float(terms["ce_sum"]), chunks, tokens,
                                          float(terms["agree"]), float(terms["agree_n"])], dtype=torch.float64,
                                         device=self.device)
        kd, ce, chunks, tokens, agree, agree_n = self._all_reduce(sums.tolist())
        self.engine.train()
        row = {"kind": "eval", "step": self.step, "ce": ce / tokens if tokens else None,
               "kl": kd / chunks if (chunks and self.data.kd is not None) else None, "kd_name": self.data.kd_name,
               "top1_agree": agree / agree_n if agree_n else None, "chunks": chunks, "tokens": tokens}
        self._eval_history.append(row)
        return row

    # ----------------------------------------------------------------- checkpoints and export
    def save_checkpoint(self) -> Path:
        import torch
        import torch.distributed as dist

        root = self.out / CKPT_DIR
        tag = f"step{self.step}"
        if self.rank == 0:  # a tag written again (after a rollback) must not keep files of the old one
            for stale in (root / tag, root / f"{tag}_universal"):
                shutil.rmtree(stale, ignore_errors=True)
        dist.barrier()
        self.engine.save_checkpoint(str(root), tag=tag, client_state={"step": self.step, "world": self.world})
        state = {"step": self.step, "world": self.world, "loader": self.data.train.state_dict()}
        (root / tag / f"trainer_state_rank{self.rank}.json").write_text(json.dumps(state))
        rng = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state()
        torch.save(rng, root / tag / f"rng_rank{self.rank}.pt")
        if self.rank == 0:
            (root / tag / "train_config.json").write_text(self.cfg.to_json())
        dist.barrier()
        if self.rank == 0 and self.cfg.checkpoint.keep_checkpoints:
            tags = sorted((p for p in root.glob("step*") if p.is_dir() and p.name[4:].isdigit()),
                          key=lambda p: int(p.name[4:]))
            for old in tags[: -self.cfg.checkpoint.keep_checkpoints]:
                shutil.rmtree(old)
                shutil.rmtree(old.parent / f"{old.name}_universal", ignore_errors=True)
        log.info("saved checkpoint %s", root / tag)
        return root / tag

    def _checkpoint_dir(self, where: str) -> Path:
        if where != "latest":
            return Path(where)
        latest = self.out / CKPT_DIR / "latest"
        if not latest.exists():
            raise ConfigError(f"--resume latest: no checkpoint under {self.out / CKPT_DIR}; drop --resume to start fresh")
        return self.out / CKPT_DIR / latest.read_text().strip()

    def _resume_point(self, where: str) -> "ResumePoint":
        """The checkpoint `where` names, this rank's trainer state in it (rank 0's when the checkpoint
        had fewer ranks) and the loader state for this rank layout."""
        from stage2_student.loader import reshard_state

        ckpt = self._checkpoint_dir(where)
        for name in (f"trainer_state_rank{self.rank}.json", "trainer_state_rank0.json"):
            if (ckpt / name).exists():
                state = json.loads((ckpt / name).read_text())
                break
        else:
            raise ConfigError(f"--resume: {ckpt} is not an xtcache checkpoint (no trainer_state_rank0.json)")
        if state["world"] == self.world:
            return ResumePoint(ckpt, state, state["loader"], reshard=False)
        loader = reshard_state(state["loader"], rank=self.rank, world_size=self.world,
                               grad_accum=self.cfg.optim.grad_accum)
        return ResumePoint(ckpt, state, loader, reshard=True)

    def load_checkpoint(self) -> None:
        """Continue from the --resume checkpoint: bit-exact at the same world size. At another world
        size, ZeRO states go through DeepSpeed's universal checkpoint (converted once, next to the
        checkpoint; OUT must be on storage every node sees) and the data stream is re-cut for the
        new ranks: the global batch (ranks x grad-accum x micro-batch) must stay the same, so that
        every step sees the samples it would have seen."""
        import numpy as np
        import torch

        ckpt, state = self._resume.ckpt, self._resume.state
        tag = ckpt.name
        if self._resume.reshard:
            if self.ds_config["checkpoint"]["load_universal"]:
                tag = self._universal_checkpoint(ckpt)
            log.info("resuming a %d-rank checkpoint on %d ranks from %s", state["world"], self.world, tag)
        path, _ = self.engine.load_checkpoint(str(ckpt.parent), tag=tag)
        if path is None:
            raise ConfigError(f"--resume {ckpt}: DeepSpeed could not load {ckpt.parent / tag}")
        self.data.train.load_state_dict(self._resume.loader)
        rng_file = ckpt / f"rng_rank{self.rank}.pt"
        if not self._resume.reshard and rng_file.exists():
            rng = torch.load(rng_file, weights_only=True)
            torch.set_rng_state(rng["cpu"])
            if "cuda" in rng and torch.cuda.is_available():
                torch.cuda.set_rng_state(rng["cuda"])
        else:  # no saved stream for this rank layout: a fresh one, reproducible from (seed, step, rank)
            seed = np.random.SeedSequence([self.cfg.seed, state["step"], self.rank]).generate_state(1)[0]
            torch.manual_seed(int(seed))
            log.warning("random state re-seeded for the new rank layout (dropout masks differ from an "
                        "uninterrupted run)")
        self.step = state["step"]
        log.info("resumed from %s at step %d", ckpt, self.step)

    def _universal_checkpoint(self, ckpt: Path) -> str:
        """Tag of `ckpt` converted by `deepspeed.checkpoint.ds_to_universal`.

        Rank 0 converts (once; the result is kept next to the checkpoint) while the other ranks
        wait for the converted directory or rank 0's error file on the shared filesystem, not in a
        collective: a large model converts for longer than a collective's timeout.
        """
        import subprocess
        import sys

        target = ckpt.parent / f"{ckpt.name}_universal"
        error = ckpt.parent / f".{target.name}.error"
        if self.rank == 0 and not target.exists():
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

    def export_hf(self, directory: Path) -> Path:
        """A consolidated `save_pretrained` directory (all ranks call this; rank 0 writes)."""
        import torch.distributed as dist

        if self.zero3:
            state = self.engine._zero3_consolidated_16bit_state_dict()
        else:
            state = self.engine.module.state_dict() if self.rank == 0 else None
        if self.rank == 0:
            directory.mkdir(parents=True, exist_ok=True)
            self.engine.module.save_pretrained(str(directory), state_dict=state, safe_serialization=True)
            self.tokenizer.save_pretrained(str(directory))
            log.info("wrote Hugging Face model %s", directory)
        dist.barrier()
        return directory

    # ----------------------------------------------------------------- metrics
    def _log(self, row: dict) -> None:
        if self.rank != 0:
            return
        with open(self.metrics_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        if self._tb is not None:
            for key, value in row.items():
                if isinstance(value, (int, float)) and key != "step":
                    self._tb.add_scalar(f"{row['kind']}/{key}", value, row["step"])

    def _open_metrics(self) -> None:
        if self.rank != 0:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        kept = []
        if self.metrics_path.exists():  # a resumed run drops the lines after its checkpoint
            kept = [ln for ln in self.metrics_path.read_text().splitlines()
                    if ln.strip() and json.loads(ln)["step"] <= self.step]
        self.metrics_path.write_text("".join(ln + "\n" for ln in kept))
        try:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.out / "tensorboard"), purge_step=self.step + 1)
        except ImportError:
            log.info("tensorboard not installed: metrics go to %s only", self.metrics_path)

    # ----------------------------------------------------------------- the run
    def run(self) -> dict:
        cfg = self.cfg
        if self._resume is not None:
            self.load_checkpoint()
        self._open_metrics()
        it: Iterator[dict] = iter(self.data.train)
        bar = None
        if self.rank == 0:
            from tqdm import tqdm

            bar = tqdm(total=cfg.optim.max_steps, initial=self.step, desc="train-student", dynamic_ncols=True)
        if not cfg.checkpoint.resume:  # the starting point of the held-out curve
            ev = self.evaluate()
            if ev:
                self._log(ev)
        train_seconds, steps_done, tokens_done = 0.0, 0, 0.0
        last_saved = self.step if cfg.checkpoint.resume else -1
        try:
            while self.step < cfg.optim.max_steps:
                t0 = time.perf_counter()
                batches = [next(it) for _ in range(cfg.optim.grad_accum)]
                row = self.train_step(batches)
                train_seconds += time.perf_counter() - t0  # data + step, not evaluation or checkpoints
                steps_done += 1
                tokens_done += row["tokens"]
                self._log(row)
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{row['loss']:.4f}", lr=f"{row['lr']:.2e}")
                if cfg.eval.eval_every and self.step % cfg.eval.eval_every == 0 and self.step < cfg.optim.max_steps:
                    ev = self.evaluate()
                    if ev:
                        self._log(ev)
                if cfg.checkpoint.save_every and self.step % cfg.checkpoint.save_every == 0:
                    self.save_checkpoint()
                    last_saved = self.step
                if cfg.checkpoint.export_every and self.step % cfg.checkpoint.export_every == 0:
                    self.export_hf(self.out / f"hf-step{self.step}")
        finally:
            if bar is not None:
                bar.close()
        final_eval = self.evaluate()
        if final_eval:
            self._log(final_eval)
        if last_saved != self.step:
            self.save_checkpoint()
        hf_dir = self.export_hf(self.out / HF_DIR)
        summary = {
            "steps": self.step, "steps_run": steps_done, "world_size": self.world,
            "train_seconds": train_seconds,
            "steps_per_s": steps_done / train_seconds if train_seconds > 0 else None,
            "tokens_per_s": tokens_done / train_seconds if train_seconds > 0 else None,
            "initial_eval_kl": self._eval_history[0]["kl"] if self._eval_history else None,
            "final_eval_kl": final_eval["kl"] if final_eval else None,
            "final_eval_ce": final_eval["ce"] if final_eval else None,
            "final_eval_top1_agree": final_eval["top1_agree"] if final_eval else None,
            "first_eval": self._eval_history[0] if self._eval_history else None,
            "kd_loss": self.data.kd_name, "metrics": str(self.metrics_path.resolve()),
            "hf_dir": str(hf_dir.resolve()), "checkpoints": str((self.out / CKPT_DIR).resolve()),
            "data": self.data.info, "student_params": self.num_params,
            "student_params_local_at_load": self.params_local_at_load,
        }
        if self.rank == 0:
            (self.out / SUMMARY_FILE).write_text(json.dumps(summary, indent=2))
            if self._tb is not None:
                self._tb.close()
        return summary


def load_student(model_dir: str, ds_config: dict):
    """The student in fp32; under ZeRO-3 built inside deepspeed.zero.Init, so that each rank
    allocates only its partition, never the whole model."""
    import torch
    from transformers import AutoModelForCausalLM

    if ds_config["zero_optimization"]["stage"] != 3:
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    hf_zero3 = HfDeepSpeedConfig(ds_config)  # noqa: F841  (process-global while it lives)
    try:
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    finally:  # later from_pretrained/from_config calls in this process must not partition
        del hf_zero3
        unset_hf_deepspeed_config()


def count_parameters(model_dir: str) -> int:
    """Parameters of the student, counted on the meta device (no memory, no weights read)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    return sum(p.numel() for p in model.parameters())


def model_inputs(batch: dict) -> dict:
    """The student's forward arguments for a packed micro-batch.

    Each document packed into a window attends to itself only, as the teacher saw it: the
    position ids restart at 0 for every document (and for the padding after the last one), and
    with no 2D attention mask and no KV cache, transformers turns such position ids into a
    block-diagonal causal mask (sdpa, eager, flex) or variable-length flash attention.
    """
    if "position_ids" not in batch:
        return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    # use_cache=False: transformers only reads packed position ids when no KV cache is passed
    return {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"], "use_cache": False}


def _dummy_batch(tokenizer) -> dict:
    """Two pad tokens and no labels: the forward a rank without held-out data runs in lockstep."""
    import torch

    ids = torch.full((1, 2), tokenizer.pad_token_id or 0, dtype=torch.long)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.full_like(ids, -100),
            "num_chunks": 0}


def train(cfg: TrainConfig, make_data: Callable[[TrainConfig, Any, int, int], StageData] | None = None) -> dict:
    """Run stage 2 in this process (one rank of the job); tears the process group down at the end."""
    rank, _, world = setup_distributed()
    try:
        if rank != 0:
            logging.getLogger().setLevel(logging.WARNING)
        tokenizer = load_tokenizer(cfg.student)
        if make_data is None:
            make_data = open_stage_data
        data = make_data(cfg, tokenizer, rank, world)
        return Trainer(cfg, data, rank=rank, world=world).run()
    finally:
        teardown_distributed()


# --------------------------------------------------------------------------------------------
# from the cache to StageData: which KD loss, the projection map, the loaders


def resolve_loss(requested: str, *, identity: bool, mode: str) -> str:
    """The KD loss a run trains with (or, for --loss ce, the KD measure its evaluation reports).

    auto: pkl for cross-tokenizer caches (alm when they hold sampled targets: pkl needs
    log-probs), sampled for same-tokenizer sampled caches, kl for other same-tokenizer caches.
    """
    if requested in ("auto", "ce"):
        if identity:
            return "sampled" if mode == "sampled" else "kl"
        return "alm" if mode == "sampled" else "pkl"
    if requested in ("kl", "rkl", "jsd") and (not identity or mode == "sampled"):
        why = "the cache is cross-tokenizer: use --loss pkl or alm" if not identity else \
            "the cache holds sampled targets: use --loss sampled"
        raise ConfigError(f"--loss {requested}: {why}")
    if requested == "sampled" and (mode != "sampled" or not identity):
        raise ConfigError(f"--loss sampled needs a same-tokenizer cache of sampled targets (this one: mode {mode!r}, "
                          f"{'same' if identity else 'cross'}-tokenizer)")
    if requested == "pkl" and (identity or mode == "sampled"):
        why = "the student shares the teacher's tokenizer: use --loss kl" if identity else \
            "the cache holds sampled targets without log-probs: use --loss alm"
        raise ConfigError(f"--loss pkl: {why}")
    return requested


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


def make_kd(name: str, cfg: TrainConfig, projection) -> Callable:
    """(logits [B, L, V], batch) -> sum of the KD loss `name` over the batch's valid chunks."""
    from stage2_student import losses

    return losses.make_kd_loss(name, temperature=cfg.loss.temperature, jsd_beta=cfg.loss.jsd_beta,
                               alm_tau=cfg.loss.alm_tau, projection=projection)


def open_stage_data(cfg: TrainConfig, tokenizer, rank: int, world: int) -> StageData:
    """Open the cache (and the held-out set), pick the KD loss, load W, build this rank's loaders."""
    import deepspeed
    from transformers import AutoConfig

    from stage2_student import losses
    from stage2_student.loader import make_loaders
    from xtcache.fingerprint import tokenizer_fingerprint
    from xtcache.store import CacheReader

    manifest = CacheReader(cfg.cache, storage_options=cfg.storage_options_dict).manifest
    student_fp = tokenizer_fingerprint(tokenizer)
    # the loader refuses a student tokenizer the cache has no alignment for, with what to run
    train, make_eval = make_loaders(cfg, tokenizer, rank, world)
    identity = student_fp == manifest.fingerprints.get("teacher_tokenizer")
    name = resolve_loss(cfg.loss.loss, identity=identity, mode=manifest.mode)
    projection = top1_map = None
    device = deepspeed.get_accelerator().current_device_name()
    if name == "pkl":
        model_vocab = AutoConfig.from_pretrained(cfg.student).vocab_size
        w = load_projection(cfg, manifest, tokenizer, student_fp, model_vocab)
        projection = losses.ProjectionOperator(w).to(device)
        top1_map = projection.student_top
    info = {"cache": cfg.cache, "mode": manifest.mode, "k": manifest.k, "same_tokenizer": identity,
            "teacher_vocab": manifest.teacher_vocab_size, "student_fingerprint": student_fp, "kd_loss": name,
            "trained_on": "ce" if cfg.loss.loss == "ce" else name}
    log.info("cache %s: mode %s k=%d, %s-tokenizer, KD loss %s%s", cfg.cache, manifest.mode, manifest.k,
             "same" if identity else "cross", name, " (evaluation only; training on CE)" if cfg.loss.loss == "ce" else "")
    kd_fn = make_kd(name, cfg, projection)
    if not identity and name == "alm":
        log.warning("top-1 agreement is not measured: alm on a cross-tokenizer cache has no projection map")
    return StageData(train=train, make_eval=make_eval, kd=kd_fn, kd_name=name, teacher_top1_of_student=top1_map,
                     measure_agreement=identity or projection is not None, info=info)
