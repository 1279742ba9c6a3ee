"""A teacher cache written straight through `xtcache.store.CacheWriter`, without stage 1.

`build_hf_cache` runs the teacher's HF forward itself and writes top-k (sampled, or head + tail) targets and
any alignment groups: a real store for benchmarks that must not depend on stage 1's engines
(bench/train_step.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from schemas.models import DRAWN_MODES, AlignGroupMeta, Manifest, support_width
from xtcache.align.chunks import align_text, identity_alignment
from xtcache.align.tokenizer import encode_with_offsets
from xtcache.fingerprint import cache_key, model_fingerprint, settings_fingerprint, tokenizer_fingerprint
from xtcache.store import AlignmentRecord, CacheWriter, DocRecord


def build_hf_cache(url: str | Path, teacher_dir: str | Path, jsonl: str | Path, students: list[str | Path], *,
                   k: int = 16, max_docs: int = 40, docs_per_part: int = 16, mode: str = "topk",
                   num_samples: int = 32, seed: int = 0) -> str:
    """A real teacher cache: HF forward of the teacher, top-k (sampled, or headtail: the top-`k` head exactly
    plus `num_samples` draws from the rest) log-probs, and an alignment group per tokenizer directory in
    `students` (identity for the teacher's own)."""
    import torch
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    teacher_tok = PreTrainedTokenizerFast.from_pretrained(str(teacher_dir))  # as stage 1: tokenizer.json as is
    model = AutoModelForCausalLM.from_pretrained(str(teacher_dir), dtype=torch.float32).eval()
    vocab = len(teacher_tok)
    t_fp = tokenizer_fingerprint(teacher_tok)
    student_toks = [PreTrainedTokenizerFast.from_pretrained(str(s)) for s in students]
    s_fps = [tokenizer_fingerprint(t) for t in student_toks]
    texts = [json.loads(line)["text"] for line in Path(jsonl).read_text().splitlines()][:max_docs]
    drawn = mode in DRAWN_MODES
    settings = {"mode": mode, "k": k, "num_samples": num_samples if drawn else None, "engine": "test-hf"}
    head_k, k = k, support_width(mode, k, num_samples, vocab)
    fps = {"teacher_model": model_fingerprint(teacher_dir), "teacher_tokenizer": t_fp,
           "corpus": settings_fingerprint({"file": str(jsonl), "n": len(texts)}),
           "settings": settings_fingerprint(settings)}
    manifest = Manifest(cache_key=cache_key(**fps), mode=mode, k=k, teacher_vocab_size=vocab,
                        num_samples=num_samples if drawn else None, top_k=head_k if mode == "headtail" else None,
                        teacher_name=str(teacher_dir),
                        fingerprints=fps, settings=settings,
                        alignment_groups=[AlignGroupMeta(fingerprint=fp, tokenizer_name=str(s), vocab_size=len(t),
                                                         identity=fp == t_fp)
                                          for fp, s, t in zip(s_fps, students, student_toks)])
    gen = torch.Generator().manual_seed(seed)
    writer = CacheWriter(str(url), manifest)
    for part, start in enumerate(range(0, len(texts), docs_per_part)):
        docs, aligns = [], {fp: [] for fp in s_fps}
        for row, text in enumerate(texts[start:start + docs_per_part], start=start):
            ids, offsets = encode_with_offsets(teacher_tok, text)
            with torch.no_grad():
                logp = torch.log_softmax(model(input_ids=torch.as_tensor(ids)[None]).logits[0, :, :vocab].float(), -1)
            prev = logp[:-1]  # row t (t >= 1) predicts token t from tokens < t
            n = len(ids)
            has_pred = np.arange(n) > 0
            realized = np.full(n, np.nan, dtype=np.float32)
            realized[1:] = prev.gather(1, torch.as_tensor(ids[1:])[:, None])[:, 0].numpy()
            top_ids = np.zeros((n, k), dtype=np.int32)
            top_lp = np.zeros((n, k), dtype=np.float32)
            counts = None
            residual = np.zeros(n, dtype=np.float32)
            if mode == "headtail":  # the store's widths: log-probs of the head, counts of the tail
                top_lp, counts = np.zeros((n, head_k), dtype=np.float32), np.zeros((n, k - head_k), dtype=np.uint16)
                residual[1:] = _head_tail(prev, head_k, num_samples, gen, top_ids[1:], top_lp[1:], counts[1:])
            elif mode == "sampled":
                counts = np.zeros((n, k), dtype=np.uint16)
                draws = torch.multinomial(prev.exp(), num_samples, replacement=True, generator=gen)
                for t in range(1, n):
                    u, c = np.unique(draws[t - 1].numpy(), return_counts=True)
                    top_ids[t, :len(u)], counts[t, :len(u)] = u, c
            else:
                lp, ti = prev.topk(k, dim=-1)
                top_ids[1:], top_lp[1:] = ti.numpy(), lp.numpy()
                residual[1:] = np.clip(1.0 - np.exp(top_lp[1:]).sum(-1), 0.0, 1.0)
            docs.append(DocRecord(source=str(jsonl), row=row, text=text, teacher_ids=ids.astype(np.int32),
                                  char_offsets=offsets.astype(np.int32), has_pred=has_pred, topk_ids=top_ids,
                                  topk_logprobs=None if mode == "sampled" else top_lp, topk_counts=counts,
                                  residual=residual, realized_logprob=realized))
            for fp, tok in zip(s_fps, student_toks):
                if fp == t_fp:
                    s_ids, alignment = ids, identity_alignment(n)
                else:
                    s_ids, t_ids, alignment = align_text(text, tok, teacher_tok)
                    assert np.array_equal(t_ids, ids)
                aligns[fp].append(AlignmentRecord(student_ids=np.asarray(s_ids, dtype=np.int32), alignment=alignment))
        writer.write_part(part, docs, aligns)
    writer.finish()
    return str(url)


def _head_tail(logp, head_k: int, num_samples: int, gen, ids: np.ndarray, lp: np.ndarray, counts: np.ndarray):
    """Head + tail targets of rows `logp` [n, V] into ids [n, k], lp [n, K], counts [n, k - K]; returns the
    tail mass R [n]."""
    import torch

    head_lp, head_ids = logp.topk(head_k, dim=-1)
    ids[:, :head_k], lp[:] = head_ids.numpy(), head_lp.numpy()
    tail = logp.exp().scatter(1, head_ids, 0.0)  # [n, V]
    mass = tail.double().sum(-1)
    has = mass > 0
    draws = torch.multinomial(torch.where(has[:, None], tail, 1.0), num_samples, replacement=True, generator=gen)
    for t in np.flatnonzero(has.numpy()):
        u, c = np.unique(draws[t].numpy(), return_counts=True)
        ids[t, head_k:head_k + len(u)], counts[t, :len(u)] = u, c
    return mass.float().numpy()
