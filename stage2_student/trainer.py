"""The stage 2 student trainer: DeepSpeed ZeRO 1/2/3 over micro-batches streamed from a teacher cache.

    xtcache train-student --cache STORE --student DIR --out RUN                  # one process
    torchrun --standalone --nproc_per_node 2 -m stage2_student --cache ... --out RUN
    deepspeed --num_gpus 8 --module stage2_student --cache ... --out RUN

The same code runs on CPU (gloo) and GPU (nccl): DeepSpeed picks its accelerator and backend.
One optimizer step takes `--grad-accum` micro-batches on every rank. The loss is the
`Objective`'s (stage2_student/objective.py); the trainer all-reduces its normalisation counts
once before the step's first forward, so world 1 x grad-accum 2 and world 2 x grad-accum 1 train
the same model. The rest lives beside it: data.py (cache, loaders, objective), checkpoint.py
(save/resume), evaluation.py (held-out metrics), export.py (Hugging Face directory),
student.py (process group, model). Outputs under --out: `metrics.jsonl` (one line per step and
per evaluation), `tensorboard/` (when installed), `checkpoints/stepN/`, `hf/`, `summary.json`.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Callable

from stage2_student import checkpoint
from stage2_student.checkpoint import HF_DIR, SUMMARY_FILE
from stage2_student.config import TrainConfig, deepspeed_config, lr_lambda
from stage2_student.data import CheckedStores, StageData, open_stage_data
from stage2_student.evaluation import evaluate
from stage2_student.export import export_hf
from stage2_student.losses import NoValidChunksError
from stage2_student.onpolicy import staleness
from stage2_student.rollout_mix import CORPUS_OBJECTIVE_KEY
from stage2_student.student import (  # noqa: F401
    count_parameters,
    load_student,
    load_tokenizer,
    model_inputs,
    set_deterministic,
    setup_distributed,
    teardown_distributed,
    to_device,
)
from xtcache.errors import ConfigError

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"


class Trainer:
    """One training run: engine, data, objective, metrics. Construct inside a process group."""

    def __init__(self, cfg: TrainConfig, data: StageData, *, rank: int, world: int):
        import deepspeed
        import torch

        self.cfg, self.data, self.rank, self.world = cfg, data, rank, world
        self.out, self.step, self._tb = Path(cfg.out), 0, None
        torch.manual_seed(cfg.seed)
        self.tokenizer = data.tokenizer
        self.num_params = count_parameters(cfg.student)
        self.ds_config = deepspeed_config(cfg, self.num_params)
        # read (and a layout the data stream cannot follow refused) before any expensive work
        self.resume = None
        if cfg.checkpoint.resume or cfg.checkpoint.init_from:
            self.resume = checkpoint.resume_point(self.out, cfg.checkpoint.resume or cfg.checkpoint.init_from,
                                                  rank=rank, world=world, grad_accum=cfg.optim.grad_accum,
                                                  fresh_data=not cfg.checkpoint.resume)
            # only ZeRO-1/2/3 states are partitioned by world size; see checkpoint.load
            universal = self.resume.reshard and self.ds_config["zero_optimization"]["stage"] > 0
            self.ds_config.setdefault("checkpoint", {})["load_universal"] = universal
        model = load_student(cfg.student, self.ds_config)
        model.config.use_cache = False
        attn = str(getattr(model.config, "_attn_implementation", ""))
        if attn.startswith("flash") and cfg.loader.micro_batch_size > 1:
            # transformers infers packed documents from position ids for flash attention only at batch size 1
            raise ConfigError(f"the student uses {attn}, which keeps packed documents apart only with "
                              "--micro-batch-size 1; use it (and raise --grad-accum), or attn_implementation sdpa")
        self.params_local_at_load = sum(int(getattr(p, "ds_tensor", p).numel()) for p in model.parameters())
        scheduler = None
        if "scheduler" not in self.ds_config:
            scheduler = lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))  # noqa: E731
        else:
            log.warning("using the scheduler of %s, not --warmup-steps/--max-steps cosine", cfg.deepspeed.deepspeed)
        self.engine, _, _, _ = deepspeed.initialize(
            model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
            config=self.ds_config, lr_scheduler=scheduler)
        self.device = self.engine.device
        for measure in (data.objective, data.corpus_objective, *data.measures, data.mixture_measure):  # the Ws
            if measure is not None:
                measure.to(self.device)
        self.metrics_path = self.out / METRICS_FILE
        log.info("train-student: %d rank(s) on %s, ZeRO-%d, %s, deterministic algorithms %s", world, self.device,
                 self.ds_config["zero_optimization"]["stage"], "bf16" if cfg.deepspeed.bf16 else "fp32",
                 "on" if cfg.deterministic else "off (--deterministic for bit-identical resume on GPU)")

    def all_reduce(self, values: list[float]) -> list[float]:
        import torch
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.tolist()

    def train_step(self, batches: list[dict]) -> dict:
        """One optimizer step over this rank's micro-batches (CPU batches, as the loader yields them)."""
        import torch

        t0 = time.perf_counter()
        obj = self.data.objective
        local = [obj.counts(b) for b in batches]
        side = [1 if b.get(CORPUS_OBJECTIVE_KEY) else 0 for b in batches]  # the run's objective (0) or the corpus's
        trains_kd = [self.objective_of(b).kind is not None for b in batches]  # not a CE-only objective's
        own_chunks, corpus_chunks, kd_chunks, tokens, kd_batches = self.all_reduce([
            float(sum(c for (c, _), k in zip(local, side) if k == 0)),
            float(sum(c for (c, _), k in zip(local, side) if k == 1)),
            float(sum(c for (c, _), kd in zip(local, trains_kd) if kd)),  # the normaliser of every KD term
            float(sum(t for _, t in local)), float(sum(trains_kd))])
        chunks = own_chunks + corpus_chunks
        if kd_chunks == 0 and kd_batches:
            # every rank sees the same all-reduced count, so every rank raises here together
            raise NoValidChunksError(
                f"optimizer step {self.step + 1}: no valid chunk in the whole accumulated batch on any rank, so "
                "the KD term would silently be zero: raise --seq-len, or check the cache with `xtcache inspect`")
        lr = self.engine.get_lr()[0]
        self.engine.train()
        n = obj.num_teachers
        sums = torch.zeros(5 + 5 * n + 4, dtype=torch.float64, device=self.device)
        kd_by_side = torch.zeros(2, dtype=torch.float64, device=self.device)  # KD sums: the run's, the corpus's
        valid_pos = 0
        for batch, k in zip(batches, side):
            row, n_valid = self.micro_step(batch, kd_chunks, tokens)
            sums += row
            kd_by_side[k] += row[1]
            valid_pos += n_valid
        seq_tokens = float(sum(int(b["attention_mask"].sum()) for b in batches))
        reduced = self.all_reduce(torch.cat([sums, kd_by_side]).tolist()  # the step's one device read
                                  + [float(valid_pos), seq_tokens])
        loss, _, ce, agree, agree_n = reduced[:5]
        own_kd, corpus_kd, valid_pos, seq_tokens = reduced[-4:]
        per = [reduced[5 + j * n:5 + (j + 1) * n] for j in range(5)]
        stale_abs, stale_over, stale_read, sampled = reduced[5 + 5 * n:9 + 5 * n]
        self.step += 1
        dt = time.perf_counter() - t0
        grad_norm = self.engine.get_global_grad_norm()
        row = {"kind": "train", "step": self.step, "loss": loss, "ce": ce / max(tokens, 1.0), "lr": lr,
               "grad_norm": None if grad_norm is None else float(grad_norm), "tokens": seq_tokens,
               "tokens_per_s": seq_tokens / dt, "step_s": dt, "chunks": chunks,
               "valid_share": valid_pos / tokens if tokens else None,
               "top1_agree": agree / agree_n if agree_n else None}
        if obj.kind is not None:  # the run's objective over its chunks (a step of --corpus-loss ce's alone: none)
            row["kd"], row["kd_name"] = own_kd / own_chunks if own_chunks else None, obj.kind
        corpus = self.data.corpus_objective
        if corpus is not None and corpus.kind is not None:  # --corpus-loss auto: the corpus objective's, apart
            row["corpus_kd"] = corpus_kd / corpus_chunks if corpus_chunks else None
            row["corpus_kd_name"] = corpus.kind
        if sampled:  # rollouts: how stale the samples are for the student at this step (onpolicy.staleness)
            row.update(sampled_labels=sampled, stale_mean_abs_log_ratio=stale_abs / stale_read,
                       stale_share_over_cap=stale_over / stale_read)
        if n > 1:  # per teacher: its KD term over the chunk groups it is in, its weight share, its agreement
            row["top1_agree"] = None
            share = "chosen_share" if obj.combine == "select" else "weight_share"
            for i in range(n):
                t_kd, t_groups, t_w, t_agree, t_agree_n = (p[i] for p in per)
                row[f"teacher{i}_kd"] = t_kd / t_groups if (t_groups and obj.kind is not None) else None
                row[f"teacher{i}_{share}"] = t_w / chunks if chunks else None
                row[f"teacher{i}_top1_agree"] = t_agree / t_agree_n if t_agree_n else None
        return row

    def objective_of(self, batch: dict):
        """The objective a micro-batch trains: the corpus objective where the mixed stream marked it (--corpus-loss
        ce or auto), else the run's."""
        return self.data.corpus_objective if batch.get(CORPUS_OBJECTIVE_KEY) else self.data.objective

    def micro_step(self, batch: dict, chunks: float, tokens: float) -> tuple:
        """Forward, loss and backward of one CPU micro-batch, moved to the device here (the batch for
        the model, the objective's plan for the loss); returns (its metric sums on the device [5 + 5N + 4],
        its valid positions). Reads nothing back from the device."""
        import torch

        obj = self.objective_of(batch)
        logits = self.engine(**model_inputs(to_device(batch, self.device))).logits
        prep = obj.prepare(batch, vocab=logits.shape[-1]).to(self.device)  # host work while the GPU runs
        loss, m = obj(logits, prep, chunks_total=chunks, tokens_total=tokens)
        # the loss is already divided by the global counts: undo DeepSpeed's average over ranks
        self.engine.backward(loss * self.world, scale_wrt_gas=False)
        self.engine.step()
        row = torch.cat([torch.stack([loss.detach().double(), m["kd_sum"].double(), m["ce_sum"].double(),
                                      m["agree"].double(), m["agree_n"].double()])]
                        + [m[k].double() for k in ("teacher_kd", "teacher_groups", "teacher_weight",
                                                   "teacher_agree", "teacher_agree_n")]
                        + [staleness(logits, batch, obj.staleness_cap)])
        return row, prep.valid_pos

    def log(self, row: dict) -> None:
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

    def _evaluate(self, history: list[dict]) -> dict | None:
        row = evaluate(self)
        if row:
            history.append(row)
            self.log(row)
        return row

    def run(self) -> dict:
        cfg = self.cfg
        if self.resume is not None:
            self.step = checkpoint.load(self, self.resume)
        self._open_metrics()
        it = iter(self.data.train)
        bar = None
        if self.rank == 0:
            from tqdm import tqdm

            bar = tqdm(total=cfg.optim.max_steps, initial=self.step, desc="train-student", dynamic_ncols=True)
        evals: list[dict] = []
        if not cfg.checkpoint.resume:  # the starting point of the held-out curve
            self._evaluate(evals)
        train_seconds, steps_done, tokens_done = 0.0, 0, 0.0
        last_saved = self.step if cfg.checkpoint.resume else -1
        try:
            while self.step < cfg.optim.max_steps:
                t0 = time.perf_counter()
                row = self.train_step([next(it) for _ in range(cfg.optim.grad_accum)])
                train_seconds += time.perf_counter() - t0  # data + step, not evaluation or checkpoints
                steps_done, tokens_done = steps_done + 1, tokens_done + row["tokens"]
                self.log(row)
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{row['loss']:.4f}", lr=f"{row['lr']:.2e}")
                if cfg.eval.eval_every and self.step % cfg.eval.eval_every == 0 and self.step < cfg.optim.max_steps:
                    self._evaluate(evals)
                if cfg.checkpoint.save_every and self.step % cfg.checkpoint.save_every == 0:
                    checkpoint.save(self)
                    last_saved = self.step
                if cfg.checkpoint.export_every and self.step % cfg.checkpoint.export_every == 0:
                    export_hf(self, self.out / f"hf-step{self.step}")
        finally:
            if bar is not None:
                bar.close()
        final = self._evaluate(evals)
        if last_saved != self.step:
            checkpoint.save(self)
        hf_dir = export_hf(self, self.out / HF_DIR)
        summary = self._summary(evals, final, steps_done, train_seconds, tokens_done, hf_dir)
        if self.rank == 0:
            (self.out / SUMMARY_FILE).write_text(json.dumps(summary, indent=2))
            if self._tb is not None:
                self._tb.close()
        return summary

    def _summary(self, evals, final, steps_done, train_seconds, tokens_done, hf_dir) -> dict:
        per_s = (lambda n: n / train_seconds if train_seconds > 0 else None)  # noqa: E731
        return {
            "steps": self.step, "steps_run": steps_done, "world_size": self.world, "train_seconds": train_seconds,
            "deterministic": self.cfg.deterministic,
            "steps_per_s": per_s(steps_done), "tokens_per_s": per_s(tokens_done),
            "initial_eval_kl": evals[0]["kl"] if evals else None,
            "final_eval_kl": final["kl"] if final else None, "eval_kl_definition": self.data.measure_definition,
            "final_eval_objective_kd": final["objective_kd"] if final else None,
            "final_eval_ce": final["ce"] if final else None,
            "final_eval_top1_agree": final["top1_agree"] if final else None,
            "first_eval": evals[0] if evals else None,
            "kd_loss": self.data.objective.kind, "objective": self.data.objective.describe(),
            "corpus_objective": None if self.data.corpus_objective is None else self.data.corpus_objective.describe(),
            "metrics": str(self.metrics_path.resolve()),
            "teachers": self._teacher_summary(evals, final),
            "hf_dir": str(hf_dir.resolve()), "checkpoints": str((self.out / checkpoint.CKPT_DIR).resolve()),
            "data": self.data.info, "student_params": self.num_params, **peak_memory(),
            "student_params_local_at_load": self.params_local_at_load,
        }


    def _teacher_summary(self, evals, final) -> list[dict] | None:
        """Several teachers: each one's cache, weight, last train metrics and held-out KL (first and final)."""
        obj = self.data.objective
        if obj.num_teachers == 1:
            return None
        rows = [json.loads(ln) for ln in self.metrics_path.read_text().splitlines()] if self.rank == 0 else []
        train = [r for r in rows if r.get("kind") == "train"]
        out = []
        for i, t in enumerate(self.data.info.get("teachers", [])):
            item = dict(t)
            for key in ("kd", "weight_share", "chosen_share", "top1_agree"):
                vals = [r[f"teacher{i}_{key}"] for r in train[-10:] if r.get(f"teacher{i}_{key}") is not None]
                if vals:
                    item[f"train_{key}_last10"] = sum(vals) / len(vals)
            item["initial_eval_kl"] = evals[0].get(f"teacher{i}_kl") if evals else None
            item["final_eval_kl"] = final.get(f"teacher{i}_kl") if final else None
            out.append(item)
        if final:
            out.append({"mixture": True, "initial_eval_kl": evals[0].get("mixture_kl") if evals else None,
                        "final_eval_kl": final.get("mixture_kl")})
        return out


