"""Property tests of the top-k codecs (xtcache.store.codecs): exact id round trips, stated error bounds.

    .venv/bin/python -m pytest -q tests/test_codecs.py
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from xtcache.errors import StoreError, XtcacheError
from xtcache.store import codecs

SETTINGS = settings(max_examples=60, deadline=None)


@st.composite
def topk_rows(draw):
    """(ids [P, k] unique per row, vocab) with P in [0, 40], vocab up to 262,144, k <= vocab."""
    vocab = draw(st.sampled_from([1, 2, 7, 300, 65_535, 65_536, 65_537, 151_936, 262_144]))
    k = draw(st.integers(1, min(vocab, 64)))
    P = draw(st.integers(0, 40))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if k == vocab:
        ids = np.stack([rng.permutation(vocab) for _ in range(P)]) if P else np.zeros((0, k), np.int64)
    else:
        ids = np.stack([rng.choice(vocab, k, replace=False) for _ in range(P)]) if P else np.zeros((0, k), np.int64)
    return ids.astype(np.int32), vocab


@SETTINGS
@given(topk_rows())
def test_sorted_delta_ids_round_trip(case):
    ids, vocab = case
    codec = codecs.SortedDeltaIds("uint16" if vocab <= 65_536 else "uint32")
    deltas, order = codec.encode(ids)
    assert deltas.dtype == np.dtype(codec.dtype)
    decoded = codec.decode(deltas)
    assert decoded.dtype == np.int32 and decoded.shape == ids.shape
    np.testing.assert_array_equal(decoded, np.sort(ids, axis=1))
    np.testing.assert_array_equal(np.take_along_axis(ids, order, 1), decoded)
    assert codecs.codec_from_config(codec.to_config()) == codec


def test_full_vocab_ids_are_all_ones_after_the_first():
    rng = np.random.default_rng(0)
    ids = np.stack([rng.permutation(1000) for _ in range(5)])
    deltas, _ = codecs.SortedDeltaIds("uint16").encode(ids)
    assert (deltas[:, 0] == 0).all() and (deltas[:, 1:] == 1).all()


def test_uint16_ids_refuse_large_deltas():
    with pytest.raises(XtcacheError, match="does not fit uint16"):
        codecs.SortedDeltaIds("uint16").encode(np.array([[3, 70_000]]))


@SETTINGS
@given(st.integers(0, 30), st.integers(1, 64), st.sampled_from([8, 16]),
       st.floats(-40.0, -1.0), st.integers(0, 2**32 - 1))
def test_quantized_logprobs_error_bound(P, k, bits, floor, seed):
    rng = np.random.default_rng(seed)
    codec = codecs.QuantizedLogProbs(bits=bits, min_logprob=floor)
    lp = (-rng.exponential(scale=-floor / 3, size=(P, k))).astype(np.float32)
    if P:
        lp[0, 0] = 0.0
        lp[-1, -1] = floor * 2  # below the floor: clamped
    codes = codec.encode(lp)
    assert codes.dtype == np.dtype(codec.dtype)
    decoded = codec.decode(codes)
    want = np.maximum(lp, floor)
    float32_rounding = -floor * 2.0**-23
    assert np.abs(decoded - want).max(initial=0) <= codec.max_abs_error + float32_rounding
    assert decoded.max(initial=0) <= 0
    cfg = codec.to_config()
    assert cfg["configuration"]["max_abs_error"] == codec.max_abs_error
    assert codecs.codec_from_config(cfg) == codec


def test_quantized_logprobs_special_values():
    codec = codecs.QuantizedLogProbs(8, -20.0)
    decoded = codec.decode(codec.encode(np.array([[-np.inf, 1e-6, np.nan]], dtype=np.float32)))
    np.testing.assert_allclose(decoded, [[-20.0, 0.0, -20.0]])


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_float_logprobs(dtype):
    rng = np.random.default_rng(1)
    lp = (-rng.exponential(4.0, size=(50, 16))).astype(np.float32)
    codec = codecs.FloatLogProbs(dtype)
    decoded = codec.decode(codec.encode(lp))
    if dtype == "float32":
        np.testing.assert_array_equal(decoded, lp)
    else:
        np.testing.assert_allclose(decoded, lp, rtol=2 ** -11)
    assert codecs.codec_from_config(codec.to_config()) == codec


def _kl_topk_rest(lp, decoded):
    p = np.exp(lp.astype(np.float64))
    rest = np.clip(1 - p.sum(1, keepdims=True), 0, None)
    q = np.concatenate([np.exp(decoded.astype(np.float64)), rest], 1)
    q /= q.sum(1, keepdims=True)
    pf = np.concatenate([p, rest], 1)
    return float(np.sum(pf * (np.log(np.maximum(pf, 1e-300)) - np.log(np.maximum(q, 1e-300))), 1).mean())


@pytest.mark.parametrize("mode,k", [("topk", 8), ("topk", 64), ("topk", 256), ("full", 4096)])
def test_default_quantization_fidelity(mode, k):
    """Mean KL(original top-k + rest || decoded) stays below 1e-3 nats for LM-like distributions, for every
    k (the sqrt code's error grows with k) and over a whole vocabulary (full mode)."""
    rng = np.random.default_rng(2)
    logits = rng.standard_normal((500, 4096)) * 3.0
    logp = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    top = np.sort(logp, axis=1)[:, ::-1][:, :k].astype(np.float32)
    codec = codecs.codec_from_config(codecs.default_codecs(mode, 4096, k=k)["topk_logprobs"])
    kl = _kl_topk_rest(top, codec.decode(codec.encode(top)))
    assert 0 < kl < 1e-3


def test_bad_configs():
    with pytest.raises(XtcacheError, match="use 8 or 16"):
        codecs.QuantizedLogProbs(bits=4)
    with pytest.raises(XtcacheError, match="must be negative"):
        codecs.QuantizedLogProbs(min_logprob=0.0)
    with pytest.raises(XtcacheError, match="use 'float16' or 'float32'"):
        codecs.FloatLogProbs("bfloat16")
    with pytest.raises(StoreError, match="unknown codec 'xtcache.future'"):
        codecs.codec_from_config({"name": "xtcache.future", "configuration": {}})
    with pytest.raises(XtcacheError, match="id 10 is outside the teacher vocabulary"):
        codecs.check_ids(np.array([[1, 10]]), 10)


def test_store_fidelity_on_toy_teacher(toy_setup):
    """Real teacher distributions through the store: mean KL(top-k + rest || decoded) < 1e-3 nats."""
    import json

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from schemas.models import Manifest
    from xtcache.store import CacheReader, CacheWriter, DocRecord

    tok = AutoTokenizer.from_pretrained(str(toy_setup.teacher_model))
    model = AutoModelForCausalLM.from_pretrained(str(toy_setup.teacher_model), dtype=torch.float32).eval()
    texts = [json.loads(line)["text"] for line in toy_setup.heldout_jsonl.read_text().splitlines()[:6]]
    k, docs = 64, []
    with torch.inference_mode():
        for row, text in enumerate(texts):
            ids = tok(text)["input_ids"][:200]
            logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0], dim=-1)  # [T, V]
            top = torch.topk(logp[:-1], k, dim=-1)
            T = len(ids)
            top_ids = np.zeros((T, k), np.int32)
            top_lp = np.zeros((T, k), np.float32)
            top_ids[1:], top_lp[1:] = top.indices.numpy(), top.values.numpy()
            rest = np.clip(1 - np.exp(top_lp.astype(np.float64)).sum(1), 0, None).astype(np.float32)
            docs.append(DocRecord(
                source="heldout", row=row, text=text, teacher_ids=np.array(ids, np.int32),
                char_offsets=np.zeros((T, 2), np.int32), has_pred=np.arange(T) > 0, topk_ids=top_ids,
                topk_logprobs=top_lp, topk_counts=None, residual=rest,
                realized_logprob=np.full(T, -1.0, np.float32)))
    url = "memory://fidelity-toy-teacher"
    with CacheWriter(url, Manifest(cache_key="fidelity", mode="topk", k=k, teacher_vocab_size=len(tok))) as w:
        w.write_part(0, docs)
    got = CacheReader(url).read_shard("w00000-p000000", verify=True)
    kls = []
    for i, doc in enumerate(docs):
        rec = got.doc(i)
        hp = doc.has_pred
        order = np.argsort(doc.topk_ids, axis=1, kind="stable")
        by_id = np.argsort(rec.topk_ids, axis=1, kind="stable")  # the store's rows (dictionary codes) by id
        np.testing.assert_array_equal(np.take_along_axis(rec.topk_ids, by_id, 1)[hp],
                                      np.take_along_axis(doc.topk_ids, order, 1)[hp])
        kls.append(_kl_topk_rest(np.take_along_axis(doc.topk_logprobs, order, 1)[hp],
                                 np.take_along_axis(rec.topk_logprobs, by_id, 1)[hp]))
    assert 0 < float(np.mean(kls)) < 1e-3
