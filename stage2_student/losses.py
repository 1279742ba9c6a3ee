"""Stage 2 distillation losses: the math of one block of student rows, as pure functions.

`stage2_student.objective.Objective` cuts a micro-batch into blocks of student logit rows, calls
these functions on one block at a time (fp32, fp64 for fp64 logits) and recomputes them in
backward (docs/losses.md, "Memory"). Each function states its formula; tensor shapes are in the
comments. Nothing here reads a tensor back to the host.

The student's mass outside a support (the "rest bucket") is never `1 - sum(q)`: that subtraction
loses every digit when the student puts less than ~1e-6 outside the support. It is the
log-sum-exp of the logits outside the support (`rest_logprob`), exact at any outside mass.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from xtcache.errors import ProjectionError, XtcacheError

PROB_FLOOR = 1e-12  # probabilities are floored here before a log (a teacher rest of exactly 0 stays 0)
LOG_FLOOR = math.log(PROB_FLOOR)
_LN2 = math.log(2.0)


class NoValidChunksError(XtcacheError):
    """A micro-batch reached the loss without a single valid chunk."""


class EmptyMappedSupportError(ProjectionError):
    """No student token maps (through W) onto any teacher id stored for the batch."""


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the loss math runs in: fp64 for fp64 logits (the gradient tests), else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def log1mexp(x: Tensor) -> Tensor:
    """log(1 - exp(x)) for x <= 0, stable at both ends; x is clamped to <= -1e-20 (result finite)."""
    x = x.clamp(max=-1e-20)
    near_zero = x > -_LN2
    a = torch.log(-torch.expm1(torch.where(near_zero, x, torch.full_like(x, -_LN2))))
    b = torch.log1p(-torch.exp(torch.where(near_zero, torch.full_like(x, -_LN2), x)))
    return torch.where(near_zero, a, b)


# --------------------------------------------------------------------------------------------
# teacher side


def teacher_logprobs(ids: Tensor, logprobs: Tensor | None, counts: Tensor | None, residual: Tensor | None,
                     dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The teacher row distribution at T = 1 over its stored ids: (log p [R, k], residual [R]).

    top-k / full caches: the stored log-probs and residual. Sampled caches: the empirical
    distribution counts / N with residual 0 (E[counts / N] = p: an unbiased estimate of the
    teacher, as in RS-KD). Padding (id < 0, or count 0) gets log p = -inf.
    """
    if logprobs is not None:
        lp = logprobs.to(dtype).masked_fill(ids < 0, -math.inf)
        return lp, residual.to(dtype)
    c = counts.to(dtype).masked_fill(ids < 0, 0.0)  # [R, k]
    n = c.sum(dim=-1, keepdim=True).clamp(min=1.0)
    lp = torch.where(c > 0, torch.log(c.clamp(min=1.0) / n), torch.full_like(c, -math.inf))
    return lp, torch.zeros(c.shape[0], dtype=dtype, device=c.device)


