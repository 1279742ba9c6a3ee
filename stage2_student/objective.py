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
                 measure_agreement: bool = True, row_chunk: int = ROW_CHUNK):
        if kind is not None and kind not in KINDS:
            raise ValueError(f"--loss {kind!r}: use {', '.join(KINDS)}")
        if kind == "pkl" and projection is None:
            raise ProjectionError("--loss pkl needs a projection map (--projection, or built from both tokenizers)")
        self.kind, self.projection = kind, projection
        self.kd_weight, self.ce_weight, self.dynamic_scaling = kd_weight, ce_weight, dynamic_scaling
        self.row_chunk = int(row_chunk)
        self.spec = _Spec(kind, 1.0 if kind == "sampled" else float(temperature), jsd_beta, alm_tau, teacher_tail,
                          projection)
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
        ce_pos = np.nonzero(labels != -100)[0]
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
        return Prepared(plan, teacher, agree, chunks=n_chunks, tokens=int(ce_pos.size),
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
            blocks.append(Block(pos=torch.from_numpy(pos), n_kd=0, ce_loc=torch.arange(pos.size),
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
                fields = dict(n_kd=int(t_rows.size), t_sel=_rows_selector(t_rows))
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
    def sums(self, logits: Tensor, prep: Prepared) -> tuple[Tensor, Tensor]:
        """(sum of KD over the micro-batch's chunks, sum of CE over its labelled tokens), on device."""
        flat = logits.reshape(-1, logits.shape[-1])  # [N, V]
        if not prep.blocks:
            zero = flat.sum().to(losses.compute_dtype(flat.dtype)) * 0.0  # keeps the graph for backward
            return zero, zero
        out = _BlockedTerms.apply(flat, self.spec, prep)
        return out[0], out[1]

    def __call__(self, logits: Tensor, prep: Prepared, *, chunks_total: float, tokens_total: float
                 ) -> tuple[Tensor, dict]:
        """(loss to backpropagate, on-device metric sums) of one micro-batch."""
        kd_sum, ce_sum = self.sums(logits, prep)
        loss = ce_sum * (self.ce_weight / max(tokens_total, 1.0))
        if self.kind is not None and prep.chunks:
            w = self.kd_weight
            if self.dynamic_scaling:  # w = sg(|CE| / |KD|), both as this micro-batch's means
                ce_mean = ce_sum.detach() / max(prep.tokens, 1)
                w = w * ce_mean.abs() / (kd_sum.detach() / prep.chunks).abs().clamp_min(1e-12)
            loss = loss + kd_sum * (w / max(chunks_total, 1.0))
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


class _BlockedTerms(torch.autograd.Function):
    """(KD sum, CE sum) over the blocks of a micro-batch; backward recomputes block by block.

    Backward allocates the gradient of the logits (the only [N, V] tensor) and, per block,
    re-runs `_block_terms` with autograd on a copy of the block's rows, adding its gradient in.
    """

    @staticmethod
    def forward(ctx, logits, spec, prep):
        cdt = losses.compute_dtype(logits.dtype)
        out = torch.zeros(2, dtype=cdt, device=logits.device)
        for blk in prep.blocks:
            out += _block_terms(spec, logits.index_select(0, blk.pos), blk, prep.teacher)
        ctx.save_for_backward(logits)
        ctx.spec, ctx.prep = spec, prep
        return out

    @staticmethod
    def backward(ctx, grad_out):
        (logits,) = ctx.saved_tensors
        grad = torch.zeros_like(logits)
        for blk in ctx.prep.blocks:
            with torch.enable_grad():
                z = logits.index_select(0, blk.pos).detach().requires_grad_(True)
                (gz,) = torch.autograd.grad(_block_terms(ctx.spec, z, blk, ctx.prep.teacher), z, grad_out)
            grad.index_add_(0, blk.pos, gz)
            del z, gz
        return grad, None, None


def _block_terms(spec: _Spec, z_rows: Tensor, blk: Block, teacher: dict) -> Tensor:
    """[KD sum, CE sum] of one block. z_rows: the block's logit rows [b, V] in the logits' dtype."""
    cdt = losses.compute_dtype(z_rows.dtype)
    z = z_rows.to(cdt)
    zero = torch.zeros((), dtype=cdt, device=z.device)
    t = spec.temperature
    lse1 = torch.logsumexp(z, dim=-1)  # [b]
    ce = zero
    if blk.ce_loc.shape[0]:
        ce = -(z[blk.ce_loc, blk.ce_lab] - lse1[blk.ce_loc]).sum()
    if spec.kind is None or blk.n_kd == 0:
        return torch.stack([zero, ce])
    m = blk.n_kd
    if spec.kind == "alm":
        lq = z[:m].gather(1, blk.a_lab[:, None])[:, 0] - lse1[:m]  # [P] label log-probs at T=1
        log_ps = torch.zeros(blk.n_c, dtype=cdt, device=z.device).index_add(0, blk.cl, lq)
        realized = _take(teacher["teacher_realized"], blk.t_sel).to(cdt)
        log_pt = torch.zeros(blk.n_c, dtype=cdt, device=z.device).index_add(0, blk.trl, realized)
        return torch.stack([losses.chunk_likelihood(log_ps, log_pt, spec.tau).sum(), ce])
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
    log_p, p_rest = losses.temper_teacher(log_p1, resid, t, tail=spec.tail, valid=valid)  # [M, k], [M]
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
        kd = losses.divergence(kind, log_p_all, log_q_all, beta=spec.beta).sum()
    return torch.stack([kd * t**2, ce])


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
    # KL over K_c = sum p log p - sum p log q. The teacher's part needs no graph: with p = s p_c,
    # sum p log p = s sum p_c log p_c + s log s sum p_c. The cross part, linear in p_c, is summed
    # over the rows' stored entries (p_c is their t_w-weighted sum): O(M k), not O(C V_t)
    entropy = (scale * torch.xlogy(p_c, p_c).sum(dim=-1) + torch.xlogy(scale, scale) * p_c.sum(dim=-1)).sum()
    q_at = q_c[blk.trl[:, None], ids.clamp(min=0)]  # [M, k]
    cross = (p_rows * (t_w * scale[blk.trl])[:, None] * q_at.clamp(min=losses.PROB_FLOOR).log()).sum()
    return entropy - cross + losses.divergence("kl", _log(p_rest_c)[:, None], _log(q_rest_c)[:, None]).sum()


__all__ = ["Capabilities", "Objective", "Prepared", "resolve_kind", "measure_definition", "NoValidChunksError",
           "EmptyMappedSupportError"]
