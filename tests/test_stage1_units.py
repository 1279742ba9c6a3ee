"""Stage 1 pure parts: teacher windows, exact targets from logits, corpus reading, configuration.

    .venv/bin/python -m pytest -q tests/test_stage1_units.py
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stage1_teacher import config
from stage1_teacher.corpus import Document, Skipped, iter_corpus
from stage1_teacher.windows import plan_windows, window_has_pred, window_tokens
from xtcache.cliconfig import read_config_file
from xtcache.errors import ConfigError

# ------------------------------------------------------------------------------------ windows


@settings(max_examples=300, deadline=None)
@given(n=st.integers(1, 200), max_len=st.integers(4, 40), data=st.data(), bos=st.booleans(),
       cut_anywhere=st.booleans())
def test_windows_cover_every_row_once(n, max_len, data, bos, cut_anywhere):
    overlap = data.draw(st.integers(0, max_len - 2 - int(bos)))
    cuts = sorted(data.draw(st.sets(st.integers(1, n), max_size=n)))
    bounds = None if cut_anywhere else np.array(cuts, dtype=np.int64)
    ws = plan_windows(n, max_len, overlap, bounds, bos_prefix=bos)
    stored = np.concatenate([np.arange(w.store_start, w.end) for w in ws])
    assert np.array_equal(stored, np.arange(n))  # each row stored by exactly one window, in order
    for i, w in enumerate(ws):
        assert w.length <= max_len
        assert w.ctx_start <= w.store_start < w.end
        if i and not bos:
            assert w.store_start - w.ctx_start == min(overlap, w.store_start)
        fits = bounds is not None and np.any((bounds > w.store_start) & (bounds <= w.ctx_start + max_len - w.prefix))
        if w.end < n and fits:
            assert w.end in set(bounds.tolist())  # cut at a chunk boundary when one fits
    pred = np.concatenate([window_has_pred(w) for w in ws])
    assert not pred[0]
    if overlap > 0 or bos:
        assert pred[1:].all()  # left context or a BOS gives every later row a prediction


def test_window_tokens_prepend_bos():
    ids = np.arange(10, 30)
    ws = plan_windows(20, 8, 2, None, bos_prefix=True)
    toks = [window_tokens(ids, w, bos_id=10) for w in ws]
    assert toks[0].tolist() == list(range(10, 18))
    assert toks[1][0] == 10 and toks[1][1:].tolist() == list(range(10 + ws[1].ctx_start, 10 + ws[1].end))


# ------------------------------------------------------------------------------------ targets


def _reference(z: np.ndarray, V: int):
    z = z.astype(np.float64)
    lse = np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1)
    return z - lse[:, None]


@pytest.mark.parametrize("mode", ["topk", "full", "sampled"])
def test_distill_targets_match_numpy(mode):
    import torch

    from stage1_teacher.capture.head import distill_targets

    rng = np.random.default_rng(0)
    n, V, pad = 37, 50, 6
    z = rng.normal(size=(n, V + pad)).astype(np.float32) * 3
    z[:, V:] += 2.0  # padded columns with real mass: must never be emitted
    tgt = rng.integers(0, V, size=n)
    lp = _reference(z, V)
    t = distill_targets(torch.from_numpy(z), tgt, mode=mode, k=8, vocab_size=V, num_samples=20,
                        generator=torch.Generator().manual_seed(1), rows_per_block=10)
    np.testing.assert_allclose(t.realized, lp[np.arange(n), tgt], atol=1e-5)
    pad_mass = np.exp(lp[:, V:]).sum(1)
    if mode == "topk":
        assert (t.ids < V).all()
        want = np.sort(np.argsort(-lp[:, :V], 1)[:, :8], 1)
        assert np.array_equal(np.sort(t.ids, 1), want)
        np.testing.assert_allclose(t.logprobs, np.take_along_axis(lp, t.ids.astype(np.int64), 1), atol=1e-5)
        np.testing.assert_allclose(t.residual, 1 - np.exp(np.take_along_axis(lp, want, 1)).sum(1), atol=1e-5)
    elif mode == "full":
        assert t.ids.shape == (n, V) and (t.ids == np.arange(V)).all()
        np.testing.assert_allclose(t.logprobs, lp[:, :V], atol=1e-5)
        np.testing.assert_allclose(t.residual, pad_mass, atol=1e-5)  # mass of padded columns
    else:
        assert (t.counts.sum(1) == 20).all()
        assert (t.ids[t.counts > 0] < V).all()
        for r in range(n):  # unique ids, sorted by count, then id
            live = t.counts[r] > 0
            assert len(set(t.ids[r][live].tolist())) == live.sum()
            key = list(zip(-t.counts[r][live].astype(int), t.ids[r][live]))
            assert key == sorted(key)
        again = distill_targets(torch.from_numpy(z), tgt, mode=mode, k=8, vocab_size=V, num_samples=20,
                                generator=torch.Generator().manual_seed(1), rows_per_block=10)
        assert np.array_equal(again.ids, t.ids) and np.array_equal(again.counts, t.counts)


def test_sampled_frequencies_follow_the_teacher():
    import torch

    from stage1_teacher.capture.head import distill_targets

    z = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(4000, 1)
    t = distill_targets(z, np.zeros(4000), mode="sampled", k=4, vocab_size=4, num_samples=8,
                        generator=torch.Generator().manual_seed(0))
    freq = np.zeros(4)
    np.add.at(freq, t.ids.ravel(), t.counts.ravel())
    np.testing.assert_allclose(freq / freq.sum(), torch.softmax(z[0], 0).numpy(), atol=0.01)


def test_topk_larger_than_vocab_is_refused():
    import torch

    from stage1_teacher.capture.head import distill_targets
    from xtcache.errors import CaptureError

    with pytest.raises(CaptureError, match="--top-k"):
        distill_targets(torch.zeros(2, 10), np.zeros(2), mode="topk", k=11, vocab_size=10)


@pytest.mark.parametrize("tied", [False, True])
def test_teacher_head_reproduces_hf_logits(toy_setup, tied):
    import torch
    from transformers import AutoModelForCausalLM

    from stage1_teacher.capture.head import TeacherHead
    from xtcache.testing.toy_teacher import build_vllm_teacher

    path = build_vllm_teacher(toy_setup.root, tied=tied, steps=0 if tied else 120)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    ids = torch.arange(5, 40)[None]
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
    head = TeacherHead.load(str(path), "cpu")
    np.testing.assert_allclose(head.logits(out.hidden_states[-1][0]).numpy(), out.logits[0].numpy(), atol=1e-4)


def test_teacher_without_weights_is_refused(tmp_path):
    from stage1_teacher.capture.head import weight_files
    from xtcache.errors import CaptureError

    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CaptureError, match="safetensors"):
        weight_files(str(tmp_path))


# ------------------------------------------------------------------------------------- corpus


def _write_corpus(tmp_path, texts):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"text": texts, "other": list(range(len(texts)))})
    pq.write_table(table, tmp_path / "c.parquet", row_group_size=7)
    with pa.OSFile(str(tmp_path / "c.arrow"), "wb") as f, pa.ipc.new_file(f, table.schema) as w:
        w.write_table(table, max_chunksize=5)
    with open(tmp_path / "c.jsonl", "w") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
    (tmp_path / "c.txt").write_text("".join(t.replace("\n", " ") + "\n" for t in texts))
    return [tmp_path / n for n in ("c.parquet", "c.arrow", "c.jsonl", "c.txt")]


def test_corpus_formats_stream_the_same_documents(tmp_path):
    texts = [f"document number {i} says hello" for i in range(23)]
    for path in _write_corpus(tmp_path, texts):
        docs = list(iter_corpus([str(path)], "text", batch_rows=4))
        assert [d.text for d in docs] == texts, path
        assert [d.row for d in docs] == list(range(23))
        assert docs[3].doc_id == f"{path.name}:3:{Document('x', 0, texts[3]).content_hash}"


def test_corpus_bad_rows_are_skipped_with_reasons(tmp_path):
    p = tmp_path / "bad.jsonl"
    with open(p, "wb") as f:
        f.write(b'{"text": "fine"}\n')
        f.write(b'{"text": ""}\n')
        f.write(b'{"other": "no text"}\n')
        f.write(b'{"text": "bad \xff byte"}\n')
        f.write(b'{"text": "lone \\ud800 surrogate"}\n')
        f.write(b'{"text": 3}\n')
        f.write(b'not json\n')
    items = list(iter_corpus([str(p)], "text"))
    assert isinstance(items[0], Document)
    assert [i.reason for i in items[1:]] == ["empty document", "missing text field", "invalid UTF-8",
                                              "invalid UTF-8", "text field is not a string", "invalid JSON"]
    with pytest.raises(ConfigError, match="--text-field"):
        list(iter_corpus([str(_write_corpus(tmp_path, ["a"])[0])], "body"))
    with pytest.raises(ConfigError, match="unknown corpus format"):
        list(iter_corpus([str(tmp_path / "x.csv")] if (tmp_path / "x.csv").write_text("a") else [], "text"))


def test_corpus_larger_than_a_batch_streams(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    n = 5000
    pq.write_table(pa.table({"text": [f"row {i}" for i in range(n)]}), tmp_path / "big.parquet", row_group_size=512)
    it = iter_corpus([str(tmp_path / "big.parquet")], "text", batch_rows=100)
    first = next(it)
    assert first.text == "row 0"
    assert sum(1 for _ in it) == n - 1
    assert not any(isinstance(x, Skipped) for x in iter_corpus([str(tmp_path / "big.parquet")], "text"))


# ------------------------------------------------------------------------------------- config


BASE = {"teacher": "t", "student_tokenizer": ["s"], "data": ["d.jsonl"], "out": "o"}


@pytest.mark.parametrize("override,flag", [
    ({"top_k": 0}, "--top-k"), ({"mode": "x"}, "--mode"), ({"window_overlap": 2047}, "--window-overlap"),
    ({"shard_index": 2, "num_shards": 2}, "--shard-index"), ({"num_samples": 0}, "--num-samples"),
    ({"engine": "tgi"}, "--engine"), ({"out": None}, "--out"), ({"max_model_len": 100}, "--max-model-len"),
])
def test_config_checks_name_the_flag(override, flag):
    with pytest.raises(ValueError, match=flag):
        config.build_config({**BASE, **override})


@pytest.mark.parametrize("suffix,text", [
    (".yaml", "capture:\n  top_k: 8\nmode: full\nstorage-options: {a: 1}\n"),
    (".toml", "mode = \"full\"\nstorage_options = {a = 1}\n[capture]\ntop_k = 8\n"),
])
def test_config_file_flat_or_sectioned(tmp_path, suffix, text):
    p = tmp_path / f"c{suffix}"
    p.write_text(text)
    values = read_config_file(config.TeacherDumpConfig, str(p))
    cfg = config.build_config({**BASE, **values})
    assert cfg.capture.top_k == 8 and cfg.capture.mode == "full" and cfg.store.storage_options == {"a": 1}
    p.write_text("nonsense_key: 1\n" if suffix == ".yaml" else "nonsense_key = 1\n")
    with pytest.raises(ConfigError, match="nonsense_key"):
        read_config_file(config.TeacherDumpConfig, str(p))


def test_cli_flags_win_over_config_file(tmp_path, monkeypatch):
    from stage1_teacher.dry_run import DryRun
    from tests.commands import xtcache

    p = tmp_path / "c.yaml"
    for d in ("t", "s"):  # paths are checked before anything reads them; run_teacher_dump is replaced below
        (tmp_path / d).mkdir()
    (tmp_path / "d.jsonl").write_text("")
    p.write_text(f"top_k: 8\nmode: full\nteacher: {tmp_path / 't'}\nstudent_tokenizer: [{tmp_path / 's'}]\n"
                 f"data: [{tmp_path / 'd.jsonl'}]\nout: {tmp_path / 'o'}\n")
    seen = {}

    def fake_run(cfg, **_):
        seen["cfg"] = cfg
        return DryRun(store="o", cache_key="k")

    import stage1_teacher.cli

    monkeypatch.setattr(stage1_teacher.cli, "run_teacher_dump", fake_run)
    r = xtcache("teacher-dump", "--config", p, "--top-k", "4")
    assert r.returncode == 0, r.stdout + r.stderr
    assert seen["cfg"].capture.top_k == 4 and seen["cfg"].capture.mode == "full"


# ----------------------------------------------------------------------- capture decoding / check


def _flat_from_logits(z: np.ndarray, tokens: np.ndarray, k: int):
    """A vLLM-style FlatLogprobs (position 0 empty; then [realized, top1..topk]) built from logits."""
    from vllm.logprobs import FlatLogprobs

    lp = _reference(z, z.shape[1])
    flat = FlatLogprobs()
    flat.append(None)
    for r in range(len(z)):
        top = np.argsort(-lp[r])[:k]
        ids = [int(tokens[r + 1])] + top.tolist()
        flat.append_fast(ids, [float(lp[r, i]) for i in ids], iter(range(len(ids))), [None] * len(ids))
    return flat, lp


@pytest.mark.parametrize("mode", ["topk", "full", "sampled"])
def test_prompt_logprob_fallback_decodes_exactly(mode):
    import torch

    from stage1_teacher.capture.head import distill_targets
    from stage1_teacher.capture.run import Capture, logprobs_to_targets
    from stage1_teacher.capture.vllm_engine import parse_flat

    rng = np.random.default_rng(3)
    L, V, pad = 12, 30, 4
    z = rng.normal(size=(L - 1, V + pad)).astype(np.float32) * 2
    z[:, V:] += 3.0  # padded columns rank high: they must be dropped, not emitted
    tokens = rng.integers(0, V, size=L)
    k_req = 6 + pad if mode == "topk" else V + pad
    flat, lp = _flat_from_logits(z, tokens, k_req)
    raw = parse_flat(flat, L)
    assert raw.ids.shape == (L - 1, k_req)
    cap = Capture(engine=None, kind="logprobs", mode=mode, k=6 if mode == "topk" else (V if mode == "full" else 8),
                  vocab_size=V, num_samples=8, seed=0)
    sel = np.arange(L - 1)
    got = logprobs_to_targets(raw, sel, cap, torch.Generator().manual_seed(5))
    want = distill_targets(torch.from_numpy(z), tokens[1:], mode=mode, k=cap.k, vocab_size=V, num_samples=8,
                           generator=torch.Generator().manual_seed(5))
    np.testing.assert_allclose(got.realized, want.realized, atol=1e-5)
    np.testing.assert_allclose(got.residual, want.residual, atol=1e-5)
    if mode == "sampled":
        assert np.array_equal(got.counts, want.counts) and np.array_equal(got.ids, want.ids)
    else:
        assert np.array_equal(np.sort(got.ids, 1), np.sort(want.ids, 1))
        np.testing.assert_allclose(np.take_along_axis(lp, got.ids.astype(np.int64), 1), got.logprobs, atol=1e-5)


def test_fast_path_check_refuses_a_wrong_head():
    import torch

    from stage1_teacher.capture.head import TeacherHead
    from stage1_teacher.capture.run import compare_with_reference, default_tolerance
    from stage1_teacher.capture.vllm_engine import parse_flat
    from xtcache.errors import CaptureError

    torch.manual_seed(0)
    W = torch.randn(40, 8)
    h = torch.randn(10, 8)
    tokens = np.arange(10) % 40
    flat, _ = _flat_from_logits((h @ W.t()).numpy()[:-1], tokens, 5)
    ref = [parse_flat(flat, 10)]
    assert compare_with_reference([h], ref, TeacherHead(weight=W), "float32", 1e-4)["max_gap"] < 1e-4
    with pytest.raises(CaptureError, match="disagrees"):
        compare_with_reference([h], ref, TeacherHead(weight=W, logit_scale=1.5), "float32")
    # half precision: single entries may be a few tenths off, but a systematically wrong head
    # (10% logit scaling missing) moves the mean gap and is still refused
    assert default_tolerance("bfloat16", 4.0)[1] == 0.05
    with pytest.raises(CaptureError, match="mean"):
        compare_with_reference([h], ref, TeacherHead(weight=W, logit_scale=1.1), "bfloat16")


def test_lines_across_block_boundaries_and_file_url_globs(tmp_path):
    import io

    from stage1_teacher.config import expand_globs
    from stage1_teacher.corpus import read_lines

    data = b'{"text": "a"}\n\n{"text": "bc"}\r\nlast'
    assert list(read_lines(io.BytesIO(data), block=3)) == data.split(b"\n")
    assert list(read_lines(io.BytesIO(data + b"\n"), block=5)) == data.split(b"\n")
    for name in ("b.jsonl", "a.jsonl"):
        (tmp_path / name).write_text('{"text": "x"}\n')
    assert expand_globs([f"file://{tmp_path}/*.jsonl"]) == [str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")]


def test_data_storage_options_default_to_the_store_options():
    from stage1_teacher.config import build_config

    base = {"teacher": "t", "student_tokenizer": ["s"], "data": ["c.jsonl"], "out": "s3://b/x",
            "storage_options": '{"endpoint_url": "http://store"}'}
    assert build_config(base).data_options == {"endpoint_url": "http://store"}
    assert build_config({**base, "data_storage_options": ""}).data_options == {"endpoint_url": "http://store"}
    own = build_config({**base, "data_storage_options": '{"token": "anon"}'})
    assert own.data_options == {"token": "anon"} and own.store.storage_options == {"endpoint_url": "http://store"}
