"""Does a cached teacher train a student as well as the teacher in the loop? Quality against bytes.

    python bench/quality.py                          # the full table (docs/benchmarks.md), about 15 min on 2 CPU cores
    python bench/quality.py --quick                  # a smoke run: few documents and steps, one seed
    python bench/quality.py --section on-policy      # only the on-policy rows (bench/quality_onpolicy.py), ~28 min
    python bench/quality.py --section on-policy-converged  # rounds vs continued KD from a converged student, ~75 min
    python bench/quality.py --teacher real           # the real tier's rows (bench/quality_real.py), about 1 h
    python bench/quality.py --teacher real --section modes  # one tokenizer, a row per store mode, about 1 h

Every row trains the same student for the same steps, on the same windows in the same order,
with the same optimizer (AdamW, warmup + cosine), through the product's own trainer: what
`xtcache train-student` runs (`stage2_student.trainer`: `open_stage_data`, `Trainer`, DeepSpeed
ZeRO-2 on one rank, the product's loader and `Objective`), in this process, one row after the
other in one process group (no subprocess start per row). A row differs from the others only in
what fills the teacher side of each batch:

| row | teacher side of a batch |
| --- | --- |
| CE only | nothing (`--loss ce`) |
| online full KD | a live transformers forward of the teacher on the batch's windows, full vocabulary (the reference) |
| cached full / top-k + rest / sampled / head + tail | the store written by stage 1 (`run_teacher_dump`, engine hf) with that `--mode` (head K + tail N: `--mode headtail --top-k K --num-samples N`, trained with `--loss auto`, i.e. `sampled`) |
| cached top-64 + rest, format 2 (codec v1) | the top-64 store written as format version 2 (8-bit log-probs, float32 residual): codec v1 beside v2 in one run |
| cached top-k renormalised | the top-64 store, teacher and student both renormalised over the k ids, no rest bucket (how axolotl and Atropos use top-k; a comparison row, not an xtcache loss) |
| cross-tokenizer rows | a student with its own tokenizer on the top-64 store (P-KL, ALM, CE only) and on the sampled n=64 store (P-KL over the sampled targets, the `auto` loss of a sampled cross-tokenizer cache, and ALM) |

How the identical loop is kept: every row gets its `StageData` from the product's
`open_stage_data` on its store (the hook `trainer.train(cfg, make_data)` also takes). The online row reads the top-8 store only for its windows (the
packing depends on the student tokens, which are the same in every same-tokenizer store, checked
below) and `LiveTeacher` replaces the teacher arrays of each micro-batch by the teacher's
log-probs over all its tokenizer's ids, exactly the arrays a full-vocabulary store holds (the
lm_head's padding columns go to the residual), unquantized. The renormalised row swaps the
objective for `RenormalisedTopK`, the product's objective fed renormalised targets. Nothing else changes. One difference is inherent: the
packer splits documents across windows, and the student reads each piece without the text before
it; the teacher in the loop reads what the student reads, while the cache's teacher read whole
documents (windows of 512 tokens), so pieces after a split get targets with more context from a
cache than online (tests/test_cache_equivalence.py checks the equivalence where contexts match).

Columns:
- bytes/position: stored bytes of the row's training store over its teacher positions.
- held-out KL: same-tokenizer rows: KL(teacher || student) per predicted token over the
  teacher tokenizer's full vocabulary (padding columns dropped, renormalised), the teacher's
  log-probs from a live forward of the teacher itself on held-out documents. Cross-tokenizer
  rows: chunk-level projected KL (the P-KL measure: student distributions projected onto the
  teacher vocabulary through W, chunk averages, every teacher id) against a full-vocabulary
  store of the held-out documents (8-bit log-probs, max abs error 0.047). The two are different
  measures and are not compared with each other.
- held-out CE: the student's next-token cross-entropy on its own tokens of the held-out documents.
- share of online gain: (KL(CE only) - KL(row)) / (KL(CE only) - KL(online full KD)), same seed.
- gradient cosine: cosine between the gradient (all student parameters) of the row's objective and
  that of online full KD (kl x 1.0 + CE x 0.1) on fixed batches (the first held-out micro-batches),
  at the initial student and at the row's final student. Cross-tokenizer rows: against P-KL x 1.0 +
  CE x 0.1 on the full-vocabulary held-out store.

The key rows (CE only, online full KD, cached full, cached top-64 on codec v2 and v1, head 2 + tail 16,
head 4 + tail 12, head 4 + tail 16) run on 3 seeds (seed s: the
student initialised with seed 1 + s and data order s); the table gives mean +- standard
deviation and says which differences are within that spread. Writes `quality.md`, `quality.json`
and `quality.png` (held-out KL against bytes/position) under --out; `--write-docs` also writes
quality.md into docs/benchmarks.md's `quality-table` block, stamped with the command (xtcache.app.docblock).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import shutil
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
DOC_BLOCKS = {"quality-table": "docs/benchmarks.md", "quality-on-policy": "docs/on-policy.md",
              "quality-on-policy-converged": "docs/on-policy.md",
              "quality-on-policy-converged-stronger": "docs/on-policy.md",
              "quality-on-policy-converged-real": "docs/on-policy.md",
              "quality-on-policy-converged-same": "docs/on-policy.md", "quality-real": "docs/losses.md",
              "quality-real-modes": "docs/losses.md", "quality-real-cross": "README.md",
              "quality-real-cross-qwen3": "docs/losses.md"}  # --write-docs: block -> file

log = logging.getLogger("bench.quality")

KD_WEIGHT, CE_WEIGHT = 1.0, 0.1  # every KD row trains on KD x 1.0 + CE x 0.1 (NeMo-RL's defaults)


@dataclass(frozen=True)
class Row:
    name: str
    store: str | None  # key of the training store; None: no store (online reads the top-8 one for its windows)
    loss: str  # ce | kl | sampled | renorm | pkl | alm | online
    cross: bool = False
    key: bool = False  # run on every seed


ROWS = [
    Row("CE only", "top8", "ce", key=True),
    Row("online full KD (reference)", None, "online", key=True),
    Row("cached full", "full", "kl", key=True),
    Row("cached top-8 + rest", "top8", "kl"),
    Row("cached top-64 + rest", "top64", "kl", key=True),
    Row("cached top-256 + rest", "top256", "kl"),
    Row("cached top-64 renormalised (no rest)", "top64", "renorm"),
    Row("cached sampled n=16", "sampled16", "sampled"),
    Row("cached sampled n=64", "sampled64", "sampled"),
    Row("cached head 2 + tail 16", "ht2x16", "sampled", key=True),
    Row("cached head 2 + tail 24", "ht2x24", "sampled"),
    Row("cached head 4 + tail 12", "ht4x12", "sampled", key=True),
    Row("cached head 4 + tail 16", "ht4x16", "sampled", key=True),
    Row("cached head 8 + tail 16", "ht8x16", "sampled"),
    Row("cached top-64 + rest, format 2 (codec v1)", "top64v1", "kl", key=True),
    Row("cross-tok: P-KL top-64", "top64", "pkl", cross=True),
    Row("cross-tok: ALM (top-64 store)", "top64", "alm", cross=True),
    Row("cross-tok: P-KL sampled n=64", "sampled64", "pkl", cross=True),
    Row("cross-tok: ALM (sampled n=64 store)", "sampled64", "alm", cross=True),
    Row("cross-tok: P-KL head 8 + tail 16", "ht8x16", "pkl", cross=True),
    Row("cross-tok: CE only", "top64", "ce", cross=True),
]

STORES = {"full": dict(mode="full"), "top8": dict(mode="topk", top_k=8), "top64": dict(mode="topk", top_k=64),
          "top256": dict(mode="topk", top_k=256), "sampled16": dict(mode="sampled", num_samples=16),
          "sampled64": dict(mode="sampled", num_samples=64),
          **{f"ht{h}x{n}": dict(mode="headtail", top_k=h, num_samples=n) for h, n in ((2, 16), (2, 24), (4, 12), (4, 16), (8, 16))},
          "top64v1": dict(mode="topk", top_k=64, format_version=2)}  # format_version: a bench-only knob (dump)


@dataclass(frozen=True)
class Settings:
    steps: int = 120
    seq_len: int = 128
    micro_batch_size: int = 8
    lr: float = 3e-3
    warmup_steps: int = 10
    train_docs: int = 120
    heldout_docs: int = 40
    eval_batches: int = 5
    probe_batches: int = 2
    seeds: int = 3


QUICK = Settings(steps=6, warmup_steps=2, train_docs=24, heldout_docs=8, eval_batches=1, probe_batches=1, seeds=1)


# --------------------------------------------------------------------------------------------
# the one place the bench builds the product's objective


def chunk_rows(batch: dict):
    """Flat logit position of each teacher row of a same-tokenizer batch (chunk c has one logit)."""
    import torch

    sc = batch["student_chunk"].reshape(-1)
    pos = torch.nonzero(sc >= 0).squeeze(1)
    at = torch.empty_like(pos)
    at[sc[pos]] = pos
    return at[batch["teacher_chunk"]]


def make_objective(loss: str, projection=None):
    """The product's `Objective` of a row (what its training minimises: KD x 1.0 + CE x 0.1, or CE only)."""
    from stage2_student.objective import Objective

    if loss == "renorm":
        return _renormalised_topk()(kd_weight=KD_WEIGHT, ce_weight=CE_WEIGHT)
    if loss == "ce":
        return Objective(None, ce_weight=1.0)
    return Objective({"online": "kl"}.get(loss, loss), kd_weight=KD_WEIGHT, ce_weight=CE_WEIGHT, projection=projection)


