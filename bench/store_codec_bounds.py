"""An ideal coder with context: what a row's top-k would cost under models that see more than part-wide statistics.

Imported by `bench/store_codec_candidates.py`. Code lengths, not codecs: each is the ideal arithmetic-code
length (bits, -log2 of the probability the model gives) under models that learn as they go, so a reader
would have to decode every entry of every row one at a time after the rows before it, far from 1.5M
positions/s on a core in numpy. They are models, not bounds: a stronger model codes lower (the teacher
itself, run by a reader on the stored text, would need no ids at all), and where rows repeat earlier rows
(the toy teacher) zstd's matches already beat the set code used here. They say what knowing a row's
context is worth on a teacher whose rows do not repeat (docs/store.md).

- ids: each row's set of ids under the best, for that row, of a few mixes of five adaptive models:
  part-wide frequencies, the ids seen after the same input token, after the same two input tokens, the
  previous row's ids, and the ids of the row among the previous 1,024 that shares most of them.
- values: the row's sqrt codes in rank order, each given the one before (plug-in conditional entropy over the
  part: the table itself is not counted, so this is below any real coding).
- pairing: which id has which value, given the set and the values, under the row's mix (Plackett-Luce
  on its probabilities), against the part-wide multinomial bound.

    .venv/bin/python bench/store_codec.py --teacher real      # the "ideal coder" rows of "codec candidates"
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict

import numpy as np

# The mixes a row may pick (weights of: part-wide, after the input token, after the two input tokens, the
# previous row's ids, the ids of the best of the previous REF_WINDOW rows); a row pays log2(len(MIXES)) bits
# for its pick and log2(REF_WINDOW) bits for the reference row when its mix uses one.
MIXES = np.array([(0.2, 0.3, 0.3, 0.2, 0.0), (0.1, 0.2, 0.2, 0.1, 0.4), (0.05, 0.1, 0.1, 0.05, 0.7),
                  (0.05, 0.05, 0.05, 0.8, 0.05), (0.02, 0.02, 0.02, 0.04, 0.9), (0.1, 0.4, 0.4, 0.05, 0.05),
                  (0.4, 0.2, 0.2, 0.1, 0.1), (0.02, 0.04, 0.04, 0.45, 0.45)])
REF_WINDOW = 1024
ESCAPE = 8.0  # pseudo-count with which a context's counts fall back on the coarser model
SHARPNESS = (0.25, 0.5, 1.0)  # exponents of the context model's probabilities tried for the pairing


def _log2_factorial(m: int) -> float:
    return math.lgamma(m + 1) / math.log(2)


def _tie_bits(values: np.ndarray) -> float:
    """log2 of the orders of a row's entries that equal values leave free: the product of their counts' factorials."""
    return sum(_log2_factorial(m) for m in Counter(values.tolist()).values())


def _escaped(counts: Counter, rows: int, row: np.ndarray, coarser: np.ndarray, k: int) -> np.ndarray:
    """A context's probabilities of `row`'s ids: its counts over its `rows` rows of k ids, falling back on the
    coarser model's with ESCAPE pseudo-counts; the coarser model's alone where the context has no row yet."""
    if not rows:
        return coarser
    return (np.array([counts[a] for a in row.tolist()], float) + ESCAPE * coarser) / (k * rows + ESCAPE)


def context_code_lengths(ids: np.ndarray, vals: np.ndarray, inputs: np.ndarray, before: np.ndarray,
                         vocab: int) -> tuple[float, dict[float, float]]:
    """(bits of the rows' id sets, {sharpness: bits of the pairing}) summed over rows, under the adaptive models.

    `ids` [P, k] in rank order, `vals` [P, k] their sqrt codes (non-increasing), `inputs` [P] the token
    before each row's target, `before` [P] the token before that (-1 at a document's start). Under a mix q
    a row's set costs -log2(k! * prod q(id)): the probability of drawing exactly that set in k draws from
    q, a valid code length over sets (loose where q puts most of its mass on k ids: a row that repeats an
    earlier one). Each row picks the mix of MIXES that codes it shortest. Its pairing costs the
    Plackett-Luce code of its rank order under that mix, minus what equal values leave free (log2 of the
    factorials of their counts: exact when the mix is uniform over the row, as for the first row, an
    approximation otherwise; the pairing row takes the smaller of this and the exact multinomial).
    """
    from bench.store_codec_refs import best_recent

    P, k = ids.shape
    ref = best_recent(ids, REF_WINDOW)
    overhead = np.log2(len(MIXES)) + np.where(MIXES[:, 4] > 0, np.log2(REF_WINDOW), 0.0)  # [mixes]
    set_free = _log2_factorial(k)
    seen = np.zeros(vocab)
    total = 0
    by_one: dict[int, Counter] = defaultdict(Counter)
    rows_one: Counter = Counter()
    by_two: dict[tuple[int, int], Counter] = defaultdict(Counter)
    rows_two: Counter = Counter()
    set_bits = 0.0
    pair_bits = dict.fromkeys(SHARPNESS, 0.0)
    for t in range(P):
        row = ids[t]
        q_part = (seen[row] + 0.5) / (total + 0.5 * vocab)
        one, two = int(inputs[t]), (int(before[t]), int(inputs[t]))
        q_one = _escaped(by_one[one], rows_one[one], row, q_part, k)
        q_two = _escaped(by_two[two], rows_two[two], row, q_one, k)
        q_prev = np.isin(row, ids[t - 1]) / k if t else q_part
        q_ref = np.isin(row, ids[ref[t]]) / k if ref[t] >= 0 else q_part
        q_mixes = MIXES @ np.stack([q_part, q_one, q_two, q_prev, q_ref])  # [mixes, k]
        costs = -np.log2(q_mixes).sum(1) - set_free + overhead
        pick = int(np.argmin(costs))
        set_bits += float(costs[pick])
        ties = _tie_bits(vals[t])
        for g in SHARPNESS:
            w = q_mixes[pick] ** g
            remaining = np.cumsum(w[::-1])[::-1]  # each rank's choice among the ids not yet placed
            pair_bits[g] += float(-np.log2(w / remaining).sum()) - ties
        seen[row] += 1
        total += k
        by_one[one].update(row.tolist())
        rows_one[one] += 1
        by_two[two].update(row.tolist())
        rows_two[two] += 1
    return set_bits, pair_bits


def rank_order_value_bits(vals: np.ndarray) -> float:
    """Plug-in conditional entropy (bits, summed over rows) of each row's value codes in rank order: the first
    code, then each code given the rank and the code before it."""
    P, k = vals.shape

    def entropy(keys: np.ndarray) -> float:  # total bits of `keys` [P, n] coded by their empirical distribution
        _, counts = np.unique(keys, axis=0, return_counts=True)
        return float(-(counts * np.log2(counts / P)).sum())

    bits = entropy(vals[:, :1])
    for r in range(1, k):
        bits += entropy(vals[:, r - 1:r + 1]) - entropy(vals[:, r - 1:r])
    return bits


def multinomial_pairing_bits(vals: np.ndarray) -> float:
    """Bits (summed over rows) of the pairing with no model: log2 of each row's multinomial of value codes."""
    k = vals.shape[1]
    return sum(_log2_factorial(k) - _tie_bits(row) for row in vals)


