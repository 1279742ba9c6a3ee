"""bench/quality_real.py's pure parts: the modes table (each store mode's share of the full-vocabulary store's KL
gain over CE only, paired by seed, rows by bytes per position) and the rule its notes state: a measure is won only
when the row is better than CE only on every seed and the mean paired difference exceeds its standard deviation."""

from __future__ import annotations

import pytest

from bench.quality_real import MODES, STORES, modes_markdown, paired_notes, share_of_full_gain


def _runs(row: str, store: str, kl, ce, top1):
    return [{"row": row, "cross": False, "store": store, "seed": s, "kl": kl[s], "ce": ce[s], "top1": top1[s]}
            for s in range(len(kl))]


def _report(res):
    stores = {"train": {"positions": 1000, "teacher_bytes_per_position": 91.0, "dump": ["--mode", "topk", "--top-k", "64"]},
              "topk8": {"positions": 1000, "teacher_bytes_per_position": 15.0, "dump": ["--mode", "topk", "--top-k", "8"]},
              "full": {"positions": 1000, "teacher_bytes_per_position": 40000.0, "dump": ["--mode", "full"]}}
    return {"settings": {"steps": 120, "micro_batch_size": 4, "seq_len": 256, "lr": 3e-3, "train_docs": 100,
                         "heldout_docs": 8}, "results": res, "stores": stores, "wall_s": 600, "machine": "m",
            "date": "d"}


CE = _runs("same tokenizer: CE only", "train", [4.0, 4.2, 4.1], [6.5, 6.6, 6.5], [0.13, 0.12, 0.13])
FULL = _runs("same tokenizer: full vocabulary", "full", [3.0, 3.2, 3.1], [6.3, 6.4, 6.3], [0.15, 0.14, 0.15])
TOP8 = _runs("same tokenizer: top-8 + rest", "topk8", [3.5, 3.6, 3.8], [6.4, 6.7, 6.4], [0.14, 0.13, 0.14])


def test_share_is_the_part_of_the_full_stores_gain_paired_by_seed():
    ce = {r["seed"]: r for r in CE}
    full = {r["seed"]: r for r in FULL}
    assert share_of_full_gain(TOP8, ce, full) == pytest.approx([0.5, 0.6, 0.3])
    assert share_of_full_gain(FULL, ce, full) == pytest.approx([1.0, 1.0, 1.0])
    assert share_of_full_gain(TOP8[:1], ce, {}) == []  # no full-vocabulary run on that seed: no share
    assert share_of_full_gain(TOP8, ce, {s: {"kl": 4.5} for s in range(3)}) == []  # the full store gained nothing


def test_modes_table_orders_rows_by_bytes_and_states_each_rows_share_and_verdict():
    md = modes_markdown(_report(CE + TOP8 + FULL))
    rows = [line for line in md.splitlines() if line.startswith("| same tokenizer")]
    assert [r.split(" | ")[0] for r in rows] == ["| same tokenizer: CE only", "| same tokenizer: full vocabulary",
                                                 "| same tokenizer: top-8 + rest"]
    assert "| `--mode topk --top-k 8` | 15.0 | 3 | 3.633 ± 0.153 | 47 ± 15% |" in rows[2]
    assert "| 100 ± 0% |" in rows[1] and "| - | - | 3 |" in rows[0]
    notes = [line for line in md.splitlines() if line.startswith("- ")]
    assert any("full vocabulary vs CE only" in n and "(won on all three)" in n for n in notes)
    # top-8: CE higher on seed 1 (6.7 against 6.6): not won on CE; KL and top-1 better on every seed beyond the spread
    assert any("top-8 + rest vs CE only" in n and "(not won: ce)" in n for n in notes)


def test_a_measure_better_on_every_seed_but_within_its_spread_is_not_won():
    row = _runs("same tokenizer: x", "topk8", [3.99, 4.19, 3.5], [6.4, 6.5, 6.4], [0.14, 0.13, 0.14])
    (note,) = paired_notes(CE + row)
    assert "kl -0.207 (sd 0.341, better on 3/3 seeds)" in note and "(not won: kl)" in note


def test_every_mode_row_has_a_store_and_the_table_has_ce_only_and_full():
    assert {r.store for r in MODES} <= set(STORES)
    assert any(r.name.endswith("CE only") for r in MODES) and any(r.store == "full" for r in MODES)


