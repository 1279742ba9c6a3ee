"""On-policy distillation on the student's own samples: the reverse-KL signal as a policy gradient.

`--loss rkl-pg` trains on rollouts the student sampled (`xtcache generate`) and the teacher scored
(`teacher-dump`), using only the teacher's log-prob of the sampled text (`teacher_realized`, which
every cache stores in every mode). `stage2_student.blocked` sums the log-probs of a chunk's tokens on
each side and calls `reverse_kl_pg` per chunk; a same-tokenizer chunk is one token, so the chunk
signal is the per-token one. docs/on-policy.md has the formulas, the estimator's bias and how GKD,
TRL, NeMo-RL and the Tinker cookbook compare.

    kd = reverse_kl_pg(log_ps, log_pt, log_pb, is_cap=2.0)     # [C], backward: the policy gradient
    staleness(logits, batch, cap=2.0)   # [4]: sum |log p_s - log p_b|, ratios over the cap, labels read, labels
"""

from __future__ import annotations

import logging
import math

import torch
from torch import Tensor

from xtcache.errors import ConfigError, XtcacheError

log = logging.getLogger(__name__)
_warned_unsampled = False  # the warning below, once per process


def truncated_ratio(log_ps: Tensor, log_pb: Tensor, cap: float) -> Tensor:
    """w = min(exp(log p_s - log p_b), cap), computed in log space (no overflow), no gradient, [C].

    Truncated importance sampling (Ionides 2008; IMPALA's rho-bar; Yao et al. 2025's TIS for
    sampler/learner mismatch): the ratio of the student being trained to the policy that sampled, per
    chunk (the product of its tokens' ratios), capped from above only. A ratio of exactly 1 (the
    policy has not moved) gives w = 1 for any cap >= 1.
    """
    return torch.exp(torch.clamp(log_ps.detach() - log_pb, max=math.log(cap)))


def reverse_kl_pg(log_ps: Tensor, log_pt: Tensor, log_pb: Tensor | None = None, *, is_cap: float = 0.0) -> Tensor:
    """Per-chunk reverse-KL policy-gradient surrogate on sampled text, [C].

    log_ps [C]: the student's log-prob of the chunk's sampled tokens, sum over the chunk (with grad);
    log_pt [C]: the teacher's, the sum of the stored realized log-probs of the chunk's teacher rows;
    log_pb [C] or None: the sampling policy's (the stored sampling log-probs summed over the chunk).

        r_c = log p_s(y_c) - log p_t(y_c)                 (advantage A_c = -r_c: Tinker cookbook, MiniLLM)
        w_c = min(exp(log p_s(y_c) - log p_b(y_c)), C)    (truncated ratio; w_c = 1 when log_pb is None)
        value_c    = w_c r_c                              (its expectation over y ~ p_b, uncapped: KL(p_s || p_t))
        gradient_c = w_c r_c grad log p_s(y_c)            (w_c, r_c held constant: REINFORCE with A_c = -r_c)

    With y ~ p_s (w = 1), E[r grad log p_s] = grad KL(p_s || p_t) at each position given its prefix
    (E[grad log p_s] = 0 removes the term from differentiating r itself). The surrogate's value is the
    sampled estimate of that KL, so the objective's KD metric reads as a reverse KL.
    """
    r = (log_ps - log_pt).detach()  # [C]
    wr = r if log_pb is None or is_cap <= 0 else truncated_ratio(log_ps, log_pb, is_cap) * r
    return wr + wr * (log_ps - log_ps.detach())  # value wr, gradient wr * grad log_ps


SAMPLED_KEY = "sampled_logprobs"  # float32 [B, L]: at logit (b, i), the sampling policy's log-prob of labels[b, i]


