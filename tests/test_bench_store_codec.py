"""bench/store_codec_candidates.py's KL of ragged rows (entries dropped into the rest), and the code lengths of
bench/store_codec_bounds.py, against hand counts."""

from __future__ import annotations

import math

import numpy as np
import pytest

from bench.store_codec_bounds import MIXES, context_code_lengths, multinomial_pairing_bits, rank_order_value_bits
from bench.store_codec_candidates import kl_dropped, kl_top_rest, ragged_rows


def test_kl_of_a_row_with_nothing_dropped_is_the_top_k_plus_rest_kl():
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.ones(9), size=5)[:, :8]  # 8 stored entries and a rest of each row
    lp = np.log(p)
    decoded = lp + rng.normal(0, 0.01, lp.shape)
    keep = np.ones_like(lp, bool)
    assert kl_dropped(lp, decoded, keep, 100) == pytest.approx(kl_top_rest(lp, decoded), rel=1e-12)


def test_a_dropped_entry_reads_back_as_its_share_of_the_rest_spread_over_the_ids_not_stored():
    # vocab 6, top-3 (0.5, 0.3, 0.01) and a rest of 0.19 over the other 3 ids; the 0.01 entry dropped:
    # the row stores 2 ids and a rest of 0.2, which a reader spreads over 4 ids (0.05 each)
    lp = np.log(np.array([[0.5, 0.3, 0.01]]))
    keep = np.array([[True, True, False]])
    want = 0.01 * math.log(0.01 / 0.05) + 0.19 * math.log(0.19 / 0.15)
    assert kl_dropped(lp, lp, keep, 6) == pytest.approx(want, rel=1e-9)


def test_ragged_rows_keep_every_row_whole_when_no_entry_is_below_the_floor():
    ids = np.array([[3, 7, 9, 2]] * 50)
    lp = np.log(np.array([[0.4, 0.3, 0.2, 0.05]] * 50))
    for _, name, size, kl in ragged_rows(ids, lp, len(ids), "uint16", 16):
        assert "100% of entries kept, 100% of rows whole" in name and size > 0
        assert kl < 1e-3  # the values' sqrt code alone


def test_pairing_with_no_model_is_the_multinomial_of_the_value_codes():
    vals = np.array([[3, 3, 1, 1], [5, 4, 2, 1]])
    assert multinomial_pairing_bits(vals) == pytest.approx(math.log2(6) + math.log2(24), rel=1e-12)


def test_rank_order_values_cost_the_first_code_and_each_code_given_the_one_before():
    # first codes 9, 9, 8, 8 (1 bit each); the second is the first minus 1 every time (0 bits given it)
    vals = np.array([[9, 8], [9, 8], [8, 7], [8, 7]])
    assert rank_order_value_bits(vals) == pytest.approx(4.0, abs=1e-12)


def test_the_first_row_costs_a_uniform_set_and_a_row_seen_before_in_the_same_context_costs_less():
    vocab, k = 1000, 4
    ids = np.array([[5, 9, 200, 7], [5, 9, 200, 7], [11, 12, 13, 14]])
    vals = np.array([[9, 5, 5, 1], [9, 5, 5, 1], [4, 3, 2, 1]])
    inputs, before = np.array([42, 42, 43]), np.array([-1, 42, 42])
    first, _ = context_code_lengths(ids[:1], vals[:1], inputs[:1], before[:1], vocab)
    # every model is uniform before any row: the set code plus the pick of a mix that uses no reference row
    assert first == pytest.approx(k * math.log2(vocab) - math.log2(24) + math.log2(len(MIXES)), rel=1e-12)
    # with nothing known every order is as likely: the pairing is the multinomial (24 / 2! for the two 5s)
    _, pairing = context_code_lengths(ids[:1], vals[:1], inputs[:1], before[:1], vocab)
    assert all(bits == pytest.approx(math.log2(12), rel=1e-12) for bits in pairing.values())
    two, _ = context_code_lengths(ids[:2], vals[:2], inputs[:2], before[:2], vocab)
    three, _ = context_code_lengths(ids, vals, inputs, before, vocab)
    assert two - first < first / 3  # the repeated row: its context and the previous row both hold its ids
    assert three - two > 2 * (two - first)  # unseen ids cost far more than a repeated row