def test_the_cross_section_runs_ce_only_and_both_mixes_on_the_same_seeds_and_store():
    """`--section cross` pairs every KD row with CE only by seed: one store, one student vocabulary, equal seeds; the
    defaults row follows train-student's defaults (reverse weight 0.5), the 0.75 mix is pinned by its flags."""
    from bench.quality_real import CROSS, current_defaults, resolved

    assert [r.cross for r in CROSS] == [True] * 3 and {r.store for r in CROSS} == {"train"}
    assert CROSS[0].name.endswith("CE only") and len({r.seeds for r in CROSS}) == 1
    now = current_defaults()
    assert CROSS[1].flags == ("--loss", "auto") and now["--pkl-reverse-weight"] == "0.5"
    assert resolved(list(CROSS[1].flags), True, now) == {"--loss": "pkl", "--ce-weight": "0.5",
                                                          "--pkl-divergence": "forward-reverse",
                                                          "--pkl-reverse-weight": "0.5"}
    assert resolved(list(CROSS[2].flags), True, now) == {"--loss": "pkl", "--ce-weight": "0.5",
                                                          "--pkl-divergence": "forward-reverse",
                                                          "--pkl-reverse-weight": "0.75"}


def test_a_finished_run_is_reused_only_for_a_row_of_the_same_meaning_across_renames_and_new_defaults():
    """A run recorded before the reverse weight existed ran the half-and-half mix; the renamed rows of an earlier
    report render under their current names."""
    from bench.quality_real import ROWS, current_names, same_run

    old = {"argv": ["--loss", "auto", "--seed", "0"], "defaults": {"--ce-weight": "0.5",
                                                                   "--pkl-divergence": "forward-reverse"}}
    assert same_run(old, [*ROWS[7].flags, "--seed", "0"], True)
    assert not same_run(old, [*ROWS[14].flags, "--seed", "0"], True)
    renamed = current_names([{"row": "cross: P-KL defaults (forward-reverse, first rows, first-piece map, CE 0.5)"}])
    assert renamed == [{"row": ROWS[7].name}]
    # the defaults moved from the 0.75 mix back to the half-and-half one: each finished run stays with its objective
    under_075 = {"argv": ["--loss", "auto", "--seed", "3"], "defaults": {"--ce-weight": "0.5",
                 "--pkl-divergence": "forward-reverse", "--pkl-reverse-weight": "0.75"}}
    pinned_05 = {"argv": ["--loss", "pkl", "--pkl-divergence", "forward-reverse", "--pkl-reverse-weight", "0.5",
                          "--ce-weight", "0.5", "--seed", "3"], "defaults": under_075["defaults"]}
    assert same_run(under_075, [*ROWS[14].flags, "--seed", "3"], True)
    assert not same_run(under_075, [*ROWS[7].flags, "--seed", "3"], True)
    assert same_run(pinned_05, [*ROWS[7].flags, "--seed", "3"], True)
    assert not same_run(pinned_05, [*ROWS[14].flags, "--seed", "3"], True)
    was = ["cross: P-KL defaults (forward-reverse, reverse weight 0.75, first rows, first-piece map, CE 0.5)",
           "cross: P-KL forward-reverse, reverse weight 0.5, first rows, first-piece map, CE 0.5 (the second defaults)"]
    assert [r["row"] for r in current_names([{"row": n} for n in was])] == [ROWS[14].name, ROWS[7].name]


def test_a_finished_run_is_reused_only_through_the_projection_map_it_trained_with(tmp_path, student_tokenizer,
                                                                                  teacher_tokenizer):
    """Same flags, another map file content (a map built again by an xtcache that builds them otherwise): trained
    again; a summary that names no map (written before summaries did) cannot show it read this one."""
    from bench.quality_real import same_maps
    from xtcache.projection import build_projection

    first, all_pieces = tmp_path / "first.safetensors", tmp_path / "all.safetensors"
    build_projection(student_tokenizer, teacher_tokenizer, pieces="first").save(first)
    build_projection(student_tokenizer, teacher_tokenizer, pieces="all").save(all_pieces)
    argv = ["--loss", "auto", "--projection", str(first)]
    trained = {"data": {"projections": [{"cache": "c", "map": str(first),
                                         "sha256": build_projection(student_tokenizer, teacher_tokenizer).digest()}]}}
    assert same_maps(trained, argv)
    all_pieces.replace(first)  # the same path, another map
    assert not same_maps(trained, argv)
    assert not same_maps({"data": {}}, ["--projection", str(all_pieces.with_name("first.safetensors"))])
    assert same_maps({"data": {}}, ["--loss", "ce"])  # no map given: nothing to compare (CE only)
