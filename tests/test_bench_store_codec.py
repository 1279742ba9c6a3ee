"""bench/store_codec_candidates.py's KL of ragged rows (entries dropped into the rest), against a hand count."""

from __future__ import annotations

import math

import numpy as np
import pytest

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
