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
cross tokenizer. One autograd function (`stage2_student.blocked`) computes KD and CE block by block in
forward and recomputes each block in backward, writing one logits-sized gradient buffer; no
[rows, V] tensor of the whole micro-batch exists besides it. The call itself never reads a
device value back (no `.item()`, no data-dependent shapes), so a step does not stall the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from schemas.models import DRAWN_MODES
from stage2_student.blocked import Block, Prepared, TermSpec, blocked_terms
from stage2_student.losses import EmptyMappedSupportError, NoValidChunksError, ProjectionOperator
from stage2_student.onpolicy import behaviour_rows
from xtcache.errors import ConfigError, ProjectionError, XtcacheError

ROW_CHUNK = 1024
# training's top-1 agreement reads at most this many chunks of a micro-batch (evenly spaced); the
# argmax over every row of [rows, V] logits cost a 128k-vocabulary P-KL step 0.1x of a CE step on CPU
TRAIN_AGREEMENT_CHUNKS = 128
KINDS = ("kl", "rkl", "jsd", "sampled", "pkl", "alm", "rkl-pg")
CHUNK_ROWS = ("first", "mean")  # --chunk-rows
_V_COPIES = 9  # [rows, V] fp32-sized tensors a block holds at its peak (recompute + its backward)
_K_BYTES = 72  # bytes per stored teacher entry a block holds (ids, log-probs, p, q, terms, grads)


@dataclass(frozen=True)
class Capabilities:
    """What the cache offers the objective: same tokenizer as the teacher, and its mode."""

    same_tokenizer: bool
    mode: str  # topk | full | sampled | headtail


def resolve_kind(requested: str, caps: Capabilities) -> str:
    """The KD kind a run trains with (for --loss ce: the one its evaluation would use).

    auto: kl for same-tokenizer caches (sampled for sampled and headtail ones: the forward KL to the
    teacher estimated from draws, at T = 1), pkl for cross-tokenizer caches (sampled and headtail
    ones included: P-KL then uses the estimate of `losses.teacher_logprobs`).
    rkl-pg (rollouts, docs/on-policy.md) reads only the realized log-probs: any cache, never auto.
    """
    same, mode = caps.same_tokenizer, caps.mode
    drawn = mode in DRAWN_MODES  # the teacher is an unbiased estimate from draws
    if requested in ("auto", "ce"):
        return ("sampled" if drawn else "kl") if same else "pkl"
    if requested in ("kl", "rkl", "jsd") and (not same or drawn):
        why = "the cache is cross-tokenizer: use --loss pkl or alm" if not same else \
            f"the cache holds {mode} targets: use --loss sampled"
        raise ConfigError(f"--loss {requested}: {why}")
    if requested == "sampled" and (not drawn or not same):
        raise ConfigError(f"--loss sampled needs a same-tokenizer cache of sampled or headtail targets (this one: "
                          f"mode {mode!r}, {'same' if same else 'cross'}-tokenizer)")
    if requested == "pkl" and same:
        raise ConfigError("--loss pkl: the student shares the teacher's tokenizer: use --loss kl")
    return requested


def measure_definition(caps: Capabilities) -> str:
    """What the evaluation's `kl_to_teacher` measures on a cache with these capabilities."""
    what = {"topk": "each {0}'s cached top-k teacher ids plus one rest bucket: a lower bound of the KL over "
                    "the full {1}vocabulary",
            "full": "the full {1}vocabulary (full cache: exact)",
            "sampled": "each {0}'s sampled teacher ids plus one rest bucket, the teacher taken as its empirical "
                       "sample distribution counts / N (an estimate from samples, not a bound)",
            "headtail": "each {0}'s exact top-k teacher ids and sampled tail ids plus one rest bucket, a tail id "
                        "taken as R c / n (an unbiased estimate from samples, not a bound)"}[caps.mode]
    if caps.same_tokenizer:
        return "forward KL(teacher || student) at T=1 per position over " + what.format("position", "")
    return ("first-token forward KL at T=1 per chunk: the teacher's distribution of its next token at the chunk's "
            "first row vs the student's at the chunk's first position mapped through the projection W (P-KL, "
            "--chunk-rows first), over " + what.format("chunk", "teacher "))