def context_bound_rows(docs: list[dict], ids: np.ndarray, vals: np.ndarray, kl: float, vocab: int,
                       where: str = "") -> list[tuple[str, str, float, float]]:
    """(piece, candidate, B/position, KL) of the ideal coder with context, for `ids` [P, k] in rank order and their
    sqrt codes `vals`: the rows of `docs` after each document's first (as `reference_rows`); `where` is added
    to each candidate's name."""
    P, k = ids.shape
    inputs = np.concatenate([d["ids"][:-1] for d in docs]).astype(np.int64)
    before = np.concatenate([np.concatenate([[-1], d["ids"][:-2]]) for d in docs]).astype(np.int64)
    set_bits, pair_bits = context_code_lengths(ids, vals, inputs, before, vocab)
    g, best = min(pair_bits.items(), key=lambda item: item[1])
    multinomial = multinomial_pairing_bits(vals)
    value_b, set_b = rank_order_value_bits(vals) / 8 / P, set_bits / 8 / P
    pair_b = min(best, multinomial) / 8 / P
    rows = [
        ("ids", f"ideal coder with context: each row's set under the best of {len(MIXES)} mixes of adaptive part-wide, "
         "same input token, same two input tokens, previous row's and best of the previous 1,024 rows' ids (the "
         "pick and the reference paid; ideal arithmetic code, one entry at a time)", set_b, 0.0),
        ("values", "ideal coder: rank order, each code given its rank and the code before (plug-in entropy, table not "
         "counted)", value_b, kl),
        ("ids + values", f"ideal coder: pairing under that context model (Plackett-Luce on its probabilities^{g:g}: "
         f"{best / 8 / P:.1f}; the multinomial's {multinomial / 8 / P:.1f})", pair_b, kl),
        ("ids + values", "ideal coder with context: the three above together (adaptive: read one entry at a time)",
         set_b + value_b + pair_b, kl),
    ]
    return [(piece, name + where, b, error) for piece, name, b, error in rows]