def _renormalised_topk():
    """The comparison row's objective class (the peers' top-k loss, not an xtcache loss), built on the product's.

    KL(p_K || q_K), teacher and student both renormalised over the k stored ids, no rest bucket:
    the product's KL objective with the teacher's residual set to 0 (its support alone, renormalised)
    and, for the KD term only, the student's logits outside the k ids lowered by 1e4 (their
    probability is then exactly 0 in fp32, so its softmax is its renormalisation over the k ids).
    CE and top-1 agreement read the unchanged logits.
    """
    import torch

    from stage2_student.objective import Objective

    class RenormalisedTopK(Objective):
        def __init__(self, **kw):
            super().__init__("kl", **kw)
            self.kind = "renorm"  # its own name in the metrics; the evaluation then measures KL apart

        def prepare(self, batch, *, vocab, ratio=True):
            zero = {"teacher_residual": torch.zeros_like(batch["teacher_residual"])}
            prep = super().prepare({**batch, **zero}, vocab=vocab, ratio=ratio)
            prep.teacher["renorm_at"] = chunk_rows(batch)  # travels to the device with the teacher arrays
            return prep

        def terms(self, logits, prep):
            flat = logits.reshape(-1, logits.shape[-1])
            ids, at = prep.teacher["teacher_ids"], prep.teacher["renorm_at"]
            valid = ids >= 0
            low = torch.full_like(flat, -1e4)
            low[at[:, None].expand_as(ids)[valid], ids[valid]] = 0.0
            kd, _ = super().terms(flat + low, prep)
            _, ce = super().terms(flat, prep)
            return kd, ce

    return RenormalisedTopK


# --------------------------------------------------------------------------------------------
# the teacher in the loop