def _rows_selector(rows: np.ndarray):
    """A contiguous ascending range as a (start, end) slice (a view, no copy), else an index tensor."""
    if rows.size and rows[-1] - rows[0] + 1 == rows.size and np.all(np.diff(rows) == 1):
        return int(rows[0]), int(rows[-1]) + 1
    return torch.from_numpy(rows.astype(np.int64))


# --ce-weight when not given (docs/losses.md, "Defaults"): with a same-tokenizer KD loss the teacher's distribution
# over the student's own ids carries the token choice and CE is a small anchor; across tokenizers the KD term only
# constrains the distribution of the first teacher token of the text that follows (many student tokens share one),
# so which student token carries that mass is learned from CE, at half weight beside the forward-reverse P-KL (at
# 0.1 the student lost 0.46 nats of held-out CE on the real pair; 0.5 and 1.0 both won CE there)
CE_WEIGHT_SAME, CE_WEIGHT_CROSS = 0.1, 0.5
# --pkl-divergence's and --pkl-reverse-weight's defaults: the half-and-half forward-reverse mix at CE 0.5 beat CE
# alone on all three held-out measures of the real pair on every seed, with the projection map that leaves the
# student's control tokens out; the mix weighted 0.75 towards the reverse KL, within noise of it, did not on every
# seed; the forward KL alone did not win top-1 agreement, the reverse alone lost CE (docs/losses.md)
PKL_DIVERGENCE = "forward-reverse"
PKL_REVERSE_WEIGHT = 0.5


def default_divergence(kind: str | None, caps: Capabilities) -> str:
    """`--pkl-divergence` when not given: forward-reverse for P-KL on a cache of exact teacher log-probs (top-k,
    full); forward on a sampled or headtail one, whose teacher is an unbiased estimate from draws: the forward KL is
    linear in it, the reverse KL takes its log (biased); forward for the other kinds (no P-KL)."""
    return PKL_DIVERGENCE if kind == "pkl" and caps.mode not in DRAWN_MODES else "forward"


def default_ce_weight(loss_cfg, caps: Capabilities, kind: str | None) -> float:
    """`--ce-weight`, or its default for this run's loss and cache (CE only: 1)."""
    if loss_cfg.ce_weight is not None:
        return loss_cfg.ce_weight
    if kind is None:
        return 1.0
    return CE_WEIGHT_SAME if caps.same_tokenizer else CE_WEIGHT_CROSS


def _first_rows(sc: np.ndarray, pos_in: np.ndarray, pos_chunk: np.ndarray, tch: np.ndarray, n_chunks: int):
    """Each chunk's first student logit position and first teacher row only (`--chunk-rows first`).

    Returns (sc with the chunk's later positions set to -1, so that they train CE only; the kept positions;
    their chunks; bool [teacher rows] which rows are kept). At a chunk's first position both tokenizations
    begin at the same character, so the student's next-token distribution, each student token read as the
    first teacher token of its text (`projection build --pieces first`), and the teacher's first row are
    distributions of the same event: the first teacher token of the text that follows.
    """
    first = np.full(n_chunks, sc.size, dtype=np.int64)
    np.minimum.at(first, pos_chunk, pos_in)
    keep = pos_in == first[pos_chunk]
    sc = sc.copy()
    sc[pos_in[~keep]] = -1
    first_row = np.full(n_chunks, tch.size, dtype=np.int64)
    np.minimum.at(first_row, tch, np.arange(tch.size))
    return sc, pos_in[keep], pos_chunk[keep], np.arange(tch.size) == first_row[tch]


