"""Several teachers: the training objective over N >= 1 teacher caches (`TeacherMix`), combined per
chunk group, and the host-side mixture teacher of `--teacher-combine mean-probs` (`mix_views`).

    mix = TeacherMix([Objective.from_config(cfg.loss, caps_i, ...) for ...], combine="dynamic")
    prep = mix.prepare(batch, vocab=V).to(device)
    loss, metrics = mix(logits, prep, chunks_total=G, tokens_total=N)
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from stage2_student import losses
from stage2_student.blocked import Prepared, blocked_terms
from stage2_student.join import num_teachers, teacher_view
from stage2_student.objective import TRAIN_AGREEMENT_CHUNKS, Objective
from stage2_student.onpolicy import STALENESS_CAP
from xtcache.errors import ConfigError, XtcacheError

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
    (`xtcache.packing.common_boundaries`); a teacher's KD term of a group is the sum of its
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

    def describe(self) -> dict:
        """The resolved loss (`Objective.describe`); several teachers: each one's, and how they combine."""
        if len(self.objectives) == 1 and self.num_views == 1:
            return self.objectives[0].describe()
        return {"teachers": [o.describe() for o in self.objectives], "combine": self.combine, "weights": self.lam,
                "score": self.score, "alpha": self.alpha}

    @property
    def staleness_cap(self) -> float:
        """The ratio cap the staleness metric counts against: rkl-pg's --is-cap, else onpolicy.STALENESS_CAP."""
        return self.spec.is_cap if self.spec.is_cap > 0 else STALENESS_CAP

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
        n = num_teachers(batch)
        if n == 1 and "teacher_ids" not in batch and not batch.get("num_chunks", 0):  # no teacher data (dummy_batch)
            return [teacher_view(batch, 0)] * len(self.objectives)
        if n != self.num_views:
            raise ConfigError(f"a micro-batch of {n} teacher(s) for an objective of {self.num_views}")
        views = [teacher_view(batch, i) for i in range(n)]
        return [mix_views(views, self.lam)] if self.combine == "mean-probs" else views

    def prepare(self, batch: dict, *, vocab: int, ratio: bool = True) -> MixPrepared:
        views = self.views(batch)
        n_groups, tokens = self.counts(batch)
        preps = [o.prepare(v, vocab=vocab, ratio=ratio) for o, v in zip(self.objectives, views)]
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
                    per_row = plogp.sum(dim=-1) + torch.where(rest > 0, rest * (losses.safe_log(rest) - math.log(n_rest)),
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
        agree = [o.agreement(logits, p, max_chunks=TRAIN_AGREEMENT_CHUNKS) for o, p in zip(self.objectives, prep.preps)]
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