class LiveTeacher:
    """Fills a same-tokenizer micro-batch's teacher arrays from a transformers forward of the teacher.

    The arrays are those of a full-vocabulary store, unquantized: every id of the teacher's
    tokenizer with its T=1 log-prob; the lm_head's padding columns (beyond the tokenizer) make up
    the residual. `renormalise=True` drops them instead (residual 0): the held-out KL's target.
    """

    def __init__(self, model_dir: str | Path, vocab: int):
        import torch
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        self.vocab = vocab

    def fill(self, batch: dict, *, renormalise: bool = False) -> dict:
        import torch

        from stage2_student.student import model_inputs

        with torch.no_grad():
            logp = torch.log_softmax(self.model(**model_inputs(batch)).logits.float(), dim=-1)
        logp = logp.reshape(-1, logp.shape[-1])
        rows = chunk_rows(batch)  # [R]
        lp = logp[rows]  # [R, V_head]
        out = dict(batch)
        out["teacher_ids"] = torch.arange(self.vocab).expand(rows.numel(), self.vocab)
        out["teacher_logprobs"] = lp[:, :self.vocab].contiguous()
        pad = torch.logsumexp(lp[:, self.vocab:], dim=-1).exp() if lp.shape[1] > self.vocab else torch.zeros(len(rows))
        out["teacher_residual"] = torch.zeros_like(pad) if renormalise else pad
        labels = batch["labels"].reshape(-1)[rows]
        out["teacher_realized"] = lp.gather(1, labels.clamp(min=0)[:, None])[:, 0]
        return out


class LiveStream:
    """The product's training stream with each micro-batch's teacher side from `LiveTeacher`."""

    def __init__(self, stream, teacher: LiveTeacher):
        self.stream, self.teacher = stream, teacher

    def __iter__(self):
        for batch in self.stream:
            yield self.teacher.fill(batch)

    def __len__(self):
        return len(self.stream)

    def state_dict(self):
        return self.stream.state_dict()

    def load_state_dict(self, state):
        self.stream.load_state_dict(state)


# --------------------------------------------------------------------------------------------
# stores, students, training


def first_docs(src: Path, dst: Path, n: int) -> Path:
    lines = src.read_text(encoding="utf-8").splitlines(keepends=True)
    if len(lines) < n:
        raise SystemExit(f"{src} has {len(lines)} documents, fewer than the {n} asked for")
    dst.parent.mkdir(parents=True, exist_ok=True)
    if not dst.exists() or dst.read_text(encoding="utf-8") != "".join(lines[:n]):
        dst.write_text("".join(lines[:n]), encoding="utf-8")
    return dst


def dump(teacher: Path, students: list[Path], data: Path, out: Path, spec: dict) -> dict:
    """A store written by stage 1 itself (transformers engine, float32); reused when complete."""
    from stage1_teacher.config import CaptureConfig, InputConfig, StoreConfig, TeacherConfig, TeacherDumpConfig
    from stage1_teacher.dump import run_teacher_dump
    from xtcache.errors import StoreError
    from xtcache.store import CacheReader

    try:
        complete = CacheReader(str(out)).is_complete()
    except StoreError:
        complete = False
    if not complete:
        shutil.rmtree(out, ignore_errors=True)
        spec = dict(spec)
        version = spec.pop("format_version", None)
        cfg = TeacherDumpConfig(
            student_tokenizer=[str(s) for s in students], input=InputConfig(data=[str(data)]),
            teacher=TeacherConfig(teacher=str(teacher), engine="hf", dtype="float32"),
            capture=CaptureConfig(max_seq_len=512, **spec), store=StoreConfig(out=str(out), docs_per_part=64))
        with _format_version(version):
            run_teacher_dump(cfg, progress=False)
    reader = CacheReader(str(out))
    positions = sum(int(n) for s in reader.shards for n in [reader.doc_pos_offsets(s.shard_id)[-1]])
    return {"path": str(out), "bytes": reader.total_bytes(), "positions": positions,
            "bytes_per_position": reader.total_bytes() / positions}


@contextlib.contextmanager
def _format_version(version: int | None):
    """Stage 1 writes an older store format version (codec v1) while this is open: the bench's own knob,
    no user flag (the writer still reads and writes every version in READ_VERSIONS)."""
    if version is None:
        yield
        return
    from stage1_teacher import dump as dump_module

    made = dump_module.manifest_for
    dump_module.manifest_for = lambda cfg, plan: made(cfg, plan).model_copy(update={"format_version": version})
    try:
        yield
    finally:
        dump_module.manifest_for = made


def make_student(tokenizer: Path, out: Path, seed: int, like: Path) -> Path:
    """A fresh tiny Llama on `tokenizer`, shaped like the demo's student (`like`)."""
    from transformers import AutoConfig

    from xtcache.testing import toy

    if not (out / "config.json").exists():
        cfg = AutoConfig.from_pretrained(str(like))
        toy.build_tiny_model("llama", tokenizer, out, hidden=cfg.hidden_size, layers=cfg.num_hidden_layers,
                             intermediate=cfg.intermediate_size, seed=seed)
    return out


def train_row(row: Row, store: str, student: Path, out: Path, s: Settings, seed: int, *, teacher=None,
              projection: Path | None = None) -> dict:
    """One row through the product's trainer; returns its summary (hf_dir: the final student)."""
    from stage2_student.config import TrainConfig
    from stage2_student.data import open_stage_data
    from stage2_student.student import load_tokenizer, setup_distributed
    from stage2_student.trainer import Trainer

    shutil.rmtree(out, ignore_errors=True)
    flat = {"cache": store, "student": str(student), "out": str(out), "seed": seed, "seq_len": s.seq_len,
            "micro_batch_size": s.micro_batch_size, "max_steps": s.steps, "lr": s.lr,
            "warmup_steps": s.warmup_steps, "zero_stage": 2, "projection": str(projection) if projection else None}
    if row.loss == "ce":
        flat.update(loss="ce", ce_weight=1.0)
    else:
        flat.update(loss={"online": "kl", "renorm": "kl"}.get(row.loss, row.loss), kd_weight=KD_WEIGHT,
                    ce_weight=CE_WEIGHT)
        if row.loss == "pkl":  # the forward P-KL of every cross row and of the gradient probe (make_objective)
            flat.update(pkl_divergence="forward")
    cfg = TrainConfig.from_flat(flat)

    from stage2_student.mix import TeacherMix

    def make_data(cfg, tokenizer, rank, world):
        data = open_stage_data(cfg, tokenizer, rank, world)
        if row.loss == "online":
            data.train = LiveStream(data.train, teacher)
        elif row.loss == "renorm":
            data.objective = TeacherMix([make_objective("renorm")])  # the trainer's objective: N = 1 teacher
        return data

    t0 = time.perf_counter()
    # what trainer.train(cfg, make_data) does, minus tearing the process group down: DeepSpeed keeps
    # its groups for the process, so every row of the bench trains in the one single-rank group
    rank, _, world = setup_distributed()
    summary = Trainer(cfg, make_data(cfg, load_tokenizer(cfg.student), rank, world), rank=rank, world=world).run()
    summary["wall_s"] = time.perf_counter() - t0
    shutil.rmtree(out / "checkpoints", ignore_errors=True)
    return summary