class Objective:
    """KD + CE of one micro-batch; see the module docstring."""

    def __init__(self, kind: str | None, *, kd_weight: float = 1.0, ce_weight: float = 0.1,
                 dynamic_scaling: bool = False, temperature: float = 1.0, jsd_beta: float = 0.5,
                 alm_tau: float = 100.0, projection: ProjectionOperator | None = None, teacher_tail: str = "ghost",
                 measure_agreement: bool = True, row_chunk: int = ROW_CHUNK, with_ce: bool = True,
                 is_cap: float = 0.0, chunk_rows: str = "first", pkl_divergence: str = "forward",
                 pkl_reverse_weight: float | None = None):
        if kind is not None and kind not in KINDS:
            raise ValueError(f"--loss {kind!r}: use {', '.join(KINDS)}")
        if teacher_tail not in ("ghost", "uniform"):
            raise ValueError(f"teacher_tail {teacher_tail!r}: use 'ghost' or 'uniform'")
        if kind == "sampled" and temperature != 1.0:
            raise ConfigError(f"--temperature {temperature:g} with --loss sampled: the cache holds draws of the T=1 "
                              "teacher, which cannot be re-tempered; use --temperature 1 (docs/losses.md)")
        if kind == "rkl-pg" and temperature != 1.0:
            raise ConfigError(f"--temperature {temperature:g} with --loss rkl-pg: the policy gradient trains the "
                              "student's own T=1 policy against the teacher's stored T=1 log-probs; use --temperature 1")
        if chunk_rows not in CHUNK_ROWS:
            raise ValueError(f"--chunk-rows {chunk_rows!r}: use {' or '.join(CHUNK_ROWS)}")
        if pkl_divergence != "forward" and kind != "pkl":
            raise ConfigError(f"--pkl-divergence {pkl_divergence}: applies to --loss pkl (across tokenizers); with one "
                              "tokenizer use --loss rkl or --loss jsd")
        if pkl_reverse_weight is not None and pkl_divergence != "forward-reverse":
            raise ConfigError(f"--pkl-reverse-weight {pkl_reverse_weight:g}: weighs the reverse KL of --pkl-divergence "
                              f"forward-reverse, not of {pkl_divergence}")
        if kind == "pkl" and projection is None:
            raise ProjectionError("--loss pkl needs a projection map (--projection, or built from both tokenizers)")
        self.kind, self.projection = kind, projection
        self.kd_weight, self.ce_weight, self.dynamic_scaling = kd_weight, ce_weight, dynamic_scaling
        self.row_chunk = int(row_chunk)
        self.with_ce = with_ce  # False: this teacher's pass skips CE (another teacher's pass computes it)
        self.chunk_rows = chunk_rows  # pkl: "first" compares each chunk's first student and teacher rows only
        self.spec = TermSpec(kind, float(temperature), jsd_beta, alm_tau, teacher_tail, projection, float(is_cap),
                             pkl_divergence,
                             PKL_REVERSE_WEIGHT if pkl_reverse_weight is None else float(pkl_reverse_weight))
        cross = kind in ("pkl", "alm")
        self.measure_agreement = measure_agreement and kind is not None and (not cross or projection is not None)

    @classmethod
    def from_config(cls, loss_cfg, caps: Capabilities, projection: ProjectionOperator | None = None, *,
                    kind: str | None = None, **overrides) -> "Objective":
        """The objective of a `LossConfig` on a cache with `caps` (--loss ce: CE only, no KD)."""
        if kind is None and loss_cfg.loss != "ce":
            kind = resolve_kind(loss_cfg.loss, caps)
        if caps.mode == "headtail" and kind in ("sampled", "pkl") and loss_cfg.temperature != 1.0:
            raise ConfigError(f"--temperature {loss_cfg.temperature:g} on a headtail cache: its tail holds draws of the "
                              "T=1 teacher, which cannot be re-tempered; use --temperature 1 (docs/losses.md)")
        kw = dict(kd_weight=loss_cfg.kd_weight, ce_weight=default_ce_weight(loss_cfg, caps, kind),
                  dynamic_scaling=loss_cfg.dynamic_scaling, temperature=loss_cfg.temperature,
                  jsd_beta=loss_cfg.jsd_beta, alm_tau=loss_cfg.alm_tau, projection=projection,
                  is_cap=loss_cfg.is_cap if kind == "rkl-pg" else 0.0, chunk_rows=loss_cfg.chunk_rows,
                  pkl_divergence=loss_cfg.pkl_divergence or default_divergence(kind, caps),
                  pkl_reverse_weight=loss_cfg.pkl_reverse_weight,
                  measure_agreement=kind != "rkl-pg" or caps.same_tokenizer or projection is not None)
        kw.update(overrides)
        return cls(kind, **kw)

    def describe(self) -> dict:
        """The resolved loss, the settings that shape it and no others (defaults filled in): what
        train-student's summary.json records as `objective`, and what `xtcache rounds` compares between rounds."""
        spec, kind = self.spec, self.kind
        out = {"kind": kind, "ce_weight": self.ce_weight}
        if kind is None:
            return out
        out.update(kd_weight=self.kd_weight, dynamic_scaling=self.dynamic_scaling, temperature=spec.temperature,
                   teacher_tail=spec.tail)
        if kind == "pkl":
            out.update(pkl_divergence=spec.divergence, chunk_rows=self.chunk_rows)
            if spec.divergence == "forward-reverse":
                out["pkl_reverse_weight"] = spec.reverse_weight
        if kind == "jsd" or kind == "pkl" and spec.divergence == "jsd":
            out["jsd_beta"] = spec.beta
        if kind == "alm":
            out["alm_tau"] = spec.tau
        if kind == "rkl-pg":
            out["is_cap"] = spec.is_cap
        return out

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

    def prepare(self, batch: dict, *, vocab: int, ratio: bool = True) -> Prepared:
        """The index plan of one CPU micro-batch (host work only; `vocab` = the logits' width). `ratio=False`:
        rkl-pg without its importance ratio (held-out evaluation: text the student did not sample)."""
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
            plan = self._plan_kd(batch, sc, n_chunks, ce_pos, labels, vocab, self.spec.is_cap if ratio else 0.0)
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
            blocks.append(Block(logit_rows=torch.from_numpy(pos), num_kd_rows=0, kd_chunk=torch.zeros(0, dtype=torch.int64),
                                ce_rows=torch.arange(pos.size), ce_labels=torch.from_numpy(labels[pos])))
        return blocks

    def _plan_kd(self, batch, sc, n_chunks, ce_pos, labels, vocab, is_cap: float) -> list[Block]:
        tch = batch["teacher_chunk"].numpy()
        tids = batch["teacher_ids"].numpy()
        k = tids.shape[1]
        pos_in = np.nonzero(sc >= 0)[0]
        pos_chunk = sc[pos_in]
        same = self.kind not in ("pkl", "alm", "rkl-pg")  # rkl-pg: chunk sums (1:1 chunks: one token each)
        if same and pos_in.size != n_chunks:
            raise XtcacheError(f"batch has {pos_in.size} chunk logits for {n_chunks} chunks: not a same-tokenizer "
                               "batch; use the projected KL loss for cross-tokenizer caches")
        keep_row = None
        if self.kind == "pkl" and self.chunk_rows == "first":
            sc, pos_in, pos_chunk, keep_row = _first_rows(sc, pos_in, pos_chunk, tch, n_chunks)
        n_pos = np.bincount(pos_chunk, minlength=n_chunks)
        n_rows = np.bincount(tch, minlength=n_chunks) if keep_row is None else np.ones(n_chunks, dtype=np.int64)
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
        if keep_row is not None:
            row_block = np.where(keep_row, row_block, -1)
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
                fields = dict(num_kd_rows=int(t_rows.size), teacher_rows=_rows_selector(t_rows),
                              kd_chunk=torch.from_numpy(tch[t_rows].astype(np.int64)))
            else:
                sel = np.nonzero(pos_block == b)[0]
                rows, chunks_of_rows = pos_in[sel], pos_chunk[sel]
                ce_loc = np.searchsorted(rows, ce_b)
                fields = self._plan_cross_block(rows, chunks_of_rows, t_rows, tch, labels)
                if self.kind == "rkl-pg":
                    fields["behaviour_logprobs"] = behaviour_rows(batch, rows, is_cap)
            pos = np.concatenate([rows, extra]).astype(np.int64)
            ce_loc = np.concatenate([ce_loc, rows.size + np.arange(extra.size)]).astype(np.int64)
            blocks.append(Block(logit_rows=torch.from_numpy(pos), ce_rows=torch.from_numpy(ce_loc),
                                ce_labels=torch.from_numpy(labels[pos[ce_loc]].astype(np.int64)), **fields))
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
        chunks = np.unique(chunks_of_rows)  # [C] the block's chunks
        student_chunk = np.searchsorted(chunks, chunks_of_rows)  # [P] block-local chunk of each row
        n_c = chunks.size
        student_rows = np.bincount(student_chunk, minlength=n_c).astype(np.float64)  # [C]
        teacher_chunk = np.searchsorted(chunks, tch[t_rows])  # [M] block-local chunk of each teacher row
        teacher_rows = np.bincount(teacher_chunk, minlength=n_c).astype(np.float64)  # [C]
        return dict(num_kd_rows=int(rows.size), num_chunks=n_c, teacher_rows=_rows_selector(t_rows),
                    student_chunk=torch.from_numpy(student_chunk), kd_chunk=torch.from_numpy(chunks.astype(np.int64)),
                    teacher_chunk=torch.from_numpy(teacher_chunk), inv_student_rows=torch.from_numpy(1.0 / student_rows),
                    teacher_row_weight=torch.from_numpy(1.0 / teacher_rows[teacher_chunk]),
                    kd_labels=torch.from_numpy(np.maximum(labels[rows], 0).astype(np.int64)))

    def _plan_agreement(self, batch, sc, n_chunks) -> dict:
        """First logit position and the teacher's top-1 id (at the chunk's first row) of every chunk."""
        pos_in = np.nonzero(sc >= 0)[0]
        first_pos = np.full(n_chunks, sc.size, dtype=np.int64)
        np.minimum.at(first_pos, sc[pos_in], pos_in)
        tch = batch["teacher_chunk"].numpy()
        first_row = np.full(n_chunks, tch.size, dtype=np.int64)
        np.minimum.at(first_row, tch, np.arange(tch.size))
        ids = batch["teacher_ids"].numpy()
        score = (batch["teacher_logprobs"] if "teacher_logprobs" in batch else batch["teacher_counts"]).numpy()
        if first_row.size != tch.size or (first_row != np.arange(tch.size)).any():  # else every row is a first
            ids, score = ids[first_row], score[first_row]
        # the largest stored score of each row, read in place (a full cache's rows are V wide); rows whose
        # largest score sits in a padding slot are redone with the padding masked
        top = ids[np.arange(n_chunks), score.argmax(axis=1)].astype(np.int64)
        bad = np.nonzero(top < 0)[0]
        if bad.size:
            masked = np.where(ids[bad] >= 0, score[bad].astype(np.float64), -np.inf)
            top[bad] = ids[bad, masked.argmax(axis=1)]
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
        agree, agree_n = self.agreement(logits, prep, max_chunks=TRAIN_AGREEMENT_CHUNKS)
        return loss, {"kd_sum": kd_sum.detach(), "ce_sum": ce_sum.detach(), "agree": agree, "agree_n": agree_n}

    @torch.no_grad()
    def agreement(self, logits: Tensor, prep: Prepared, *, max_chunks: int | None = None) -> tuple[Tensor, Tensor]:
        """(agreeing chunks, chunks counted): the student's argmax at a chunk's first logit, mapped into the
        teacher vocabulary, vs the teacher's top-1 at the chunk's first row (sampled: the mode). With
        `max_chunks`, at most that many chunks, evenly spaced over the micro-batch (training's estimate)."""
        flat = logits.detach().reshape(-1, logits.shape[-1])
        zero = torch.zeros((), dtype=torch.float32, device=flat.device)
        if prep.agree is None:
            return zero, zero
        first, top = prep.agree["first_pos"], prep.agree["teacher_top"]
        n = first.shape[0]
        if max_chunks is not None and n > max_chunks:  # the sampled chunks' rows only: argmax over [rows, V]
            pick = torch.arange(max_chunks, device=first.device) * n // max_chunks  # is CPU's costliest pass
            first, top = first[pick], top[pick]
            arg = flat.index_select(0, first).argmax(dim=-1)
        else:  # every row's argmax read in place, then the chunks' first rows: no copy of the rows
            arg = flat.argmax(dim=-1).index_select(0, first)  # [C]
        if self.projection is not None:
            arg = self.projection.student_top[arg]
        return (arg == top).sum().float(), zero + float(first.shape[0])


__all__ = ["Capabilities", "Objective", "Prepared", "resolve_kind", "measure_definition", "NoValidChunksError",
           "EmptyMappedSupportError"]