def temper_teacher(logprobs: Tensor, residual: Tensor, temperature: float = 1.0, *,
                   tail: str = "ghost", vocab_size: int | None = None,
                   valid: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Teacher distribution at temperature T over the stored support plus one rest bucket.

    The cache stores T=1 log-probs of k ids and the residual mass r. Exact re-tempering needs the
    unstored tail, so the tail is modelled:
      tail="ghost":   the rest is ONE token with probability r: rest_T ∝ r^(1/T). For T > 1 this
                      is a lower bound of the true tempered tail mass (x^(1/T) is concave).
      tail="uniform": the rest is spread evenly over the V - k unstored ids:
                      rest_T ∝ (V - k) (r / (V - k))^(1/T), an upper bound for T > 1.
    The true value lies between the two; at T = 1 both are exact. Support and rest are then
    normalized together (this also absorbs quantization error of the stored log-probs).

    logprobs: [R, k]; residual: [R]; valid: bool [R, k], False for padding (excluded; its log-prob
    comes back as -inf). Returns (log p [R, k], p_rest [R]); p_rest is exactly 0 where the
    residual is <= 0 (full-vocab caches). fp32 (fp64 for fp64 inputs).
    """
    cdt = compute_dtype(logprobs.dtype)
    lp = logprobs.to(cdt) / temperature  # [R, k]
    if valid is not None:
        lp = lp.masked_fill(~valid, -math.inf)
    r = residual.to(cdt)
    has_rest = r > 0
    log_r = torch.log(r.clamp(min=PROB_FLOOR))
    if tail == "uniform":
        if vocab_size is None:
            raise ValueError("temper_teacher(tail='uniform') needs vocab_size")
        n_tail = math.log(float(max(vocab_size - logprobs.shape[-1], 1)))
        rest = (log_r - n_tail) / temperature + n_tail
    elif tail == "ghost":
        rest = log_r / temperature
    else:
        raise ValueError(f"teacher tail model {tail!r}: use 'ghost' or 'uniform'")
    rest = torch.where(has_rest, rest, torch.full_like(rest, -math.inf))  # [R]
    lse = torch.logsumexp(torch.cat([lp, rest[:, None]], dim=-1), dim=-1)  # [R]
    return lp - lse[:, None], torch.exp(rest - lse)


# --------------------------------------------------------------------------------------------
# student side


def rest_logprob(z: Tensor, lse: Tensor, outside: Tensor) -> Tensor:
    """log of the student's mass outside a support, exact: logsumexp(z[outside]) - lse, [b].

    z [b, V] (already divided by T), lse [b] its log-partition, outside: either a bool mask
    [b, V] of the support (True = in the support) or a float [b, V] of log-weights added to z
    (log of the share of each student id that falls outside; -inf = none). Rows with nothing
    outside get -inf (their masked row is replaced by z first, so no NaN reaches backward).
    """
    if outside.dtype == torch.bool:
        full = outside.all(dim=-1)  # [b]
        masked = z.masked_fill(outside & ~full[:, None], -math.inf)
    else:
        full = torch.isneginf(outside).all(dim=-1)
        masked = z + outside.masked_fill(full[:, None], 0.0)
    rest = torch.logsumexp(masked, dim=-1) - lse
    return torch.where(full, torch.full_like(rest, -math.inf), rest)


def _kl_terms(a: Tensor, log_a: Tensor, log_b: Tensor) -> Tensor:
    """a * (log a - log b) with 0 where a == 0 (no NaN in forward or backward)."""
    pos = a > 0
    zero = torch.zeros((), dtype=a.dtype, device=a.device)
    return torch.where(pos, a * (torch.where(pos, log_a, zero) - torch.where(pos, log_b, zero)), zero)


def divergence(kind: str, log_p: Tensor, log_q: Tensor, *, beta: float = 0.5) -> Tensor:
    """Per-row divergence between teacher p and student q over support + rest, [m].

    log_p, log_q: [m, n] log-probabilities over the same n buckets (-inf = probability 0).
      kl:  KL(p || q) = sum p (log p - log q)                     (forward, mass covering)
      rkl: KL(q || p) = sum q (log q - log p), log p floored at log PROB_FLOOR (mode seeking)
      jsd: beta KL(p || m) + (1 - beta) KL(q || m), m = beta p + (1 - beta) q
           (generalized JSD, Agarwal et al. 2024, the form of TRL's generalized_jsd_loss)
    """
    p = log_p.exp()
    if kind == "kl":
        return _kl_terms(p, log_p, log_q).sum(dim=-1)
    q = log_q.exp()
    if kind == "rkl":
        return _kl_terms(q, log_q, log_p.clamp(min=LOG_FLOOR)).sum(dim=-1)
    if kind == "jsd":  # -1e4: a finite stand-in for log 0 (exp underflows to 0 exactly), no NaN in backward
        lp, lq = log_p.clamp(min=-1e4), log_q.clamp(min=-1e4)
        log_m = torch.logaddexp(lp + math.log(beta), lq + math.log(1.0 - beta))  # [m, n]
        return (beta * _kl_terms(p, log_p, log_m) + (1.0 - beta) * _kl_terms(q, log_q, log_m)).sum(dim=-1)
    raise ValueError(f"divergence {kind!r}: use kl, rkl or jsd")


def chunk_likelihood(log_ps: Tensor, log_pt: Tensor, tau: float) -> Tensor:
    """ALM chunk-likelihood loss per chunk (tokenkit, Minixhofer et al. 2025), [C].

    a = exp(log P_T(c) / tau), b = exp(log P_S(c) / tau),
    loss_c = -[a log b + (1 - a) log(1 - b)], with log(1 - b) = log1mexp(log P_S / tau).
    """
    a = torch.exp(log_pt / tau)
    log_b = (log_ps / tau).clamp(max=-1e-20)
    return -(a * log_b + (1.0 - a) * log1mexp(log_b))


# --------------------------------------------------------------------------------------------
# cross tokenizer: the projection W


class ProjectionOperator:
    """The projection W (student vocab -> teacher vocab), sparse, rows summing to 1 (or empty).

    Built once per run from `ProjectionMap.to_torch_sparse(teacher_vocab)` (sparse [V_s, V_t]);
    never made dense. The loss multiplies blocks of student probabilities by W with sparse
    matmuls (`W^T p` for the projected probabilities, `W (1 - 1_K)` for the share of each student
    token's mass that falls outside a support K); `t_counts` (how many W entries point at each
    teacher id, on the host) lets the planner refuse a batch nothing maps onto; `student_top` is
    the most-weighted teacher id of every student token (-1 if unmapped), for top-1 agreement.
    """

    def __init__(self, w: Tensor):
        w = w.to_sparse_coo().coalesce() if w.layout != torch.sparse_coo else w.coalesce()
        self.student_vocab, self.teacher_vocab = int(w.shape[0]), int(w.shape[1])
        keep = w.values() > 0
        s, t = w.indices()[0][keep].cpu(), w.indices()[1][keep].cpu()
        val = w.values()[keep].detach().cpu().double()
        self.t_counts = np.bincount(t.numpy(), minlength=self.teacher_vocab)
        order = torch.argsort(s * self.teacher_vocab - val / (val.max() + 1.0), stable=True)  # heaviest first
        first = torch.ones(order.numel(), dtype=torch.bool)
        first[1:] = s[order][1:] != s[order][:-1]
        self.student_top = torch.full((self.student_vocab,), -1, dtype=torch.int64)
        self.student_top[s[order][first]] = t[order][first]
        self._indices, self._values = torch.stack([s, t]), val
        # W, W^T and `unmapped` (fp64) checked and coalesced here, on the host: on a GPU both read the
        # number of entries back, which the loss must not do (it only moves and casts them)
        idx = self._indices
        self._host = (
            torch.sparse_coo_tensor(idx, val, (self.student_vocab, self.teacher_vocab), check_invariants=True).coalesce(),
            torch.sparse_coo_tensor(idx.flip(0), val, (self.teacher_vocab, self.student_vocab),
                                    check_invariants=True).coalesce(),
            torch.ones(self.student_vocab, dtype=torch.float64).index_fill_(0, s, 0.0))
        self._device = torch.device("cpu")
        self._by_dtype: dict = {}

    def to(self, device) -> "ProjectionOperator":
        """Move the operator to `device` (the trainer's; a no-op when it is there already)."""
        device = torch.device(device)
        if device != self._device:
            self._device, self._by_dtype = device, {}
            self.student_top = self.student_top.to(device)
        return self

    def matrices(self, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
        """(W [V_s, V_t], W^T [V_t, V_s]) sparse COO on the device, and `unmapped` [V_s] (1.0 for a
        student token with no entry), in `dtype`; moved once per dtype, never read back."""
        if dtype not in self._by_dtype:
            self._by_dtype[dtype] = tuple(m.to(device=self._device, dtype=dtype) for m in self._host)
        return self._by_dtype[dtype]

    def dense(self) -> Tensor:
        """W as a dense fp64 [V_s, V_t] (tests and tiny vocabularies only)."""
        out = torch.zeros(self.student_vocab, self.teacher_vocab, dtype=torch.float64)
        out[self._indices[0], self._indices[1]] = self._values
        return out