# --------------------------------------------------------------------------------------------
# measures


def batches(store: str, tokenizer: Path, s: Settings, n: int) -> list[dict]:
    """The first `n` micro-batches of a store's documents, in stored order (the held-out reading)."""
    from stage2_student.config import LoaderConfig
    from stage2_student.loader import CacheDataset, to_tensors

    ds = CacheDataset(store, str(tokenizer), LoaderConfig(seq_len=s.seq_len, micro_batch_size=s.micro_batch_size), split="all",
                      epochs=1, shuffle=False)
    out = []
    for b in ds:
        out.append(to_tensors(b))
        if len(out) == n:
            break
    return out


def load_model(path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)


def heldout(model, evals: list[dict], loss: str, projection=None) -> dict:
    """Held-out KL (the objective's `loss` term summed over chunks / chunks, against full-vocabulary
    targets) and CE (per labelled token), both from the product's `Objective`."""
    import torch

    from stage2_student.objective import Objective
    from stage2_student.student import model_inputs

    measure = Objective(loss, ce_weight=0.0, projection=projection)
    kl = chunks = ce = tokens = 0.0
    model.eval()
    with torch.no_grad():
        for b in evals:
            logits = model(**model_inputs(b)).logits
            kd_sum, ce_sum = measure.sums(logits, measure.prepare(b, vocab=logits.shape[-1]))
            c, t = measure.counts(b)
            kl, chunks, ce, tokens = kl + float(kd_sum), chunks + c, ce + float(ce_sum), tokens + t
    return {"kl": kl / chunks, "ce": ce / tokens}


def gradient(model, loss: str, probes: list[dict], projection=None):
    import torch

    from stage2_student.student import model_inputs

    obj = make_objective(loss, projection)
    params = [p for p in model.parameters() if p.requires_grad]
    total = [torch.zeros_like(p) for p in params]
    model.train()
    for b in probes:  # the objective of each batch alone: normalised by its own chunks and tokens
        logits = model(**model_inputs(b)).logits
        chunks, tokens = obj.counts(b)
        value, _ = obj(logits, obj.prepare(b, vocab=logits.shape[-1]), chunks_total=chunks, tokens_total=tokens)
        for t, g in zip(total, torch.autograd.grad(value, params)):
            t += g
    return torch.cat([t.reshape(-1) for t in total])


def cosine(a, b) -> float:
    import torch

    return float(torch.nn.functional.cosine_similarity(a, b, dim=0))


# --------------------------------------------------------------------------------------------
# the run


def _mean_sd(values: list[float]) -> tuple[float, float | None]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else None)