def test_rows_coded_against_earlier_rows_at_a_bounded_depth_decode_level_by_level_to_themselves():
    from bench.store_codec_refs import shallow_decode, shallow_encode, shallow_refs

    rng = np.random.default_rng(0)
    rows = [rng.choice(500, 16, replace=False)]
    for _ in range(199):  # each row keeps 12 of an earlier row's codes, or is new
        if rng.random() < 0.8:
            base = rows[int(rng.integers(max(0, len(rows) - 50), len(rows)))]
            fresh = np.setdiff1d(rng.choice(500, 40, replace=False), base)[:4]
            rows.append(np.concatenate([rng.choice(base, 12, replace=False), fresh]))
        else:
            rows.append(rng.choice(500, 16, replace=False))
    codes = np.stack(rows)
    ref, level = shallow_refs(codes, 64, depth=2, min_shared=8)
    assert level.max() == 2 and (ref < np.arange(len(codes))).all()
    assert (level[ref >= 0] == level[ref[ref >= 0]] + 1).all() and (level[ref < 0] == 0).all()
    kept, new = shallow_encode(codes, ref)
    assert kept.sum() > 0.5 * codes.size  # most codes come from the reference rows
    dist = np.where(ref >= 0, np.arange(len(codes)) - ref, 0).astype(np.uint16)
    decoded = shallow_decode(dist, np.packbits(kept, axis=1), new.astype(np.uint16), 16, depth=2)
    np.testing.assert_array_equal(decoded, np.sort(codes, axis=1))


def test_a_row_that_keeps_nothing_of_its_reference_decodes_from_its_new_codes_alone():
    from bench.store_codec_refs import shallow_decode, shallow_encode

    codes = np.array([[1, 5, 9, 70_000], [2, 3, 4, 8], [9, 1, 66_000, 6]])  # codes above 16 bits too
    ref = np.array([-1, 0, 1])  # row 1 shares nothing with row 0; row 2 nothing with row 1
    kept, new = shallow_encode(codes, ref)
    assert not kept.any()
    dist = np.array([0, 1, 1], np.uint16)
    decoded = shallow_decode(dist, np.packbits(kept, axis=1), new.astype(np.uint32), 4, depth=2)
    np.testing.assert_array_equal(decoded, np.sort(codes, axis=1))


def _mix_cost(q_models: np.ndarray, k: int) -> tuple[float, np.ndarray]:
    """A second construction of a row's set code under the best mix: (bits, the picked mix's q)."""
    costs = [-np.log2(w @ q_models).sum() - math.log2(math.factorial(k)) + math.log2(len(MIXES))
             + (10.0 if w[4] > 0 else 0.0) for w in MIXES]
    pick = int(np.argmin(costs))
    return costs[pick], MIXES[pick] @ q_models


def test_the_second_row_costs_its_hand_counted_mix_and_its_pairing_its_plackett_luce_code():
    vocab, k = 10, 2
    ids = np.array([[1, 2], [3, 1]])  # row 1 in rank order: id 3 first
    vals = np.array([[9, 4], [8, 2]])
    inputs, before = np.array([5, 5]), np.array([-1, 5])  # two-token contexts (-1, 5), then (5, 5): unseen
    first, _ = context_code_lengths(ids[:1], vals[:1], inputs[:1], before[:1], vocab)
    both, pairing = context_code_lengths(ids, vals, inputs, before, vocab)
    # after row 0 (ids 1, 2 after token 5): part-wide counts {1: 1, 2: 1} of 2 entries
    q_part = (np.array([0.0, 1.0]) + 0.5) / (2 + 0.5 * vocab)  # ids 3, 1
    q_one = (np.array([0.0, 1.0]) + 8.0 * q_part) / (k * 1 + 8.0)  # one row after token 5 so far
    q_two = q_one  # (5, 5) never seen: falls back on the one-token model
    q_prev = np.array([0.0, 0.5])  # row 0 holds id 1, not id 3
    q_ref = q_prev  # the best earlier row is row 0
    bits, q = _mix_cost(np.stack([q_part, q_one, q_two, q_prev, q_ref]), k)
    assert both - first == pytest.approx(bits, rel=1e-9)
    _, first_pairing = context_code_lengths(ids[:1], vals[:1], inputs[:1], before[:1], vocab)
    for g, total in pairing.items():
        w = q ** g  # id 3 ranks first: chosen among both ids, then id 1 alone
        assert total - first_pairing[g] == pytest.approx(-math.log2(w[0] / w.sum()), rel=1e-9)


def test_the_rows_of_documents_are_coded_after_the_token_before_their_target():
    from bench.store_codec_bounds import context_bound_rows

    rng = np.random.default_rng(1)
    docs = [{"ids": rng.integers(0, 50, size=n)} for n in (7, 5)]
    P = sum(len(d["ids"]) - 1 for d in docs)
    ids = np.stack([rng.choice(300, 8, replace=False) for _ in range(P)])
    vals = -np.sort(-rng.integers(0, 128, size=(P, 8)), axis=1)
    # row t of a document predicts its token t: the input is token t - 1 and the one before it token t - 2
    inputs = np.concatenate([d["ids"][:-1] for d in docs])
    before = np.concatenate([[-1, *d["ids"][:-2]] for d in docs])
    set_bits, _ = context_code_lengths(ids, vals, inputs, before, 300)
    rows = context_bound_rows(docs, ids, vals, 0.0, 300)
    assert rows[0][2] == pytest.approx(set_bits / 8 / P, rel=1e-12)
    leaked, _ = context_code_lengths(ids, vals, np.concatenate([d["ids"][1:] for d in docs]), before, 300)
    assert leaked != pytest.approx(set_bits, rel=1e-6)  # the alignment matters to the number
