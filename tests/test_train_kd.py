"""Stage 2 on a real teacher cache: distillation beats CE-only on held-out KL to the teacher.

The caches are real: stage 1 (`xtcache teacher-dump --engine hf`) runs the toy teacher (a trained
tiny Qwen2) over the toy corpus and aligns the toy student's tokenizer; a held-out store of other
documents is the --eval-cache. `build_hf_cache` writes a cache directly through
`xtcache.store.CacheWriter` (top-k or sampled targets, any alignment groups) for
bench/train_step.py. Every training run is a `python -m stage2_student` subprocess.

    pytest -q tests/test_train_kd.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]


def build_hf_cache(url: str | Path, teacher_dir: str | Path, jsonl: str | Path, students: list[str | Path], *,
                   k: int = 16, max_docs: int = 40, docs_per_part: int = 16, mode: str = "topk",
                   num_samples: int = 32, seed: int = 0) -> str:
    """A real teacher cache: HF forward of the teacher, top-k (or sampled) log-probs, alignments.

    `students` are tokenizer directories; each gets an alignment group (identity for the teacher's own).
    """
    import torch
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from schemas.models import AlignGroupMeta, Manifest
    from xtcache.align import align_text, encode_with_offsets, identity_alignment
    from xtcache.fingerprint import model_fingerprint, settings_fingerprint, tokenizer_fingerprint, cache_key
    from xtcache.store import AlignmentRecord, CacheWriter, DocRecord

    teacher_tok = PreTrainedTokenizerFast.from_pretrained(str(teacher_dir))  # as stage 1: tokenizer.json as is
    model = AutoModelForCausalLM.from_pretrained(str(teacher_dir), dtype=torch.float32).eval()
    vocab = len(teacher_tok)
    t_fp = tokenizer_fingerprint(teacher_tok)
    student_toks = [PreTrainedTokenizerFast.from_pretrained(str(s)) for s in students]
    s_fps = [tokenizer_fingerprint(t) for t in student_toks]
    texts = [json.loads(line)["text"] for line in Path(jsonl).read_text().splitlines()][:max_docs]
    settings = {"mode": mode, "k": k, "num_samples": num_samples if mode == "sampled" else None, "engine": "test-hf"}
    fps = {"teacher_model": model_fingerprint(teacher_dir), "teacher_tokenizer": t_fp,
           "corpus": settings_fingerprint({"file": str(jsonl), "n": len(texts)}),
           "settings": settings_fingerprint(settings)}
    manifest = Manifest(cache_key=cache_key(**fps), mode=mode, k=k, teacher_vocab_size=vocab,
                        num_samples=num_samples if mode == "sampled" else None, teacher_name=str(teacher_dir),
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
            if mode == "sampled":
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


def teacher_dump(out: Path, toy_setup, jsonl: Path, n_docs: int) -> str:
    """Stage 1 itself (`xtcache teacher-dump --engine hf`) on the first `n_docs` documents of `jsonl`."""
    data = out.with_suffix(".jsonl")
    data.write_text("".join(Path(jsonl).read_text().splitlines(keepends=True)[:n_docs]))
    cmd = [sys.executable, "-m", "xtcache.cli", "teacher-dump", "--teacher", str(toy_setup.teacher_model),
           "--student-tokenizer", str(toy_setup.student_tokenizer), "--data", str(data), "--out", str(out),
           "--mode", "topk", "--top-k", "16", "--engine", "hf", "--docs-per-part", "16"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return str(out)


@pytest.fixture(scope="session")
def kd_caches(toy_setup, tmp_path_factory):
    """(train store, held-out store) of the toy teacher, aligned for the toy student's tokenizer."""
    root = tmp_path_factory.mktemp("kd_cache")
    return (teacher_dump(root / "train", toy_setup, toy_setup.train_jsonl, 48),
            teacher_dump(root / "held", toy_setup, toy_setup.heldout_jsonl, 12))


def run_stage2(out: Path, *flags: str, nproc: int = 1) -> dict:
    """`python -m stage2_student FLAGS` (under torchrun when nproc > 1); returns summary and metrics."""
    cmd = [sys.executable, "-m", "stage2_student", "--out", str(out), *flags]
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               "-m", "stage2_student", "--out", str(out), *flags]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"summary": json.loads((out / "summary.json").read_text()),
            "train": [r for r in rows if r["kind"] == "train"], "eval": [r for r in rows if r["kind"] == "eval"]}


def common_flags(toy_setup, train: str, held: str, steps: int) -> list[str]:
    return ["--cache", train, "--eval-cache", held, "--student", str(toy_setup.student_model),
            "--seq-len", "64", "--micro-batch-size", "4", "--max-steps", str(steps), "--lr", "3e-3",
            "--warmup-steps", "2", "--eval-every", str(steps // 2), "--zero-stage", "2"]


@pytest.mark.slow
def test_projected_kl_beats_ce_only_on_heldout_kl(tmp_path, toy_setup, kd_caches):
    train, held = kd_caches
    steps = 30
    kd = run_stage2(tmp_path / "kd", *common_flags(toy_setup, train, held, steps), "--loss", "pkl",
                    "--kd-weight", "1.0", "--ce-weight", "0.1")
    ce = run_stage2(tmp_path / "ce", *common_flags(toy_setup, train, held, steps), "--loss", "ce",
                    "--ce-weight", "1.0")
    start = kd["summary"]["first_eval"]
    assert start is not None
    first_kl = kd["eval"][0]["kl"]
    final_kd, final_ce = kd["summary"]["final_eval_kl"], ce["summary"]["final_eval_kl"]
    assert final_kd < 0.6 * first_kl, (first_kl, final_kd)
    assert final_kd < final_ce, (final_kd, final_ce)
    assert kd["summary"]["kd_loss"] == "pkl" and ce["summary"]["kd_loss"] is None
    # the evaluation's KL is the same measure whatever the training loss, and says what it is
    assert kd["summary"]["eval_kl_definition"] == ce["summary"]["eval_kl_definition"]
    assert "lower bound" in kd["summary"]["eval_kl_definition"]
    assert kd["eval"][-1]["objective_kd_name"] == "pkl" and ce["eval"][-1]["objective_kd"] is None
    assert all(r["valid_share"] > 0.5 for r in kd["train"])
    assert kd["train"][-1]["top1_agree"] > kd["train"][0]["top1_agree"]