def behaviour_rows(batch: dict, rows, is_cap: float) -> Tensor | None:
    """The sampling log-probs of a block's KD rows (`rows`: flat logit positions), float32 [P], or None
    without a ratio (`--is-cap 0`). Host side, in `Objective.prepare`: raises when the batch carries no
    sampling log-probs, or none at a trained row outside the sampled turns (`--train-on` trains a prompt).
    With `--train-on last-assistant` a row without one lies in a rollout turn stored without them (its sampled
    ids do not spell its text, counted by `xtcache inspect` and rounds' `retokenized_turns`; a cache holding rows
    that are no rollouts of this student is refused before training, `stage2_student.data`): it stays NaN, and
    its chunk trains without the ratio (w = 1, `stage2_student.blocked`), logged once."""
    global _warned_unsampled
    if is_cap <= 0:
        return None

    if SAMPLED_KEY not in batch:
        raise ConfigError(f"--loss rkl-pg with --is-cap {is_cap:g}: the micro-batch carries no sampling log-probs "
                          f"({SAMPLED_KEY}), so the importance ratio cannot be computed; use --is-cap 0 to train "
                          "without it (biased once the student has moved away from the policy that sampled, "
                          "docs/on-policy.md)")
    out = batch[SAMPLED_KEY].reshape(-1)[torch.as_tensor(rows, dtype=torch.int64)].float()  # [P]
    if not bool(torch.isfinite(out).all()):
        missing = f"--loss rkl-pg: {int((~torch.isfinite(out)).sum())} trained position(s) of the micro-batch have " \
                  f"no sampling log-prob ({SAMPLED_KEY})"
        if batch.get("train_on") != "last-assistant":
            raise XtcacheError(f"{missing}: train rollouts with --train-on last-assistant (the sampled turn only), or "
                               "use --is-cap 0")
        if not _warned_unsampled:  # only sampled turns are trained: turns whose ids do not spell their text
            _warned_unsampled = True
            log.warning("%s: they lie in rollout turns stored without sampling log-probs (their sampled ids do not "
                        "spell their text, counted by `xtcache inspect`) and train without the importance ratio (w = 1); "
                        "logged once", missing)
    return out


STALENESS_CAP = 2.0  # the ratio cap staleness counts against when the loss has none (rkl-pg's default --is-cap)
STALENESS_ROWS = 256  # sampled labels a micro-batch's staleness reads at most (evenly spaced): [rows, V] once


@torch.no_grad()
def staleness(logits: Tensor, batch: dict, cap: float) -> Tensor:
    """How far the student being trained has moved from the policy that sampled a rollout micro-batch:
    float64 [4] on the logits' device: over at most STALENESS_ROWS of the labels that carry a sampling
    log-prob (evenly spaced; any loss), sum |log p_s(y) - log p_b(y)| and the number whose ratio p_s / p_b
    exceeds `cap` (per token: what a per-token truncated ratio would cap), then the labels read and all the
    labels that carry one. Zeros for a batch without sampling log-probs (not a rollout cache)."""
    out = torch.zeros(4, dtype=torch.float64, device=logits.device)
    if SAMPLED_KEY not in batch:
        return out
    log_pb = batch[SAMPLED_KEY].reshape(-1)
    labels = batch["labels"].reshape(-1)
    rows = torch.nonzero(torch.isfinite(log_pb) & (labels >= 0)).flatten()  # host side
    total = rows.numel()
    if total == 0:
        return out
    if total > STALENESS_ROWS:
        rows = rows[torch.arange(STALENESS_ROWS) * total // STALENESS_ROWS]
    flat = logits.detach().reshape(-1, logits.shape[-1])
    picked = flat.index_select(0, rows.to(flat.device)).float()  # [P, V], P <= STALENESS_ROWS
    log_ps = picked.gather(1, labels[rows].to(flat.device)[:, None])[:, 0] - torch.logsumexp(picked, dim=-1)
    d = (log_ps - log_pb[rows].to(flat.device).float()).double()
    out[0], out[1], out[2], out[3] = d.abs().sum(), (d > math.log(cap)).sum(), float(rows.numel()), float(total)
    return out