def run(args) -> dict:
    import torch

    from stage2_student.losses import ProjectionOperator
    from xtcache import projection as xproj
    from xtcache.app.demo.setup import SIZES, toy_spec
    from xtcache.store import CacheReader
    from xtcache.testing import toy
    from xtcache.tokenizer import load_tokenizer

    given = {k: v for k, v in (("steps", args.steps), ("seeds", args.seeds), ("lr", args.lr)) if v is not None}
    s = QUICK if args.quick else Settings(**given, seq_len=args.seq_len,
                                          micro_batch_size=args.micro_batch_size, train_docs=args.train_docs,
                                          heldout_docs=args.heldout_docs)
    work = Path(args.workdir)
    t_start = time.perf_counter()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    setup = toy.build_toy_setup(work / "artifacts", toy_spec(SIZES["default"]))
    teacher_dir, teacher_tok, cross_tok = setup.teacher_model, setup.teacher_tokenizer, setup.student_tokenizer
    cross_student = setup.student_model
    train_src, held_src = setup.train_jsonl, setup.heldout_jsonl
    t_setup = time.perf_counter() - t_start
    log.info("setup ready (%.0f s)", t_setup)
    tag = f"d{s.train_docs}-h{s.heldout_docs}"
    train_data = first_docs(train_src, work / "quality" / "data" / f"train-{tag}.jsonl", s.train_docs)
    held_data = first_docs(held_src, work / "quality" / "data" / f"heldout-{tag}.jsonl", s.heldout_docs)

    t0 = time.perf_counter()
    stores, held_stores = {}, {}
    for key, spec in STORES.items():
        stores[key] = dump(teacher_dir, [cross_tok], train_data, work / "quality" / "stores" / f"train-{tag}-{key}", spec)
        held_stores[key] = dump(teacher_dir, [cross_tok], held_data, work / "quality" / "stores" / f"held-{tag}-{key}", spec)
        log.info("store %s: %.1f bytes/position", key, stores[key]["bytes_per_position"])
    t_dump = time.perf_counter() - t0
    log.info("stores ready (%.0f s)", t_dump)

    vocab = len(load_tokenizer(teacher_tok))
    teacher = LiveTeacher(teacher_dir, vocab)
    proj_path = work / "quality" / "projection.safetensors"
    if not proj_path.exists():
        xproj.build_projection(load_tokenizer(cross_tok), load_tokenizer(teacher_tok)).save(proj_path)
    w = xproj.ProjectionMap.load(proj_path).to_torch_sparse(CacheReader(held_stores["full"]["path"]).manifest.teacher_vocab_size)
    projection = ProjectionOperator(w)

    # fixed held-out batches: evaluation targets and gradient probes, built once
    same_eval = [teacher.fill(b, renormalise=True) for b in batches(held_stores["top8"]["path"], teacher_tok, s,
                                                                    s.eval_batches)]
    same_eval_store = [{**b, "teacher_residual": torch.zeros_like(b["teacher_residual"])}
                       for b in batches(held_stores["full"]["path"], teacher_tok, s, s.eval_batches)]
    cross_eval = []
    for b in batches(held_stores["full"]["path"], cross_tok, s, s.eval_batches):
        cross_eval.append({**b, "teacher_residual": torch.zeros_like(b["teacher_residual"])})
    ref_probe = [teacher.fill(b) for b in batches(held_stores["top8"]["path"], teacher_tok, s, s.probe_batches)]
    cross_ref_probe = batches(held_stores["full"]["path"], cross_tok, s, s.probe_batches)
    probes = {key: batches(st["path"], teacher_tok, s, s.probe_batches) for key, st in held_stores.items()}
    cross_probes = {key: batches(held_stores[key]["path"], cross_tok, s, s.probe_batches)
                    for key in {row.store for row in ROWS if row.cross}}
    for key, pb in probes.items():  # every same-tokenizer store packs the same windows
        assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(pb, ref_probe)), key

    results = []
    t_train = 0.0
    for seed in range(s.seeds):
        # fresh toy students, initialised with seed 1 + seed
        same = make_student(teacher_tok, work / "quality" / "students" / f"same-seed{seed}", 1 + seed, cross_student)
        cross = make_student(cross_tok, work / "quality" / "students" / f"cross-seed{seed}", 1 + seed, cross_student)
        grads0 = {"same": gradient(load_model(same), "kl", ref_probe),
                  "cross": gradient(load_model(cross), "pkl", cross_ref_probe, projection)}
        for row in ROWS:
            if seed > 0 and not row.key:
                continue
            store = stores[row.store or "top8"]["path"]
            student = cross if row.cross else same
            t0 = time.perf_counter()
            summary = train_row(row, store, student, work / "quality" / "runs" / f"seed{seed}" / row.name.replace(" ", "_")
                                .replace("/", "_").replace(":", ""), s, seed, teacher=teacher,
                                projection=proj_path if row.cross else None)
            t_train += time.perf_counter() - t0
            final = load_model(summary["hf_dir"])
            initial = load_model(student)
            probe_loss = {"online": "kl"}.get(row.loss, row.loss)
            if row.cross:
                m = heldout(final, cross_eval, "pkl", projection)
                m["kl_store"], m["kl"] = m["kl"], None
                pb = cross_probes[row.store]
                ref_loss, ref_pb, ref_g0 = "pkl", cross_ref_probe, grads0["cross"]
            else:
                m = heldout(final, same_eval, "kl")
                m["kl_store"] = heldout(final, same_eval_store, "kl")["kl"]
                pb = ref_probe if row.loss == "online" else probes[row.store]
                ref_loss, ref_pb, ref_g0 = "kl", ref_probe, grads0["same"]
            g0 = gradient(initial, probe_loss, pb, projection if row.cross else None)
            g1 = gradient(final, probe_loss, pb, projection if row.cross else None)
            r1 = gradient(final, ref_loss, ref_pb, projection if row.cross else None)
            rec = {"row": row.name, "seed": seed, "key": row.key, "cross": row.cross, "loss": row.loss,
                   "bytes_per_position": None if row.loss == "online" or (row.loss == "ce") else
                   stores[row.store]["bytes_per_position"],
                   "heldout_kl": m["kl"], "heldout_kl_store": m["kl_store"], "heldout_ce": m["ce"], "cos_step0": cosine(g0, ref_g0),
                   "cos_last": cosine(g1, r1), "train_s": summary["wall_s"],
                   "final_train_ce": None}
            results.append(rec)
            log.info("%s seed %d: held-out KL live %s store %.4f CE %.4f cos %.3f/%.3f (%.0f s)", row.name, seed,
                     m["kl"], m["kl_store"], m["ce"], rec["cos_step0"], rec["cos_last"], summary["wall_s"])
    report = {"settings": s.__dict__, "results": results, "stores": stores, "held_stores": held_stores,
              "wall_s": time.perf_counter() - t_start, "setup_s": t_setup, "dump_s": t_dump, "train_s": t_train,
              "machine": machine(), "date": time.strftime("%Y-%m-%d", time.gmtime())}
    return report


