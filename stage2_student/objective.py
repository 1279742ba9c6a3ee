"""The stage 2 training objective as one object: KD + CE on a micro-batch, bounded in memory.

    from stage2_student.objective import Capabilities, Objective
    obj = Objective.from_config(cfg.loss, Capabilities(same_tokenizer=True, mode="topk"))
    prep = obj.prepare(batch).to(device)           # host-side index plan of a CPU micro-batch
    loss, metrics = obj(model(**inputs).logits, prep, chunks_total=C, tokens_total=N)
    loss.backward()                                # metrics: on-device sums, read once per log step

`Objective` is built once from the loss settings (`LossConfig` or keywords) and what the cache
can do (`Capabilities`: same tokenizer or not, cache mode). It owns the KD kind, the CE weight
and CE's fusion into the KD pass, dynamic scaling, the temperature, the normalisation by the
global chunk and token counts (the caller all-reduces `counts(batch)` and passes the totals) and
the top-1 agreement. The trainer knows none of its terms.

    loss = kd_weight * s * sum(KD over chunks) / chunks_total + ce_weight * sum(CE) / tokens_total
    s = 1, or with dynamic scaling stop_grad(|mean CE| / |mean KD|) of this micro-batch

Memory and synchronisation. `prepare` runs on the host, on the CPU batch, before it moves to the
device: it cuts the micro-batch into blocks of student logit rows (a chunk never straddles two
blocks) such that the loss's working set stays within 2 x one row-block of fp32 logits
(`row_chunk` x V x 4 bytes) whatever the cache: top-k, sampled or full (k up to V), same or
cross tokenizer. One autograd function (`_BlockedTerms`) computes KD and CE block by block in
forward and recomputes each block in backward, writing one logits-sized gradient buffer; no
[rows, V] tensor of the whole micro-batch exists besides it. The call itself never reads a
device value back (no `.item()`, no data-dependent shapes), so a step does not stall the GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from stage2_student import losses
from stage2_student.losses import EmptyMappedSupportError, NoValidChunksError, ProjectionOperator
from xtcache.errors import ConfigError, ProjectionError, XtcacheError

ROW_CHUNK = 1024
KINDS = ("kl", "rkl", "jsd", "sampled", "pkl", "alm")
_V_COPIES = 9  # [rows, V] fp32-sized tensors a block holds at its peak (recompute + its backward)
_K_BYTES = 72  # bytes per stored teacher entry a block holds (ids, log-probs, p, q, terms, grads)


@dataclass(frozen=True)
class Capabilities:
    """What the cache offers the objective: same tokenizer as the teacher, and its mode."""

    same_tokenizer: bool
    mode: str  # topk | full | sampled


def resolve_kind(requested: str, caps: Capabilities) -> str:
    """The KD kind a run trains with (for --loss ce: the one its evaluation would use).

    auto: kl for same-tokenizer caches (sampled for sampled ones), pkl for cross-tokenizer caches
    (sampled ones included: P-KL then uses the teacher's empirical distribution counts / N).
    """
    same, mode = caps.same_tokenizer, caps.mode
    if requested in ("auto", "ce"):
        return ("sampled" if mode == "sampled" else "kl") if same else "pkl"
    if requested in ("kl", "rkl", "jsd") and (not same or mode == "sampled"):
        why = "the cache is cross-tokenizer: use --loss pkl or alm" if not same else \
            "the cache holds sampled targets: use --loss sampled"
        raise ConfigError(f"--loss {requested}: {why}")
    if requested == "sampled" and (mode != "sampled" or not same):
        raise ConfigError(f"--loss sampled needs a same-tokenizer cache of sampled targets (this one: mode {mode!r}, "
                          f"{'same' if same else 'cross'}-tokenizer)")
    if requested == "pkl" and same:
        raise ConfigError("--loss pkl: the student shares the teacher's tokenizer: use --loss kl")
    return requested


def measure_definition(caps: Capabilities) -> str:
    """What the evaluation's `kl_to_teacher` measures on a cache with these capabilities."""
    what = {"topk": "each {0}'s cached top-k teacher ids plus one rest bucket: a lower bound of the KL over "
                    "the full {1}vocabulary",
            "full": "the full {1}vocabulary (full cache: exact)",
            "sampled": "each {0}'s sampled teacher ids plus one rest bucket, the teacher taken as its empirical "
                       "sample distribution counts / N (an estimate from samples, not a bound)"}[caps.mode]
    if caps.same_tokenizer:
        return "forward KL(teacher || student) at T=1 per position over " + what.format("position", "")
    return ("projected forward KL (P-KL) at T=1 per chunk, teacher chunk distribution vs the student's mapped "
            "through the projection W, over " + what.format("chunk", "teacher "))


@dataclass(frozen=True)
class _Spec:
    kind: str | None  # None: CE only
    temperature: float
    beta: float
    tau: float
    tail: str
    projection: ProjectionOperator | None = None


class Block:
    """One block of student rows: host-planned index tensors (moved to the device with `to`)."""

    def __init__(self, **fields):
        self.__dict__.update(fields)

    def to(self, device) -> "Block":
        for name, value in self.__dict__.items():
            if isinstance(value, Tensor):
                setattr(self, name, value.to(device, non_blocking=True))
        return self


class Prepared:
    """A micro-batch planned for the objective: blocks, teacher tensors and host-side counts."""

    def __init__(self, blocks: list[Block], teacher: dict, agree: dict | None, *, chunks: int, tokens: int,
                 valid_pos: int):
        self.blocks, self.teacher, self.agree = blocks, teacher, agree
        self.chunks, self.tokens, self.valid_pos = chunks, tokens, valid_pos

    def to(self, device) -> "Prepared":
        for b in self.blocks:
            b.to(device)
        self.teacher = {k: v.to(device, non_blocking=True) for k, v in self.teacher.items()}
        if self.agree is not None:
            self.agree = {k: v.to(device, non_blocking=True) for k, v in self.agree.items()}
        return self


def _take(t: Tensor, sel) -> Tensor:
    return t[sel[0]:sel[1]] if isinstance(sel, tuple) else t.index_select(0, sel)


def _rows_selector(rows: np.ndarray):
    """A contiguous ascending range as a (start, end) slice (a view, no copy), else an index tensor."""
    if rows.size and rows[-1] - rows[0] + 1 == rows.size and np.all(np.diff(rows) == 1):
        return int(rows[0]), int(rows[-1]) + 1
    return torch.from_numpy(rows.astype(np.int64))


class Objective:
    """KD + CE of one micro-batch; see the module docstring."""

    def __init__(self, kind: str | None, *, kd_weight: float = 1.0, ce_weight: float = 0.1,
                 dynamic_scaling: bool = False, temperature: float = 1.0, jsd_beta: float = 0.5,
                 alm_tau: float = 100.0, projection: ProjectionOperator | None = None, teacher_tail: str = "ghost",
                 measure_agreement: bool = True, row_chunk: int = ROW_CHUNK, with_ce: bool = True):
        if kind is not None and kind not in KINDS:
            raise ValueError(f"--loss {kind!r}: use {', '.join(KINDS)}")
        if teacher_tail not in ("ghost", "uniform"):
            raise ValueError(f"teacher_tail {teacher_tail!r}: use 'ghost' or 'uniform'")
        if kind == "sampled" and temperature != 1.0:
            raise ConfigError(f"--temperature {temperature:g} with --loss sampled: the cache holds draws of the T=1 "
                              "teacher, which cannot be re-tempered; use --temperature 1 (docs/losses.md)")
        if kind == "pkl" and projection is None:
            raise ProjectionError("--loss pkl needs a projection map (--projection, or built from both tokenizers)")
        self.kind, self.projection = kind, projection
        self.kd_weight, self.ce_weight, self.dynamic_scaling = kd_weight, ce_weight, dynamic_scaling
        self.row_chunk = int(row_chunk)
        self.with_ce = with_ce  # False: this teacher's pass skips CE (another teacher's pass computes it)
        self.spec = _Spec(kind, float(temperature), jsd_beta, alm_tau, teacher_tail, projection)
        cross = kind in ("pkl", "alm")
        self.measure_agreement = measure_agreement and kind is not None and (not cross or projection is not None)

    @classmethod
    def from_config(cls, loss_cfg, caps: Capabilities, projection: ProjectionOperator | None = None, *,
                    kind: str | None = None, **overrides) -> "Objective":
        """The objective of a `LossConfig` on a cache with `caps` (--loss ce: CE only, no KD)."""
        if kind is None and loss_cfg.loss != "ce":
            kind = resolve_kind(loss_cfg.loss, caps)
        kw = dict(kd_weight=loss_cfg.kd_weight, ce_weight=loss_cfg.ce_weight,
                  dynamic_scaling=loss_cfg.dynamic_scaling, temperature=loss_cfg.temperature,
                  jsd_beta=loss_cfg.jsd_beta, alm_tau=loss_cfg.alm_tau, projection=projection)
        kw.update(overrides)
        return cls(kind, **kw)

    def to(self, device) -> "Objective":
        """Put the objective's own tensors (the projection W) on the trainer's device."""
        if self.projection is not None:
            self.projection.to(device)
        return self

    # ----------------------------------------------------------------- host side
    @staticmethod
    def counts(batch: dict) -> tuple[int, int]:
        """(valid chunks, labelled tokens) of a CPU micro-batch: the terms of the normalisers."""
        return int(batch.get("num_chunks", 0)), int((batch["labels"] != -100).sum())

    def prepare(self, batch: dict, *, vocab: int) -> Prepared:
        """The index plan of one CPU micro-batch (host work only; `vocab` = the logits' width)."""
        labels = batch["labels"].reshape(-1).numpy()
        n_chunks = int(batch.get("num_chunks", 0))
        sc = batch["student_chunk"].reshape(-1).numpy() if "student_chunk" in batch else np.full(labels.size, -1)
        labelled = np.nonzero(labels != -100)[0]
        ce_pos = labelled if self.with_ce else labelled[:0]
        kd = self.kind is not None and n_chunks > 0
        teacher = {}
        if kd:
            for key in ("teacher_ids", "teacher_logprobs", "teacher_counts", "teacher_residual", "teacher_realized"):
                if key in batch:
                    teacher[key] = batch[key]
            plan = self._plan_kd(batch, sc, n_chunks, ce_pos, labels, vocab)
        else:
            plan = self._plan_ce_only(ce_pos, labels, vocab)
        agree = self._plan_agreement(batch, sc, n_chunks) if kd and self.measure_agreement else None
        return Prepared(plan, teacher, agree, chunks=n_chunks, tokens=int(labelled.size),
                        valid_pos=int(((sc >= 0) & (labels != -100)).sum()))

    def _budget(self, vocab: int) -> float:
        return 2.0 * self.row_chunk * vocab * 4

    def _cut(self, costs: np.ndarray, vocab: int) -> np.ndarray:
        """Greedy block id of each unit (in the given order) under the memory budget."""
        budget, out, used, block = self._budget(vocab), np.zeros(costs.size, dtype=np.int64), 0.0, 0
        for i, c in enumerate(costs.tolist()):
            if used and used + c > budget:
                block, used = block + 1, 0.0
            out[i], used = block, used + c
        return out

    def _plan_ce_only(self, ce_pos: np.ndarray, labels: np.ndarray, vocab: int) -> list[Block]:
        blocks = []
        rows = max(1, int(self._budget(vocab) // (_V_COPIES * 4 * vocab)))
        for s in range(0, ce_pos.size, rows):
            pos = ce_pos[s:s + rows]
            blocks.append(Block(pos=torch.from_numpy(pos), n_kd=0, kd_chunk=torch.zeros(0, dtype=torch.int64),
                                ce_loc=torch.arange(pos.size),
                                ce_lab=torch.from_numpy(labels[pos])))
        return blocks

    def _plan_kd(self, batch, sc, n_chunks, ce_pos, labels, vocab) -> list[Block]:
        tch = batch["teacher_chunk"].numpy()
        tids = batch["teacher_ids"].numpy()
        k = tids.shape[1]
        pos_in = np.nonzero(sc >= 0)[0]
        pos_chunk = sc[pos_in]
        same = self.kind not in ("pkl", "alm")
        if same and pos_in.size != n_chunks:
            raise XtcacheError(f"batch has {pos_in.size} chunk logits for {n_chunks} chunks: not a same-tokenizer "
                               "batch; use the projected KL loss for cross-tokenizer caches")
        n_pos = np.bincount(pos_chunk, minlength=n_chunks)
        n_rows = np.bincount(tch, minlength=n_chunks)
        first = np.full(n_chunks, sc.size, dtype=np.int64)
        np.minimum.at(first, pos_chunk, pos_in)
        row_bytes = _V_COPIES * 4.0 * vocab
        if same:  # one student row per teacher row
            cost = n_rows * (row_bytes + k * _K_BYTES)
        else:
            cost = n_pos * row_bytes + n_rows * k * _K_BYTES
            if self.kind == "pkl":  # [chunks, V_t] and [V_s, chunks] tensors of the sparse matmuls
                self._check_mapped(tids)
                cost = cost + 6 * 4.0 * (self.projection.teacher_vocab + vocab)
        ce_only = ce_pos[sc[ce_pos] < 0]
        unit_first = np.concatenate([first, ce_only])
        unit_cost = np.concatenate([cost, np.full(ce_only.size, row_bytes)])
        order = np.argsort(unit_first, kind="stable")
        unit_block = np.empty(order.size, dtype=np.int64)
        unit_block[order] = self._cut(unit_cost[order], vocab)
        chunk_block, ce_only_block = unit_block[:n_chunks], unit_block[n_chunks:]
        row_block = chunk_block[tch]
        pos_block = chunk_block[pos_chunk]
        chunk_pos = np.zeros(n_chunks, dtype=np.int64)
        chunk_pos[pos_chunk] = pos_in
        ce_in = ce_pos[sc[ce_pos] >= 0]
        blocks = []
        for b in range(int(unit_block.max()) + 1 if unit_block.size else 0):
            t_rows = np.nonzero(row_block == b)[0]
            ce_b = ce_in[chunk_block[sc[ce_in]] == b]
            extra = ce_only[ce_only_block == b]
            if same:
                rows = chunk_pos[tch[t_rows]]  # [m] (a position repeats when chunks share it)
                first_row = {}
                for i, p in enumerate(rows.tolist()):
                    first_row.setdefault(p, i)
                ce_loc = np.array([first_row[p] for p in ce_b.tolist()], dtype=np.int64)
                fields = dict(n_kd=int(t_rows.size), t_sel=_rows_selector(t_rows),
                              kd_chunk=torch.from_numpy(tch[t_rows].astype(np.int64)))
            else:
                sel = np.nonzero(pos_block == b)[0]
                rows, chunks_of_rows = pos_in[sel], pos_chunk[sel]
                ce_loc = np.searchsorted(rows, ce_b)
                fields = self._plan_cross_block(rows, chunks_of_rows, t_rows, tch, labels)
            pos = np.concatenate([rows, extra]).astype(np.int64)
            ce_loc = np.concatenate([ce_loc, rows.size + np.arange(extra.size)]).astype(np.int64)
            blocks.append(Block(pos=torch.from_numpy(pos), ce_loc=torch.from_numpy(ce_loc),
                                ce_lab=torch.from_numpy(labels[pos[ce_loc]].astype(np.int64)), **fields))
        return blocks

    def _check_mapped(self, tids) -> None:
        ids = np.unique(tids[tids >= 0])
        if not self.projection.t_counts[ids].sum():
            raise EmptyMappedSupportError(
                "no student token maps onto any teacher id stored for this batch: the projection map "
                "was built for other tokenizers or is empty; check `xtcache projection inspect`")

    @staticmethod
    def _plan_cross_block(rows, chunks_of_rows, t_rows, tch, labels) -> dict:
        """Index plan of a cross-tokenizer block: chunk-local ids of its rows and weights, O(rows), never
        O(rows x k) (the teacher's support is scattered on the device, block by block)."""
        chunks = np.unique(chunks_of_rows)
        cl = np.searchsorted(chunks, chunks_of_rows)  # [P] chunk-local index of each row
        n_c = chunks.size
        npos = np.bincount(cl, minlength=n_c).astype(np.float64)
        trl = np.searchsorted(chunks, tch[t_rows])  # [M]
        nrows = np.bincount(trl, minlength=n_c).astype(np.float64)
        return dict(n_kd=int(rows.size), n_c=n_c, t_sel=_rows_selector(t_rows), cl=torch.from_numpy(cl),
                    kd_chunk=torch.from_numpy(chunks.astype(np.int64)),
                    trl=torch.from_numpy(trl), inv_npos=torch.from_numpy(1.0 / npos),
                    t_w=torch.from_numpy(1.0 / nrows[trl]),
                    a_lab=torch.from_numpy(np.maximum(labels[rows], 0).astype(np.int64)))

    def _plan_agreement(self, batch, sc, n_chunks) -> dict:
        """First logit position and the teacher's top-1 id (at the chunk's first row) of every chunk."""
        pos_in = np.nonzero(sc >= 0)[0]
        first_pos = np.full(n_chunks, sc.size, dtype=np.int64)
        np.minimum.at(first_pos, sc[pos_in], pos_in)
        tch = batch["teacher_chunk"].numpy()
        first_row = np.full(n_chunks, tch.size, dtype=np.int64)
        np.minimum.at(first_row, tch, np.arange(tch.size))
        ids = batch["teacher_ids"].numpy()[first_row]
        score = (batch["teacher_logprobs"] if "teacher_logprobs" in batch else batch["teacher_counts"]).numpy()
        score = np.where(ids >= 0, score[first_row].astype(np.float64), -np.inf)
        top = ids[np.arange(n_chunks), score.argmax(axis=1)].astype(np.int64)
        return {"first_pos": torch.from_numpy(first_pos), "teacher_top": torch.from_numpy(top)}

    # ----------------------------------------------------------------- device side
    def terms(self, logits: Tensor, prep: Prepared) -> tuple[Tensor, Tensor]:
        """(KD term of every chunk [C], sum of CE over the labelled tokens), on device."""
        kd, ce = blocked_terms(logits, [(self.spec, prep)])
        return kd[0], ce

    def sums(self, logits: Tensor, prep: Prepared) -> tuple[Tensor, Tensor]:
        """(sum of KD over the micro-batch's chunks, sum of CE over its labelled tokens), on device."""
        kd, ce = self.terms(logits, prep)
        return kd.sum(), ce

    def loss(self, kd_sum: Tensor, ce_sum: Tensor, *, chunks: int, tokens: int, chunks_total: float,
             tokens_total: float) -> Tensor:
        """kd_weight * s * kd_sum / chunks_total + ce_weight * ce_sum / tokens_total (module docstring)."""
        loss = ce_sum * (self.ce_weight / max(tokens_total, 1.0))
        if self.kind is not None and chunks:
            w = self.kd_weight
            if self.dynamic_scaling:  # w = sg(|CE| / |KD|), both as this micro-batch's means
                ce_mean = ce_sum.detach() / max(tokens, 1)
                w = w * ce_mean.abs() / (kd_sum.detach() / chunks).abs().clamp_min(1e-12)
            loss = loss + kd_sum * (w / max(chunks_total, 1.0))
        return loss

    def __call__(self, logits: Tensor, prep: Prepared, *, chunks_total: float, tokens_total: float
                 ) -> tuple[Tensor, dict]:
        """(loss to backpropagate, on-device metric sums) of one micro-batch."""
        kd_sum, ce_sum = self.sums(logits, prep)
        loss = self.loss(kd_sum, ce_sum, chunks=prep.chunks, tokens=prep.tokens, chunks_total=chunks_total,
                         tokens_total=tokens_total)
        agree, agree_n = self.agreement(logits, prep)
        return loss, {"kd_sum": kd_sum.detach(), "ce_sum": ce_sum.detach(), "agree": agree, "agree_n": agree_n}

    @torch.no_grad()
    def agreement(self, logits: Tensor, prep: Prepared) -> tuple[Tensor, Tensor]:
        """(agreeing chunks, chunks): the student's argmax at a chunk's first logit, mapped into the
        teacher vocabulary, vs the teacher's top-1 at the chunk's first row (sampled: the mode)."""
        flat = logits.detach().reshape(-1, logits.shape[-1])
        zero = torch.zeros((), dtype=torch.float32, device=flat.device)
        if prep.agree is None:
            return zero, zero
        first, top = prep.agree["first_pos"], prep.agree["teacher_top"]
        arg = torch.cat([flat[first[s:s + self.row_chunk]].argmax(dim=-1)
                         for s in range(0, first.shape[0], self.row_chunk)])  # [C]
        if self.projection is not None:
            arg = self.projection.student_top[arg]
        return (arg == top).sum().float(), zero + float(first.shape[0])


def blocked_terms(logits: Tensor, passes: list[tuple[_Spec, Prepared]]) -> tuple[list[Tensor], Tensor]:
    """([KD of every chunk [C_i] of each pass], CE sum over the passes) of one micro-batch's logits.

    A pass is one teacher's (spec, prepared plan); all of them run in one autograd function, so
    that backward writes one logits-sized gradient buffer whatever the number of teachers.
    """
    flat = logits.reshape(-1, logits.shape[-1])  # [N, V]
    if not any(p.blocks for _, p in passes):
        zero = flat.sum().to(losses.compute_dtype(flat.dtype)) * 0.0  # keeps the graph for backward
        return [zero.expand(p.chunks) for _, p in passes], zero
    *kd, ce = _BlockedTerms.apply(flat, passes)
    return kd, ce


class _BlockedTerms(torch.autograd.Function):
    """(KD of every chunk [C_i] of each pass..., CE sum) over the blocks of a micro-batch; backward
    recomputes block by block.

    Backward allocates the gradient of the logits (the only [N, V] tensor) and, per block of each
    pass, re-runs `_block_terms` with autograd on a copy of the block's rows, adding its gradient in.
    """

    @staticmethod
    def forward(ctx, logits, passes):
        cdt = losses.compute_dtype(logits.dtype)
        outs = []
        ce_out = torch.zeros((), dtype=cdt, device=logits.device)
        for spec, prep in passes:
            kd_out = torch.zeros(prep.chunks, dtype=cdt, device=logits.device)
            for blk in prep.blocks:
                kd, ce = _block_terms(spec, logits.index_select(0, blk.pos), blk, prep.teacher)
                kd_out.index_add_(0, blk.kd_chunk, kd)
                ce_out += ce
            outs.append(kd_out)
        ctx.save_for_backward(logits)
        ctx.passes = passes
        return (*outs, ce_out)

    @staticmethod
    def backward(ctx, *grads):
        (logits,) = ctx.saved_tensors
        grad_ce = grads[-1]
        grad = torch.zeros_like(logits)
        for (spec, prep), grad_kd in zip(ctx.passes, grads[:-1]):
            for blk in prep.blocks:
                with torch.enable_grad():
                    z = logits.index_select(0, blk.pos).detach().requires_grad_(True)
                    kd, ce = _block_terms(spec, z, blk, prep.teacher)
                    (gz,) = torch.autograd.grad((kd * grad_kd[blk.kd_chunk]).sum() + ce * grad_ce, z)
                grad.index_add_(0, blk.pos, gz)
                del z, gz, kd, ce  # the block's graph goes now, not when the next block replaces it
        return grad, None


def _block_terms(spec: _Spec, z_rows: Tensor, blk: Block, teacher: dict) -> tuple[Tensor, Tensor]:
    """(KD term of each of the block's chunks `blk.kd_chunk`, CE sum) of one block.
    z_rows: the block's logit rows [b, V] in the logits' dtype."""
    cdt = losses.compute_dtype(z_rows.dtype)
    z = z_rows.to(cdt)
    zero = torch.zeros((), dtype=cdt, device=z.device)
    t = spec.temperature
    lse1 = torch.logsumexp(z, dim=-1)  # [b]
    ce = zero
    if blk.ce_loc.shape[0]:
        ce = -(z[blk.ce_loc, blk.ce_lab] - lse1[blk.ce_loc]).sum()
    if spec.kind is None or blk.n_kd == 0:
        return z.new_zeros(blk.kd_chunk.shape[0]), ce
    m = blk.n_kd
    if spec.kind == "alm":
        lq = z[:m].gather(1, blk.a_lab[:, None])[:, 0] - lse1[:m]  # [P] label log-probs at T=1
        log_ps = torch.zeros(blk.n_c, dtype=cdt, device=z.device).index_add(0, blk.cl, lq)
        realized = _take(teacher["teacher_realized"], blk.t_sel).to(cdt)
        log_pt = torch.zeros(blk.n_c, dtype=cdt, device=z.device).index_add(0, blk.trl, realized)
        kd = losses.chunk_likelihood(log_ps, log_pt, spec.tau)  # [n_c]
        return kd, ce
    zt = z[:m] if t == 1.0 else z[:m] / t  # [m, V]
    lse = lse1[:m] if t == 1.0 else torch.logsumexp(zt, dim=-1)
    ids = _take(teacher["teacher_ids"], blk.t_sel)  # [M, k]
    lp = teacher.get("teacher_logprobs")
    cnt = teacher.get("teacher_counts")
    res = teacher.get("teacher_residual")
    log_p1, resid = losses.teacher_logprobs(ids, None if lp is None else _take(lp, blk.t_sel),
                                            None if cnt is None else _take(cnt, blk.t_sel),
                                            None if res is None else _take(res, blk.t_sel), cdt)
    valid = torch.isfinite(log_p1)
    v_teacher = spec.projection.teacher_vocab if spec.kind == "pkl" else zt.shape[1]  # the uniform tail's V
    log_p, p_rest = losses.temper_teacher(log_p1, resid, t, tail=spec.tail, vocab_size=v_teacher,
                                          valid=valid)  # [M, k], [M]
    if spec.kind == "pkl":
        kd = _pkl_block(zt, lse, blk, ids, log_p, p_rest, spec.projection, cdt)
    else:
        vocab = zt.shape[1]
        log_q = (zt.gather(1, ids.clamp(min=0)) - lse[:, None]).masked_fill(~valid, -math.inf)  # [m, k]
        support = torch.zeros((m, vocab + 1), dtype=torch.bool, device=z.device)
        support.scatter_(1, torch.where(valid, ids, vocab), True)  # padding lands in the extra column
        log_q_rest = losses.rest_logprob(zt, lse, support[:, :vocab])  # [m]
        log_p, p_rest = _drop_unreachable_rest(log_p, p_rest, support[:, :vocab].all(dim=-1))
        log_p_all = torch.cat([log_p, _log(p_rest)[:, None]], dim=-1)  # [m, k+1]
        log_q_all = torch.cat([log_q, log_q_rest[:, None]], dim=-1)
        kind = "kl" if spec.kind == "sampled" else spec.kind
        kd = losses.divergence(kind, log_p_all, log_q_all, beta=spec.beta)  # [m]
    return (kd if t == 1.0 else kd * t**2), ce


def _log(p: Tensor) -> Tensor:
    """log p with -inf at 0 and no NaN in backward."""
    pos = p > 0
    return torch.where(pos, torch.log(torch.where(pos, p, torch.ones_like(p))), torch.full_like(p, -math.inf))


def _drop_unreachable_rest(log_p: Tensor, p_rest: Tensor, no_rest: Tensor) -> tuple[Tensor, Tensor]:
    """The teacher over its support alone on rows whose student has no mass outside it (`no_rest`).

    There, the teacher's rest is mass on ids the student does not have (a full cache keeps the
    mass of the teacher lm_head's padding columns as its residual): it is dropped and the support
    renormalised, rather than a KL of +inf against a student rest of exactly 0.
    """
    drop = no_rest & (p_rest > 0)
    shift = torch.where(drop, torch.log1p(-p_rest.clamp(max=1.0 - 1e-7)), torch.zeros_like(p_rest))
    return log_p - shift[:, None], torch.where(drop, torch.zeros_like(p_rest), p_rest)


def _pkl_block(zt: Tensor, lse: Tensor, blk: Block, ids: Tensor, log_p: Tensor, p_rest: Tensor, projection,
               cdt) -> Tensor:
    """Projected KL of a block's chunks (docs/losses.md), with sparse matmuls by W and an exact rest.

    p_c = mean of the chunk's teacher rows over K_c, the union of their stored ids (dense over the
    teacher vocabulary for the block's chunks only: [C, V_t], no per-entry index plan);
    q_c = W^T pbar_c over K_c, pbar_c = mean of the chunk's student softmaxes;
    q_c(rest) = sum_s pbar_c(s) w_out_c(s), w_out_c = W (1 - 1_{K_c}) + 1_unmapped: a sum of
    non-negative terms (the share of each student token's mass that falls outside K_c), never
    1 - sum(q_c), so it keeps its digits at any outside mass.
    """
    n_c = blk.n_c
    dev = zt.device
    w, wt, unmapped = projection.matrices(cdt)
    v_t = wt.shape[0]
    t_w = blk.t_w.to(cdt)  # [M] 1 / rows of the row's chunk
    p_rows = log_p.exp()  # [M, k] (0 at padding)
    # teacher: K_c and p_c scattered into [C, V_t + 1] (padding: column V_t)
    flat = (torch.where(ids >= 0, ids, v_t) + (blk.trl * (v_t + 1))[:, None]).reshape(-1)  # [M k]
    p_c = torch.zeros(n_c * (v_t + 1), dtype=cdt, device=dev).index_put_(
        (flat,), (p_rows * t_w[:, None]).reshape(-1), accumulate=True).view(n_c, v_t + 1)[:, :v_t]
    in_k = torch.zeros(n_c * (v_t + 1), dtype=torch.bool, device=dev).index_put_(
        (flat,), torch.ones((), dtype=torch.bool, device=dev)).view(n_c, v_t + 1)[:, :v_t]  # [C, V_t] K_c
    del flat
    p_rest_c = torch.zeros(n_c, dtype=cdt, device=dev).index_add(0, blk.trl, p_rest * t_w)
    # student: chunk-averaged softmax, projected through W
    p_bar = torch.zeros((n_c, zt.shape[1]), dtype=cdt, device=dev).index_add(
        0, blk.cl, (zt - lse[:, None]).exp()) * blk.inv_npos.to(cdt)[:, None]  # [C, V_s]
    q_c = torch.sparse.mm(wt, p_bar.t()).t()  # [C, V_t]
    w_out = torch.sparse.mm(w, (~in_k).to(cdt).t()) + unmapped[:, None]  # [V_s, C]
    q_rest_c = (p_bar * w_out.t()).sum(dim=-1)  # [C]
    no_rest = (w_out == 0).all(dim=0)  # [C] every student id's mass lands inside the chunk's support
    drop = no_rest & (p_rest_c > 0)  # as _drop_unreachable_rest: renormalise K_c, no rest
    scale = torch.where(drop, 1.0 / (1.0 - p_rest_c.clamp(max=1.0 - 1e-7)), torch.ones_like(p_rest_c))  # [C]
    p_rest_c = torch.where(drop, torch.zeros_like(p_rest_c), p_rest_c)
    # KL over K_c = sum p log p - sum p log q, per chunk. The teacher's part needs no graph: with
    # p = s p_c, sum p log p = s sum p_c log p_c + s log s sum p_c. The cross part, linear in p_c, is
    # summed over the rows' stored entries (p_c is their t_w-weighted sum): O(M k), not O(C V_t)
    entropy = scale * torch.xlogy(p_c, p_c).sum(dim=-1) + torch.xlogy(scale, scale) * p_c.sum(dim=-1)  # [C]
    q_at = q_c[blk.trl[:, None], ids.clamp(min=0)]  # [M, k]
    cross_rows = (p_rows * q_at.clamp(min=losses.PROB_FLOOR).log()).sum(dim=-1) * t_w * scale[blk.trl]  # [M]
    cross = torch.zeros(n_c, dtype=cross_rows.dtype, device=dev).index_add(0, blk.trl, cross_rows)  # [C]
    return entropy - cross + losses.divergence("kl", _log(p_rest_c)[:, None], _log(q_rest_c)[:, None])  # [C]


# --------------------------------------------------------------------------------------------
# several teachers


COMBINE = ("sum", "dynamic", "select", "mean-probs")
SCORES = ("likelihood", "entropy", "max-prob")


class MixPrepared:
    """A micro-batch of N teachers planned for `TeacherMix`: one `Prepared` per teacher view, the chunk
    group of every chunk and row, and which teacher is present in which group (host-counted)."""

    def __init__(self, preps: list[Prepared], chunk_group: list[Tensor], row_group: list[Tensor],
                 present: Tensor, group_rows: Tensor, *, chunks: int, tokens: int, valid_pos: int):
        self.preps, self.chunk_group, self.row_group = preps, chunk_group, row_group
        self.present, self.group_rows = present, group_rows  # bool [N, G], float [N, G] rows per group
        self.chunks, self.tokens, self.valid_pos = chunks, tokens, valid_pos

    def to(self, device) -> "MixPrepared":
        for p in self.preps:
            p.to(device)
        self.chunk_group = [g.to(device, non_blocking=True) for g in self.chunk_group]
        self.row_group = [g.to(device, non_blocking=True) for g in self.row_group]
        self.present = self.present.to(device, non_blocking=True)
        self.group_rows = self.group_rows.to(device, non_blocking=True)
        return self


class TeacherMix:
    """The training objective over N >= 1 teachers (one cache each): per-teacher KD terms per chunk
    group, combined with per-group weights (docs/losses.md, "Several teachers").

    A chunk group is the smallest span of student tokens that whole chunks of every teacher cover
    (`stage2_student.loader.common_boundaries`); a teacher's KD term of a group is the sum of its
    chunks' terms there. With weights w_i(g) (summing to 1 over the teachers present in g):

        KD = sum_g sum_i w_i(g) KD_i(g)   (normalised by the global group count, like one teacher's chunks)

      sum:        w_i(g) = lambda_i / sum_present lambda_j            (static --teacher-weights)
      dynamic:    w_i(g) = softmax_i(alpha * score_i(g) + log lambda_i)  (score: --teacher-score)
      select:     w_i(g) = 1 for the teacher with the highest likelihood of the group's text, else 0
      mean-probs: one KD term against the mixture sum_i lambda_i p_i (teachers sharing a vocabulary),
                  built on the host (`mix_views`)

    One teacher is the case N = 1 (w = 1, groups = chunks). CE is computed once, in the first
    teacher's pass (`Objective(with_ce=False)` for the others). Scores and weights are computed on
    the device from the teacher tensors and never read back.
    """

    def __init__(self, objectives: list[Objective], *, combine: str = "sum", weights: list[float] | None = None,
                 score: str = "likelihood", alpha: float = 1.0, vocab_sizes: list[int] | None = None):
        if combine not in COMBINE:
            raise ConfigError(f"--teacher-combine {combine!r}: choose one of {', '.join(COMBINE)}")
        if score not in SCORES:
            raise ConfigError(f"--teacher-score {score!r}: choose one of {', '.join(SCORES)}")
        n_views = len(weights) if weights else len(objectives)
        weights = list(weights) if weights else [1.0] * n_views
        if any(w < 0 for w in weights) or sum(weights) <= 0:
            raise ConfigError(f"--teacher-weights {','.join(map(str, weights))}: non-negative, not all 0")
        if combine == "mean-probs" and len(objectives) != 1:
            raise ValueError("mean-probs trains on one mixture teacher: give one objective")
        if combine != "mean-probs" and len(objectives) != n_views:
            raise ConfigError(f"--teacher-weights: {n_views} weights for {len(objectives)} caches")
        self.objectives, self.combine, self.score, self.alpha = objectives, combine, score, float(alpha)
        self.vocab_sizes = vocab_sizes  # each teacher's vocabulary: the entropy score spreads the rest over it
        self.lam = [w / sum(weights) for w in weights]
        self.num_views = n_views
        first = objectives[0]
        self.kd_weight, self.ce_weight = first.kd_weight, first.ce_weight
        self.spec, self.projection = first.spec, first.projection

    @property
    def kind(self) -> str | None:
        """The KD kind (one teacher), or the teachers' kinds joined by '+'."""
        kinds = [o.kind for o in self.objectives]
        return kinds[0] if len(kinds) == 1 or kinds[0] is None else "+".join(str(k) for k in kinds)

    @property
    def num_teachers(self) -> int:
        return len(self.objectives)

    def to(self, device) -> "TeacherMix":
        """Put every teacher's objective (its projection W) on the trainer's device."""
        for o in self.objectives:
            o.to(device)
        return self

    # ----------------------------------------------------------------- host side
    @staticmethod
    def counts(batch: dict) -> tuple[int, int]:
        """(valid chunk groups, labelled tokens) of a CPU micro-batch (one teacher: groups = chunks)."""
        return int(batch.get("num_groups", batch.get("num_chunks", 0))), int((batch["labels"] != -100).sum())

    def views(self, batch: dict) -> list[dict]:
        """The single-teacher micro-batches the objectives see (mean-probs: the one mixture view)."""
        from stage2_student.loader import num_teachers, teacher_view

        n = num_teachers(batch)
        if n == 1 and "teacher_ids" not in batch and not batch.get("num_chunks", 0):  # no teacher data (dummy_batch)
            return [teacher_view(batch, 0)] * len(self.objectives)
        if n != self.num_views:
            raise ConfigError(f"a micro-batch of {n} teacher(s) for an objective of {self.num_views}")
        views = [teacher_view(batch, i) for i in range(n)]
        return [mix_views(views, self.lam)] if self.combine == "mean-probs" else views

    def prepare(self, batch: dict, *, vocab: int) -> MixPrepared:
        views = self.views(batch)
        n_groups, tokens = self.counts(batch)
        preps = [o.prepare(v, vocab=vocab) for o, v in zip(self.objectives, views)]
        chunk_group, row_group = [], []
        present = np.zeros((len(views), n_groups), dtype=bool)
        rows = np.zeros((len(views), n_groups), dtype=np.float64)
        for i, v in enumerate(views):
            n_c = int(v.get("num_chunks", 0))
            cg = v["chunk_group"].numpy() if "chunk_group" in v else np.arange(n_c, dtype=np.int64)
            if cg.size and int(cg.max()) >= n_groups:
                raise XtcacheError(f"teacher {i}: chunk group {int(cg.max())} of {n_groups} groups")
            rg = cg[v["teacher_chunk"].numpy()] if n_c else np.zeros(0, dtype=np.int64)
            present[i, cg] = True
            rows[i] = np.bincount(rg, minlength=n_groups)
            chunk_group.append(torch.from_numpy(cg))
            row_group.append(torch.from_numpy(rg))
        return MixPrepared(preps, chunk_group, row_group, torch.from_numpy(present), torch.from_numpy(rows),
                           chunks=n_groups, tokens=tokens, valid_pos=preps[0].valid_pos)

    # ----------------------------------------------------------------- device side
    def terms(self, logits: Tensor, prep: MixPrepared) -> tuple[Tensor, Tensor]:
        """(KD term of every teacher and chunk group [N, G], CE sum), on device."""
        if len(self.objectives) == 1:  # one teacher: its objective's own terms (a subclass may refine them)
            kd, ce = self.objectives[0].terms(logits, prep.preps[0])
            kds = [kd]
        else:
            kds, ce = blocked_terms(logits, [(o.spec, p) for o, p in zip(self.objectives, prep.preps)])
        rows = [torch.zeros(prep.chunks, dtype=kd.dtype, device=kd.device).index_add(0, cg, kd)
                for kd, cg in zip(kds, prep.chunk_group)]
        return torch.stack(rows), ce

    @torch.no_grad()
    def weights(self, prep: MixPrepared) -> Tensor:
        """w [N, G]: each group's weights over the teachers present in it (0 where absent)."""
        present = prep.present
        dev = present.device
        lam = torch.tensor(self.lam if self.combine != "mean-probs" else [1.0], dtype=torch.float64, device=dev)
        if self.combine in ("sum", "mean-probs"):
            w = lam[:, None] * present
        else:
            score = self.scores(prep, "likelihood" if self.combine == "select" else self.score)
            score = score.double().masked_fill(~present, -math.inf)
            if self.combine == "select":
                w = torch.zeros_like(score).scatter_(0, score.argmax(dim=0, keepdim=True), 1.0) * present
            else:
                w = torch.softmax(self.alpha * score + lam.log()[:, None], dim=0).nan_to_num(0.0)
        return w / w.sum(dim=0, keepdim=True).clamp_min(1e-30)

    def scores(self, prep: MixPrepared, score: str) -> Tensor:
        """score_i(g) [N, G]: the log-likelihood of the group's realized teacher tokens (summed over its
        rows), or minus the mean entropy / the mean max probability of the teacher's rows there. The
        entropy spreads a row's rest mass evenly over the ids it did not store (`vocab_sizes`): one
        rest bucket would make a near-uniform teacher, whose mass is nearly all rest, look confident."""
        dev = prep.present.device
        out = torch.zeros(prep.present.shape, dtype=torch.float32, device=dev)
        for i, (p, rg) in enumerate(zip(prep.preps, prep.row_group)):
            if not p.teacher or rg.shape[0] == 0:
                continue
            t = p.teacher
            if score == "likelihood":
                per_row = t["teacher_realized"].float()
            else:
                log_p, resid = losses.teacher_logprobs(t["teacher_ids"], t.get("teacher_logprobs"),
                                                       t.get("teacher_counts"), t.get("teacher_residual"),
                                                       torch.float32)
                probs = log_p.exp()
                if score == "entropy":  # minus the entropy, the rest spread evenly over the unstored ids
                    rest = resid.clamp(min=0.0)
                    n_rest = max((self.vocab_sizes[i] if self.vocab_sizes else 1) - log_p.shape[1], 1)
                    plogp = torch.where(probs > 0, probs * log_p.clamp(min=-1e30), torch.zeros_like(probs))
                    per_row = plogp.sum(dim=-1) + torch.where(rest > 0, rest * (_log(rest) - math.log(n_rest)),
                                                              torch.zeros_like(rest))
                else:
                    per_row = probs.max(dim=-1).values
            out[i].index_add_(0, rg, per_row)
            if score != "likelihood":
                out[i] = out[i] / prep.group_rows[i].float().clamp_min(1.0)
        return out

    def __call__(self, logits: Tensor, prep: MixPrepared, *, chunks_total: float, tokens_total: float
                 ) -> tuple[Tensor, dict]:
        """(loss to backpropagate, on-device metric sums) of one micro-batch; per-teacher sums [N] in the
        metrics: `teacher_kd` (KD over the groups the teacher is in), `teacher_groups`, `teacher_weight`
        (sum of its weights: for select, the groups it was chosen for), `teacher_agree`, `teacher_agree_n`."""
        kd, ce_sum = self.terms(logits, prep)
        w = self.weights(prep)
        kd_sum = (w.to(kd.dtype) * kd).sum()
        loss = self.objectives[0].loss(kd_sum, ce_sum, chunks=prep.chunks, tokens=prep.tokens,
                                       chunks_total=chunks_total, tokens_total=tokens_total)
        agree = [o.agreement(logits, p) for o, p in zip(self.objectives, prep.preps)]
        pres = prep.present.to(kd.dtype)
        return loss, {"kd_sum": kd_sum.detach(), "ce_sum": ce_sum.detach(), "agree": agree[0][0],
                      "agree_n": agree[0][1], "teacher_kd": (kd.detach() * pres).sum(dim=1),
                      "teacher_groups": pres.sum(dim=1), "teacher_weight": w.sum(dim=1),
                      "teacher_agree": torch.stack([a for a, _ in agree]),
                      "teacher_agree_n": torch.stack([n for _, n in agree])}


def mix_views(views: list[dict], lam: list[float]) -> dict:
    """The mixture teacher sum_i lam_i p_i of teachers that share a vocabulary and a tokenization, as one
    single-teacher view: per row the union of the stored ids, their mixed probabilities, the mixed
    rest mass sum_i lam_i r_i and the mixture's likelihood of the realized token (host, numpy)."""
    base = views[0]
    for i, v in enumerate(views[1:], start=1):
        if int(v["num_chunks"]) != int(base["num_chunks"]) or not torch.equal(v["teacher_chunk"],
                                                                              base["teacher_chunk"]):
            raise ConfigError(f"--teacher-combine mean-probs: teacher {i} chunks the text differently from teacher 0 "
                              "(another tokenization or prediction rows): use sum, dynamic or select")
    r = base["teacher_chunk"].shape[0]
    ids_l, p_l = [], []
    resid = np.zeros(r, dtype=np.float64)
    realized = np.zeros(r, dtype=np.float64)
    for lam_i, v in zip(lam, views):
        ids = v["teacher_ids"].numpy().astype(np.int64)
        if "teacher_logprobs" in v:
            p = np.exp(v["teacher_logprobs"].numpy().astype(np.float64))
            rest = v["teacher_residual"].numpy().astype(np.float64)
        else:
            c = v["teacher_counts"].numpy().astype(np.float64)
            p, rest = c / np.maximum(c.sum(axis=1, keepdims=True), 1.0), np.zeros(r)
        p = np.where(ids >= 0, p, 0.0)
        ids_l.append(ids)
        p_l.append(lam_i * p)
        resid += lam_i * np.clip(rest, 0.0, 1.0)
        realized += lam_i * np.exp(v["teacher_realized"].numpy().astype(np.float64))
    ids, p = np.concatenate(ids_l, axis=1), np.concatenate(p_l, axis=1)  # [R, sum k]
    row, col = np.nonzero(ids >= 0)
    keys, inv = np.unique(row * (int(ids.max(initial=0)) + 1) + ids[row, col], return_inverse=True)
    mass = np.bincount(inv.reshape(-1), weights=p[row, col], minlength=keys.size)
    width = int(ids.max(initial=0)) + 1
    k_row, k_id = keys // width, keys % width
    n_per = np.bincount(k_row, minlength=r)
    slot = np.arange(keys.size) - (np.cumsum(n_per) - n_per)[k_row]
    k = max(int(n_per.max(initial=0)), 1)
    out_ids = np.full((r, k), -1, dtype=np.int64)
    out_lp = np.full((r, k), -np.inf, dtype=np.float32)
    out_ids[k_row, slot] = k_id
    with np.errstate(divide="ignore"):
        out_lp[k_row, slot] = np.log(mass)
    view = {key: val for key, val in base.items() if key not in ("teacher_counts", "teacher_logprobs")}
    view.update(teacher_ids=torch.from_numpy(out_ids), teacher_logprobs=torch.from_numpy(np.where(
        out_ids >= 0, out_lp, 0.0).astype(np.float32)), teacher_residual=torch.from_numpy(resid.astype(np.float32)),
        teacher_realized=torch.from_numpy(np.log(np.maximum(realized, 1e-30)).astype(np.float32)))
    return view


__all__ = ["Capabilities", "Objective", "Prepared", "TeacherMix", "MixPrepared", "mix_views", "COMBINE", "SCORES", "resolve_kind", "measure_definition", "NoValidChunksError",
           "EmptyMappedSupportError"]
