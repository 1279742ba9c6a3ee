"""Projection map W: build on the toy tokenizers, save/load, fingerprints, NeMo-RL import, CLI.

The build's coverage report is printed (visible with `pytest -s`).

    pytest -x -q -s tests/test_projection.py
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.commands import xtcache
from xtcache.align.tokenizer import tokenizer_info
from xtcache.errors import ProjectionError
from xtcache.projection import (
    ProjectionMap,
    build_projection,
    coverage,
    format_report,
    import_nemo,
    unreached_teacher_ids,
)


@pytest.fixture(scope="module")
def toy_map(student_tokenizer, teacher_tokenizer):
    return build_projection(student_tokenizer, teacher_tokenizer, top_k=4)


def _piece(tok, i: int) -> bytes:
    info = tokenizer_info(tok)
    return info.piece_data[info.piece_start[i]:info.piece_start[i + 1]].tobytes()


def test_build_on_toy_tokenizers(toy_map, student_tokenizer, teacher_tokenizer):
    pm = toy_map
    print("\n" + format_report(pm, student_tokenizer, teacher_tokenizer))
    print("build notes:", {k: v for k, v in pm.notes.items() if k != "empty_rows"})
    assert pm.indices.shape == (len(student_tokenizer), 4) and pm.indices.dtype == np.int64
    assert pm.weights.dtype == np.float32 and pm.teacher_vocab_size == len(teacher_tokenizer)
    sums = pm.weights.sum(axis=1)
    empty = np.flatnonzero(pm.indices[:, 0] < 0)
    assert np.allclose(sums[pm.indices[:, 0] >= 0], 1.0, atol=1e-5) and np.all(sums[empty] == 0)
    # every student id maps somewhere, except specials with no teacher counterpart, which are reported
    reported = set(student_tokenizer.convert_tokens_to_ids(pm.notes["specials_without_counterpart"]))
    assert set(empty.tolist()) == reported and pm.notes["unmapped_tokens"] == []
    assert reported <= set(np.flatnonzero(tokenizer_info(student_tokenizer).control).tolist())
    # exact rows: one teacher id that spells the same bytes, weight 1
    for r in np.flatnonzero(pm.exact)[:200]:
        assert pm.weights[r, 0] == 1.0 and np.all(pm.indices[r, 1:] == -1)
        assert _piece(student_tokenizer, r) == _piece(teacher_tokenizer, int(pm.indices[r, 0]))
    cov = coverage(pm)
    assert cov["exact_share"] > 0.5 and cov["mapped_share"] > 0.99


def test_specials_map_by_role(toy_map, student_tokenizer, teacher_tokenizer):
    s, t = student_tokenizer, teacher_tokenizer
    assert toy_map.indices[s.eos_token_id, 0] == t.eos_token_id
    assert toy_map.indices[s.pad_token_id, 0] == t.pad_token_id
    assert toy_map.indices[s.bos_token_id, 0] == -1  # the teacher has no BOS: reported, empty


def test_control_tokens_are_never_decomposed_by_the_text_of_their_name(student_tokenizer, teacher_tokenizer):
    """An added token marked special but not a special id (Llama-3's 251 <|reserved_special_token_N|>, the `<s>`
    of a tokenizer whose bos is another) is a control token: it maps to the teacher's token of the same text or
    nowhere (its probability then counts in the rest bucket), never onto the teacher's `<` as the first piece of
    its name, where a student could meet the teacher's `<` with probability on control tokens; a teacher's
    control token is not credited to the student token spelling the start of its name either."""
    import copy

    from tokenizers import AddedToken

    s, t = copy.deepcopy(student_tokenizer), copy.deepcopy(teacher_tokenizer)
    s.add_tokens([AddedToken("<|reserved_special_token_0|>", special=True), AddedToken("<tool_call>", special=True),
                  AddedToken("<think>", special=True)], special_tokens=True)
    t.add_tokens([AddedToken("<tool_call>", special=True), AddedToken("12zq", special=True)], special_tokens=True)
    t.add_tokens([AddedToken("<think>", special=False)])  # an ordinary added token in the teacher
    reserved, s_call, s_think, s_12 = s.convert_tokens_to_ids(["<|reserved_special_token_0|>", "<tool_call>", "<think>",
                                                               "12"])
    t_call, t_ctrl, t_think = t.convert_tokens_to_ids(["<tool_call>", "12zq", "<think>"])
    assert reserved not in s.all_special_ids and t_ctrl not in t.all_special_ids  # the case under test
    assert tokenizer_info(s).control[reserved]
    pm = build_projection(s, t)
    assert np.all(pm.indices[reserved] == -1) and pm.weights[reserved].sum() == 0
    assert "<|reserved_special_token_0|>" in pm.notes["specials_without_counterpart"]
    for student_id, teacher_id in ((s_call, t_call), (s_think, t_think)):  # the teacher's token of the same text
        assert pm.indices[student_id, 0] == teacher_id and pm.weights[student_id, 0] == 1.0 and pm.exact[student_id]
    # "12" is no teacher token (the teacher splits digits): the teacher tokens whose text starts with it are
    # credited to its row, but not the control token "12zq"
    assert not pm.exact[s_12] and t_ctrl not in pm.indices[s_12]
    assert not (pm.indices == t_ctrl).any()


@pytest.mark.parametrize("pieces", ["first", "all"])
def test_digit_groups_decompose_into_their_first_piece(pieces, student_tokenizer, teacher_tokenizer):
    # student groups digits 1-3, the teacher splits them: "12" -> "1" alone (pieces first: the first teacher token
    # of its text), or "1" (dominant) and "2" (pieces all, decay 0.5)
    pm = build_projection(student_tokenizer, teacher_tokenizer, top_k=4, pieces=pieces)
    rows = [i for i in range(len(student_tokenizer))
            if len(p := _piece(student_tokenizer, i)) == 2 and p.isdigit() and p[0] != p[1]]
    assert rows, "the toy student should have two-digit tokens"
    for r in rows:
        p = _piece(student_tokenizer, r)
        first, second = (teacher_tokenizer.convert_tokens_to_ids(chr(c)) for c in p)
        ids = pm.indices[r].tolist()
        assert ids[0] == first
        if pieces == "first":
            assert ids[1:] == [-1, -1, -1] and pm.weights[r, 0] == 1.0
        else:
            assert second in ids and pm.weights[r, 0] > pm.weights[r, ids.index(second)]


def test_teacher_ids_no_student_row_reaches_are_counted_and_named(toy_map, student_tokenizer, teacher_tokenizer):
    """A teacher token whose text the student splits (the toy teacher's "Ġbase", the toy student's "Ġb" + "ase")
    has no student row pointing at it: at a chunk's first row its probability has no student counterpart.
    `coverage` counts such ids and the report names some; a teacher token the student spells exactly is reached."""
    s, t = student_tokenizer, teacher_tokenizer
    split = t.convert_tokens_to_ids("Ġbase")
    assert split != t.unk_token_id and "Ġbase" not in s.get_vocab()
    assert len(s(" base", add_special_tokens=False)["input_ids"]) > 1  # the student splits its text
    unreached = unreached_teacher_ids(toy_map)
    pointed = set(toy_map.indices[toy_map.indices >= 0].tolist())
    assert split in unreached.tolist() and split not in pointed
    exact_targets = toy_map.indices[toy_map.exact, 0]
    assert not np.isin(exact_targets, unreached).any()
    assert sorted(set(range(len(t))) - pointed) == unreached.tolist()
    assert coverage(toy_map)["unreached_teacher_ids"] == unreached.size > 0
    report = format_report(toy_map, s, t)
    assert f"teacher ids no student row reaches: {unreached.size} of {len(t)}" in report
    # a map that reaches every teacher id reports none; one without a known teacher vocabulary counts -1
    full = ProjectionMap(np.arange(4, dtype=np.int64)[:, None], np.ones((4, 1), np.float32), "s", "t",
                         exact=np.ones(4, bool), teacher_vocab_size=4)
    assert unreached_teacher_ids(full).size == 0 and "no student row reaches" not in format_report(full)
    unknown = ProjectionMap(full.indices, full.weights, "s", "t", exact=full.exact)
    assert coverage(unknown)["unreached_teacher_ids"] == -1
    # train-student gives the store's teacher vocabulary for a map that does not record one (an imported map)
    assert unreached_teacher_ids(unknown, 6).tolist() == [4, 5] and unreached_teacher_ids(full, 6).size == 0


def test_sentencepiece_student_matches_byte_level_teacher(sp_tokenizer, teacher_tokenizer):
    pm = build_projection(sp_tokenizer, teacher_tokenizer, top_k=4)
    print("\nSentencePiece-style student -> byte-level teacher\n" + format_report(pm, sp_tokenizer, teacher_tokenizer))
    # "▁return" and "Ġreturn" are the same text: exact
    sp_id = sp_tokenizer.convert_tokens_to_ids("▁return")
    t_id = teacher_tokenizer.convert_tokens_to_ids("Ġreturn")
    assert sp_id is not None and t_id is not None
    assert pm.exact[sp_id] and pm.indices[sp_id, 0] == t_id
    # byte-fallback pieces map to the teacher's single-byte tokens
    b = sp_tokenizer.convert_tokens_to_ids("<0xC3>")
    assert pm.exact[b] and _piece(teacher_tokenizer, int(pm.indices[b, 0])) == b"\xc3"
    assert pm.indices[sp_tokenizer.eos_token_id, 0] == teacher_tokenizer.eos_token_id
    # the reverse direction (byte-level student) decomposes into regular pieces, not <0xNN> ones
    back = build_projection(teacher_tokenizer, sp_tokenizer, top_k=4)
    used = {sp_tokenizer.convert_ids_to_tokens(int(i)) for i in back.indices[back.indices >= 0]}
    names = sp_tokenizer.convert_ids_to_tokens(list(range(len(sp_tokenizer))))
    single = {_piece(sp_tokenizer, i) for i, n in enumerate(names) if not n.startswith("<0x")}
    for t in (t for t in used if t.startswith("<0x")):  # a byte piece only where no regular piece spells it
        assert bytes([int(t[3:5], 16)]) not in single, t
    assert back.notes["unmapped_tokens"] == []
    mapped = pm.indices[:, 0] >= 0
    assert mapped.mean() > 0.99


def test_save_load_and_fingerprints(toy_map, tmp_path, student_tokenizer, teacher_tokenizer):
    path = tmp_path / "w.safetensors"
    toy_map.save(path)
    back = ProjectionMap.load(path, expect_student=toy_map.student_fingerprint,
                              expect_teacher=toy_map.teacher_fingerprint)
    assert np.array_equal(back.indices, toy_map.indices) and np.array_equal(back.weights, toy_map.weights)
    assert np.array_equal(back.exact, toy_map.exact) and back.teacher_vocab_size == toy_map.teacher_vocab_size
    with pytest.raises(ProjectionError) as e:
        ProjectionMap.load(path, expect_student=toy_map.teacher_fingerprint)
    assert toy_map.teacher_fingerprint[:12] in str(e.value) and toy_map.student_fingerprint[:12] in str(e.value)
    with pytest.raises(ProjectionError, match="teacher tokenizer"):
        ProjectionMap.load(path, expect_teacher="0" * 64)
    # the digest follows what the map says, not where it was built or saved: a round trip keeps it, a map built
    # again from the tokenizers has it, one changed weight (or one exact flag) changes it
    assert back.digest() == toy_map.digest() == build_projection(student_tokenizer, teacher_tokenizer, top_k=4).digest()
    row = int(np.flatnonzero(toy_map.indices[:, 0] >= 0)[0])
    for change in ("weights", "exact"):
        other = ProjectionMap(toy_map.indices, toy_map.weights.copy(), toy_map.student_fingerprint,
                              toy_map.teacher_fingerprint, exact=toy_map.exact.copy(),
                              teacher_vocab_size=toy_map.teacher_vocab_size)
        if change == "weights":
            other.weights[row, 0] = np.nextafter(other.weights[row, 0], np.float32(0))
        else:
            other.exact[row] = ~other.exact[row]
        assert other.digest() != toy_map.digest(), change


def test_to_torch_sparse_with_padded_lm_head(student_tokenizer, teacher_tokenizer):
    import torch

    toy_map = build_projection(student_tokenizer, teacher_tokenizer, top_k=4, pieces="all")  # rows of several ids
    v_t = toy_map.teacher_vocab_size
    w = toy_map.to_torch_sparse(v_t + 64)  # lm_head padded beyond the tokenizer, as Qwen3's is
    assert w.is_sparse and w.dtype == torch.float32 and w.shape == (toy_map.student_vocab_size, v_t + 64)
    dense = w.to_dense()
    assert torch.all(dense[:, v_t:] == 0)  # padded columns are never targets
    r = int(np.flatnonzero(~toy_map.exact & (toy_map.indices[:, 1] >= 0))[0])
    for i, wt in zip(toy_map.indices[r], toy_map.weights[r]):
        if i >= 0:
            assert dense[r, i].item() == pytest.approx(float(wt))
    assert torch.allclose(dense.sum(1)[toy_map.indices[:, 0] >= 0], torch.ones(1))
    with pytest.raises(ProjectionError):
        toy_map.to_torch_sparse(v_t - 1)


def test_a_map_of_the_format_before_control_tokens_is_refused_naming_the_rebuild(toy_map, tmp_path):
    from safetensors.numpy import save_file

    path = tmp_path / "old.safetensors"
    save_file({"indices": toy_map.indices, "weights": toy_map.weights}, str(path), metadata={
        "format": "xtcache-projection/1", "student_fingerprint": "s", "teacher_fingerprint": "t",
        "teacher_vocab_size": str(toy_map.teacher_vocab_size)})
    with pytest.raises(ProjectionError, match=r"format xtcache-projection/1, which this xtcache no longer reads: its "
                                              r"control-token rows .* build it again with `xtcache projection build`"):
        ProjectionMap.load(path)


@pytest.mark.parametrize("mutate, match", [
    (lambda ind, w: (ind[:, :3], w), "same"),
    (lambda ind, w: (np.where(ind == 5, 10**7, ind), w), "outside the teacher vocabulary"),
    (lambda ind, w: (np.where(ind == 5, -3, ind), w), "negative teacher id"),
    (lambda ind, w: (ind, w * 2), "sum to"),
])
def test_malformed_maps_raise(toy_map, tmp_path, mutate, match):
    from safetensors.numpy import save_file

    ind, w = mutate(toy_map.indices.copy(), toy_map.weights.copy())
    path = tmp_path / "bad.safetensors"
    save_file({"indices": ind, "weights": w}, str(path), metadata={
        "format": "xtcache-projection/2", "student_fingerprint": "s", "teacher_fingerprint": "t",
        "teacher_vocab_size": str(toy_map.teacher_vocab_size)})
    with pytest.raises(ProjectionError, match=match):
        ProjectionMap.load(path)
    (tmp_path / "junk.safetensors").write_bytes(b"not a map")
    with pytest.raises(ProjectionError):
        ProjectionMap.load(tmp_path / "junk.safetensors")


def test_import_nemo_format(toy_map, tmp_path, student_tokenizer, teacher_tokenizer):
    import torch

    path = tmp_path / "nemo.pt"
    likelihoods = torch.from_numpy(toy_map.weights * 3.0)  # unnormalized, as a file may hold them
    torch.save({"indices": torch.from_numpy(toy_map.indices), "likelihoods": likelihoods}, path)
    pm, changes = import_nemo(path, student_tokenizer, teacher_tokenizer)
    assert np.array_equal(pm.indices, toy_map.indices) and np.allclose(pm.weights, toy_map.weights, atol=1e-6)
    assert np.array_equal(pm.exact, toy_map.exact) and changes["duplicate_entries_merged"] == 0
    # a row naming one teacher id twice (as real NeMo-RL maps do): merged, weights summed, counted
    dup_idx, dup_w = toy_map.indices.copy(), toy_map.weights.copy()
    row = int(np.nonzero((dup_idx[:, 0] >= 0) & (dup_idx[:, 1] < 0))[0][0])
    dup_idx[row, 1], dup_w[row, :2] = dup_idx[row, 0], [0.25, 0.75]
    torch.save({"indices": torch.from_numpy(dup_idx), "likelihoods": torch.from_numpy(dup_w)}, path)
    merged, changes = import_nemo(path, student_tokenizer, teacher_tokenizer)
    assert changes["duplicate_entries_merged"] == 1 and changes["rows_with_duplicates"] == 1
    assert merged.indices[row, 0] == dup_idx[row, 0] and merged.indices[row, 1] == -1
    assert merged.weights[row, 0] == pytest.approx(1.0)
    bad = toy_map.indices.copy()
    bad[3, 0] = len(teacher_tokenizer) + 5
    torch.save({"indices": torch.from_numpy(bad), "likelihoods": likelihoods}, path)
    with pytest.raises(ProjectionError, match="outside the teacher vocabulary"):
        import_nemo(path, student_tokenizer, teacher_tokenizer)
    torch.save({"indices": torch.from_numpy(toy_map.indices[:10]), "likelihoods": likelihoods[:10]}, path)
    with pytest.raises(ProjectionError, match="rows"):
        import_nemo(path, student_tokenizer, teacher_tokenizer)
    torch.save({"ids": torch.zeros(2)}, path)
    with pytest.raises(ProjectionError, match="likelihoods"):
        import_nemo(path, student_tokenizer, teacher_tokenizer)


def test_cli_build_inspect_import(toy_setup, tmp_path):
    import torch

    out = tmp_path / "w.safetensors"
    s, t = str(toy_setup.student_tokenizer), str(toy_setup.teacher_tokenizer)
    res = xtcache("projection", "build", "--student-tokenizer", s, "--teacher-tokenizer", t, "--out", out,
                  "--top-k", "3")
    assert res.returncode == 0, res.stdout + res.stderr
    print("\n" + res.stdout)
    assert "exact matches" in res.stdout and "<s>" in res.stdout and out.is_file()
    pm = ProjectionMap.load(out)
    assert pm.top_k == 3
    res = xtcache("projection", "inspect", out, "--student-tokenizer", s, "--teacher-tokenizer", t)
    assert res.returncode == 0 and "rows with mapping" in res.stdout and "'</s>' -> '<|endoftext|>'" in res.stdout
    assert "teacher ids no student row reaches" in res.stdout
    assert "  empty rows: '<s>'" in res.stdout, res.stdout  # the student's <s> has no teacher counterpart
    assert f"  content sha256    {pm.digest()} " in res.stdout  # what a run's summary names its map by
    res = xtcache("projection", "inspect", out)  # no tokenizers: rows shown as ids
    assert res.returncode == 0 and "exact matches" in res.stdout and " -> " in res.stdout, res.stdout + res.stderr
    empty_ids = [int(i) for i in np.flatnonzero(pm.indices[:, 0] < 0)]
    # a list of ids, said to be ids: "empty rows: 0" would read as a count
    assert f"  empty rows (student ids): {', '.join(map(str, empty_ids))}" in res.stdout.splitlines(), res.stdout
    nemo = tmp_path / "n.pt"
    torch.save({"indices": torch.from_numpy(pm.indices), "likelihoods": torch.from_numpy(pm.weights)}, nemo)
    res = xtcache("projection", "import", nemo, "--student-tokenizer", s, "--teacher-tokenizer", t,
                  "--out", tmp_path / "imported.safetensors")
    assert res.returncode == 0, res.stdout + res.stderr
    res = xtcache("projection", "build", "--student-tokenizer", s, "--teacher-tokenizer", t, "--out", out,
                  "--top-k", "0")
    assert res.returncode == 2 and "--top-k 0" in res.stderr, res.stdout + res.stderr  # click's usage error
    res = xtcache("projection", "build", "--student-tokenizer", tmp_path / "nope", "--teacher-tokenizer", t,
                  "--out", out)
    # an XtcacheError: main() prints it as one `error: ...` line and exits 2
    assert res.returncode == 2 and res.stderr.startswith("error: ") and res.stderr.count("\n") == 1, res.stderr
