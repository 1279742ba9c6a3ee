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
    np.testing.assert_array_equal(shallow_decode(ref, level, kept, new), np.sort(codes, axis=1))