def machine() -> str:
    import platform

    import torch

    cpu = platform.processor() or platform.machine()
    return f"{os.cpu_count()} CPU cores ({cpu}), torch {torch.__version__}, " + \
        ("CUDA " + torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU")


# --------------------------------------------------------------------------------------------
# table and plot


def summarise(report: dict) -> list[dict]:
    """One line per row: means over seeds (key rows) and the share of the online gain per seed."""
    res = report["results"]
    by = {}
    for r in res:
        by.setdefault(r["row"], []).append(r)
    lines = []
    for row in ROWS:
        rs = by.get(row.name)
        if not rs:
            continue
        line = {"row": row.name, "cross": row.cross, "seeds": len(rs), "bytes_per_position": rs[0]["bytes_per_position"]}
        for col in ("heldout_kl", "heldout_kl_store", "heldout_ce", "cos_step0", "cos_last"):
            values = [r[col] for r in rs if r[col] is not None]
            line[col] = _mean_sd(values) if values else None
        for col, share in (("heldout_kl", "share"), ("heldout_kl_store", "share_store")):
            kl = {(r["row"], r["seed"]): r[col] for r in res}
            shares = []
            for r in rs if not row.cross else []:
                base, ref = kl.get(("CE only", r["seed"])), kl.get(("online full KD (reference)", r["seed"]))
                if base is not None and ref is not None and base != ref:
                    shares.append((base - r[col]) / (base - ref))
            line[share] = _mean_sd(shares) if shares else None
        lines.append(line)
    return lines


def _cell(v, fmt: str) -> str:
    if v is None:
        return "n/a"
    mean, sd = v
    return format(mean, fmt) + ("" if sd is None else f" ± {format(sd, fmt)}")


COLUMN = {"heldout_kl": "held-out KL (live teacher)", "heldout_kl_store": "held-out KL (full store)"}


def noise_notes(report: dict, col: str = "heldout_kl") -> list[str]:
    """Paired differences (same seed) between key rows, against their spread over seeds."""
    res = report["results"]
    kl = {(r["row"], r["seed"]): r[col] for r in res if r[col] is not None}
    seeds = sorted({r["seed"] for r in res})
    notes = []
    ref = "online full KD (reference)"
    for name in ("cached full", "cached top-64 + rest", "CE only"):
        diffs = [kl[(name, sd)] - kl[(ref, sd)] for sd in seeds if (name, sd) in kl and (ref, sd) in kl]
        if len(diffs) < 2:
            continue
        mean, sd = statistics.fmean(diffs), statistics.stdev(diffs)
        se = sd / math.sqrt(len(diffs))
        verdict = "within noise" if abs(mean) <= 2 * se else ("worse than" if mean > 0 else "better than")
        notes.append(f"{name} vs online full KD: {COLUMN[col]} difference {mean:+.4f} ± {sd:.4f} (sd over "
                     f"{len(diffs)} paired seeds; 2 standard errors = {2 * se:.4f}): {verdict} the reference")
    spread = [statistics.stdev([kl[(name, sd)] for sd in seeds if (name, sd) in kl])
              for name in (ref, "cached full", "cached top-64 + rest") if sum((name, sd) in kl for sd in seeds) > 1]
    if spread:
        notes.append(f"seed spread (sd) of the key rows' {COLUMN[col]}: {min(spread):.4f} to {max(spread):.4f}; "
                     "single-seed rows closer than about twice that to another row are not distinguishable")
    return notes


def markdown(report: dict) -> str:
    lines = summarise(report)
    s = report["settings"]
    out = [f"Measured {report['date']} on {report['machine']}; {s['steps']} steps x {s['micro_batch_size']} windows x "
           f"{s['seq_len']} tokens, {s['train_docs']} training and {s['heldout_docs']} held-out documents; "
           f"total {report['wall_s']:.0f} s.", "",
           "| row | bytes/position | held-out KL (live teacher) | share of online gain | held-out KL (full store) "
           "| share of online gain | held-out CE | grad cos step 0 | grad cos last |",
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for ln in lines:
        bpp = "0 (no teacher)" if ln["row"].endswith("CE only") else (
            "teacher in the loop" if ln["bytes_per_position"] is None else f"{ln['bytes_per_position']:,.1f}")
        seeds = f" ({ln['seeds']} seeds)" if ln["seeds"] > 1 else ""
        out.append(f"| {ln['row']}{seeds} | {bpp} | {_cell(ln['heldout_kl'], '.4f')} | {_cell(ln['share'], '.0%')} "
                   f"| {_cell(ln['heldout_kl_store'], '.4f')} | {_cell(ln['share_store'], '.0%')} "
                   f"| {_cell(ln['heldout_ce'], '.4f')} | {_cell(ln['cos_step0'], '.3f')} | {_cell(ln['cos_last'], '.3f')} |")
    out += ["", "Held-out KL (live teacher): token-level KL(teacher || student) over the teacher's full vocabulary, "
            "the teacher's log-probs from a live forward on the student's own held-out windows (the context the online "
            "row trains with). Held-out KL (full store): the same against a full-vocabulary store of the held-out "
            "documents, whose teacher read whole documents (the context the cached rows train with; 8-bit log-probs); "
            "for cross-tokenizer rows it is the chunk-level projected KL, a different measure: compare cross-tokenizer "
            "rows among themselves only. Gradient cosines are to online full KD (cross-tokenizer rows: to P-KL on "
            "the full-vocabulary store) on fixed held-out batches.", ""]
    out += [f"- {n}" for n in noise_notes(report, "heldout_kl") + noise_notes(report, "heldout_kl_store")]
    return "\n".join(out) + "\n"


def plot(report: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = summarise(report)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, cross, title in ((axes[0], False, "same tokenizer: token-level KL to the teacher"),
                             (axes[1], True, "cross tokenizer: chunk-level projected KL")):
        for ln in (x for x in lines if x["cross"] == cross):
            y, sd = ln["heldout_kl_store" if cross else "heldout_kl"]
            if ln["bytes_per_position"] is None:  # no store: a horizontal line
                ax.axhline(y, ls="--" if "online" in ln["row"] else ":", color="k" if "online" in ln["row"] else "r",
                           label=ln["row"])
                continue
            ax.errorbar(ln["bytes_per_position"], y, yerr=sd or 0, fmt="o", capsize=3, label=ln["row"])
        ax.set_xscale("log")
        ax.set_xlabel("cache bytes / position (log)")
        ax.set_ylabel("held-out KL (full store)" if cross else "held-out KL (live teacher)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=80)
    plt.close(fig)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workdir", default=str(REPO / ".xtcache_bench_cache"),
                   help="toy artifacts, stores and runs (reused)")
    p.add_argument("--out", default=str(REPO / "bench" / "results"), help="where quality.md/.json/.png go")
    p.add_argument("--quick", action="store_true", help="a smoke run (few documents and steps, one seed)")
    p.add_argument("--steps", type=int, default=None, help="default: the section's settings")
    p.add_argument("--seq-len", type=int, default=Settings.seq_len)
    p.add_argument("--seeds", type=int, default=None, help="default: the section's settings")
    p.add_argument("--lr", type=float, default=None, help="default: the section's settings")
    p.add_argument("--micro-batch-size", type=int, default=Settings.micro_batch_size)
    p.add_argument("--train-docs", type=int, default=Settings.train_docs, help="the first N training documents")
    p.add_argument("--heldout-docs", type=int, default=Settings.heldout_docs, help="the first N held-out documents")
    p.add_argument("--teacher", choices=("toy", "real"), default="toy",
                   help="toy: the demo's toy teacher (the full table); real: SmolLM2-135M-Instruct with students on "
                        "its own and on the Llama-3 vocabulary (bench/quality_real.py; --write-docs writes docs/losses.md's "
                        "quality-real block)")
    p.add_argument("--write-docs", action="store_true",
                   help="also write quality.md into docs/benchmarks.md's quality-table block (xtcache.app.docblock)")
    p.add_argument("--section", choices=("table", "on-policy", "on-policy-converged", "on-policy-converged-stronger",
                                         "on-policy-converged-same", "modes", "cross", "cross-qwen3"),
                   default="table",
                   help="table: the full table (docs/benchmarks.md; with --teacher real, docs/losses.md's quality-real "
                        "block); modes (--teacher real only): one tokenizer, a row per store mode (top-k 8/32/64, "
                        "sampled, head + tail, full) against CE only (docs/losses.md's quality-real-modes block); "
                        "cross (--teacher real only): the Llama-3 student's CE only, the defaults and the mix weighted "
                        "towards the reverse KL, eight seeds each (README.md's quality-real-cross block); "
                        "cross-qwen3 (--teacher real only): CE only and the defaults for a student on the Qwen3 "
                        "vocabulary, three seeds (docs/losses.md's quality-real-cross-qwen3 block); "
                        "on-policy: on-policy rounds against off-policy KD "
                        "(bench/quality_onpolicy.py; --write-docs writes docs/on-policy.md's quality-on-policy block); "
                        "on-policy-converged: rounds against continued off-policy KD from a converged student "
                        "(bench/quality_onpolicy_converged.py; its quality-on-policy-converged block; with --teacher "
                        "real both kinds on the real tier, its quality-on-policy-converged-real block); "
                        "on-policy-converged-stronger: the same on conversations alone with a chat teacher twice the "
                        "student's width pre-trained longer (its quality-on-policy-converged-stronger block); "
                        "on-policy-converged-same: both kinds with a student of the teacher's tokenizer (and chat "
                        "template; its quality-on-policy-converged-same block)")
    p.add_argument("--from-report", help="render the table of this report (an earlier run's JSON: "
                                         "quality-on-policy(-converged).json, or with --teacher real its section's "
                                         "quality-real(-modes, -cross).json) instead of running")
    p.add_argument("--rows", default=None,
                   help="on-policy-converged: the indices of its ROWS to run, comma-separated (continued off-policy KD, "
                        "0, always runs; default: every row)")
    p.add_argument("--add-rows", action="store_true",
                   help="with --from-report R and --section on-policy: run only the rows R lacks (its settings, seeds "
                        "and setup) and write R's rows with them to --out's quality-on-policy.json; --section "
                        "on-policy-converged: R's trained runs (in --workdir, R's training settings) are kept, "
                        "measured again where R's sample count is not the settings', and only the rows R lacks train")
    args = p.parse_args(argv)
    if args.section == "on-policy":
        return on_policy_section(args)
    if args.section.startswith("on-policy-converged"):
        if args.teacher == "real" and args.section != "on-policy-converged":
            p.error(f"--section {args.section} is the toy teacher's: --teacher real runs --section on-policy-converged")
        return converged_section(args)
    if args.section in ("modes", "cross", "cross-qwen3") and args.teacher != "real":
        p.error(f"--section {args.section} is the real teacher's: add --teacher real")
    if args.teacher == "real":
        return real_section(args)
    if args.write_docs and args.quick:
        p.error("--write-docs: docs/benchmarks.md's quality table is the toy teacher's full run; drop --quick")
    if args.write_docs:
        from xtcache.app.docblock import require_blocks

        require_blocks(REPO, {"quality-table": DOC_BLOCKS["quality-table"]})
    _bench_logging()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    report = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "quality.json").write_text(json.dumps(report, indent=2, default=str))
    md = markdown(report)
    (out / "quality.md").write_text(md)
    plot(report, out / "quality.png")
    print(md)
    print(f"wrote {out / 'quality.md'}, {out / 'quality.json'}, {out / 'quality.png'}")
    if args.write_docs:
        from xtcache.app.docblock import write_block

        write_block(REPO / DOC_BLOCKS["quality-table"], "quality-table", md)


def _bench_logging() -> None:
    """The bench's own progress at INFO, the product's and the libraries' at WARNING."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    for name in ("stage1_teacher", "stage2_student", "xtcache", "DeepSpeed", "deepspeed", "torch", "transformers"):
        logging.getLogger(name).setLevel(logging.WARNING)


def real_section(args) -> None:
    """`--teacher real`: bench/quality_real.py's rows (MAIN, MODES with --section modes, CROSS with --section cross),
    its table printed and written (quality-real.md, quality-real-modes.md or quality-real-cross.md)."""
    from bench.quality_real import CROSS, CROSS_QWEN3, MAIN, MODES, QUICK, RealSettings, modes_markdown, run_real
    from bench.quality_real import markdown as real_markdown

    rows, block = {"modes": (MODES, "quality-real-modes"), "cross": (CROSS, "quality-real-cross"),
                   "cross-qwen3": (CROSS_QWEN3, "quality-real-cross-qwen3")}.get(args.section, (MAIN, "quality-real"))
    if args.write_docs:
        from xtcache.app.docblock import require_blocks

        require_blocks(REPO, {block: DOC_BLOCKS[block]})
    _bench_logging()
    given = {k: v for k, v in (("steps", args.steps), ("seeds", args.seeds), ("lr", args.lr)) if v is not None}
    if args.section == "cross-qwen3":  # the second student vocabulary: three seeds unless --seeds says otherwise
        given = {"seeds": 3, **given, "cross_student": "qwen3"}
    s = replace(QUICK, cross_student=given.get("cross_student", QUICK.cross_student)) if args.quick else RealSettings(**given)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.from_report:  # an earlier run's table, rendered again (its figures unchanged; rows under their current names)
        report = {**json.loads(Path(args.from_report).read_text()), "rendered_from": args.from_report}
    else:
        report = run_real(Path(args.workdir) / "real", s, rows)
        (Path(args.out) / f"{block}.json").write_text(json.dumps(report, indent=2, default=str))
    _publish(args, block, (modes_markdown if args.section == "modes" else real_markdown)(report), report)


def _publish(args, block: str, md: str, report: dict) -> None:
    """A section's table: printed, written to --out as BLOCK.md, and with --write-docs (not --quick) into its doc block,
    stamped with the runs that measured it where the table comes from an earlier report (--from-report)."""
    (Path(args.out) / f"{block}.md").write_text(md)
    print(md)
    if args.write_docs and not args.quick:
        from xtcache.app.docblock import write_block

        write_block(REPO / DOC_BLOCKS[block], block, md, measured=measured_runs(report) if args.from_report else None)


def measured_runs(report: dict) -> list[dict]:
    """The runs that measured a report's figures (`docblock.run_record`s); a report that keeps one run's `date` and
    `machine` (this bench's main table and the real sections) names that run."""
    if "measured" in report:
        return report["measured"]
    return [{"date": report["date"], "machine": report["machine"]}] if "date" in report else []


def on_policy_section(args) -> None:
    """`--section on-policy`: bench/quality_onpolicy.py's rows, its table printed and written (quality-on-policy.md)."""
    from bench.quality_onpolicy import OnPolicySettings, run_on_policy
    from bench.quality_onpolicy import markdown as on_policy_markdown

    if args.write_docs:
        from xtcache.app.docblock import require_blocks

        require_blocks(REPO, {"quality-on-policy": DOC_BLOCKS["quality-on-policy"]})
    _bench_logging()
    s = OnPolicySettings(seeds=1, steps_per_round=6, prompts=8, num_train=80, teacher_steps=40) if args.quick \
        else OnPolicySettings()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.add_rows and not args.from_report:
        raise SystemExit("--add-rows: give --from-report (the report whose rows are reused)")
    if args.add_rows:  # the rows the earlier report lacks, run on its settings; its own rows reused as they are
        base = json.loads(Path(args.from_report).read_text())
        report = run_on_policy(Path(args.workdir) / "on-policy", OnPolicySettings(**base["settings"]), base=base,
                               save=out / "quality-on-policy.json")
        (out / "quality-on-policy.json").write_text(json.dumps(report, indent=2, default=str))
    elif args.from_report:  # the table of an earlier run, rendered again (its figures unchanged)
        report = {**json.loads(Path(args.from_report).read_text()), "rendered_from": args.from_report}
    else:
        report = run_on_policy(Path(args.workdir) / "on-policy", s)
        (out / "quality-on-policy.json").write_text(json.dumps(report, indent=2, default=str))
    _publish(args, "quality-on-policy", on_policy_markdown(report), report)


def converged_section(args) -> None:
    """`--section on-policy-converged`: bench/quality_onpolicy_converged.py's rows (both kinds), its table printed
    and written (quality-on-policy-converged.md); `--from-report` renders an earlier run's JSON again.
    `--section on-policy-converged-stronger`: conversations alone, with `STRONGER_CHAT_TEACHER`, in a work
    directory and a block of their own; `--section on-policy-converged-same` both kinds with `SAME_TOKENIZER`,
    likewise; `--teacher real` both kinds with `REAL_TEACHER`, likewise."""
    from bench.quality_onpolicy_converged import (
        KINDS,
        QUICK,
        REAL_TEACHER,
        SAME_TOKENIZER,
        STRONGER_CHAT_TEACHER,
        ConvergedSettings,
        markdown,
        run_converged,
    )

    section = args.section + ("-real" if args.teacher == "real" else "")
    block = "quality-" + section
    variant = {"on-policy-converged-stronger": STRONGER_CHAT_TEACHER, "on-policy-converged-same": SAME_TOKENIZER,
               "on-policy-converged-real": REAL_TEACHER}.get(section)
    if args.write_docs:
        from xtcache.app.docblock import require_blocks

        require_blocks(REPO, {block: DOC_BLOCKS[block]})
    _bench_logging()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    s = QUICK if args.quick else ConvergedSettings(**({"seeds": args.seeds} if args.seeds else {}))
    if variant:
        s = replace(s, **variant)
    kinds = ("chat",) if variant is STRONGER_CHAT_TEACHER else KINDS
    work = Path(args.workdir) / section
    if args.add_rows and not args.from_report:
        raise SystemExit("--add-rows: give --from-report (the report whose rows are reused)")
    only = {int(i) for i in args.rows.split(",")} if args.rows else None
    if args.add_rows:  # the earlier report's runs (in --workdir) kept, measured again where needed, rows it lacks run
        base = {**json.loads(Path(args.from_report).read_text()), "rendered_from": args.from_report}
        report = run_converged(work, s, kinds, base=base, save=out / f"{block}.json", only=only)
    elif args.from_report:
        report = json.loads(Path(args.from_report).read_text())
    else:
        report = run_converged(work, s, kinds, save=out / f"{block}.json", only=only)
    _publish(args, block, markdown(report), report)


if __name__ == "__main__":
    main()