def peak_memory() -> dict:
    """This process's peak memory: device memory allocated by torch on CUDA, else resident host memory."""
    import resource

    import torch

    if torch.cuda.is_initialized():
        return {"peak_memory_mib": torch.cuda.max_memory_allocated() / 2**20, "peak_memory_kind": "CUDA allocated"}
    return {"peak_memory_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "peak_memory_kind": "host resident"}


def train(cfg: TrainConfig, make_data: Callable[[TrainConfig, object, int, int], StageData] | None = None,
          checked: CheckedStores | None = None) -> dict:
    """Run stage 2 in this process (one rank of the job); tears the process group down at the end. `checked`:
    what `data.check_stores` returned where the caller checked the stores already (stage2_student.cli, before
    DeepSpeed starts): its --student tokenizer is used and `open_stage_data` does not check them again."""
    set_deterministic(cfg.deterministic)  # before CUDA starts (setup_distributed picks the device)
    rank, _, world = setup_distributed()
    try:
        if rank != 0:
            logging.getLogger().setLevel(logging.WARNING)
        # a check of another config: load the tokenizer anew (open_stage_data then checks the stores again)
        reuse = checked is not None and checked.covers(cfg, checked.tokenizer)
        tokenizer = checked.tokenizer if reuse else load_tokenizer(cfg.student)
        data = (make_data(cfg, tokenizer, rank, world) if make_data
                else open_stage_data(cfg, tokenizer, rank, world, checked=checked))
        return Trainer(cfg, data, rank=rank, world=world).run()
    finally:
        teardown_distributed()
