"""The premise: a full-vocabulary cache trains like the teacher in the loop, up to the codec's stated error.

Stage 1 (`run_teacher_dump`, transformers engine) writes a `--mode full` store of a few toy
documents; the product's loader reads a micro-batch of it. The same micro-batch is then given
the online teacher's arrays: a transformers forward of the teacher on the batch's windows, every
id of its tokenizer, unquantized, the lm_head's padding columns as the residual (what
bench/quality.py's online row trains on). The product's objective (`Objective("kl")`, its KD
term at T = 1) runs on both, one row at a time and over the whole batch. One
document, shorter than the windows (1024 tokens) on both sides, so both teachers read the same
context (the loader's packing splits longer documents across windows, and the teacher in the loop
then reads less context than the one that wrote the cache).

Each stored log-prob is within delta of the teacher's (the store's stated `max_abs_error` plus
the float32 decoding error) for log-probs above `min_logprob`; below it the value is clamped,
an absolute error under exp(min_logprob) in probability. With a = exp(stored), b = the teacher's
probabilities and r the exact residual (the mass of the teacher lm_head's padding columns),
eps = sum|a - b| <= (e^delta - 1) + V e^min_logprob. The student here has exactly the tokenizer's
V logits, so it has no mass outside the full support: the objective drops the teacher's rest on
both sides and renormalises the row over the V ids, cached by sum a, online by sum b = 1 - r, and
|sum a / sum b - 1| <= eps / (1 - r). So for every row, with p = b / (1 - r) the teacher's and
p~ = a / sum a the cached distribution and Delta = delta - log(1 - eps / (1 - r)):
  - gradient of the loss with respect to the row's logits (q - p vs q - p~): L1 distance
    = ||p~ - p||_1 <= e^Delta - 1 (p~ / p in [e^-Delta, e^Delta] wherever stored exactly);
  - loss: |KL(p~ || q) - KL(p || q)| <= Delta + (e^Delta - 1) sum_v p_v |log(p_v / q_v)|.
Both are checked per row, plus that the bounds are tight enough to catch a misaligned row.
"""

from __future__ import annotations

import math

import pytest


@pytest.fixture(scope="module")
def full_store(toy_setup, tmp_path_factory):
    from stage1_teacher.config import CaptureConfig, InputConfig, StoreConfig, TeacherConfig, TeacherDumpConfig
    from stage1_teacher.dump import run_teacher_dump

    root = tmp_path_factory.mktemp("equivalence")
    data = root / "docs.jsonl"
    data.write_text("".join(toy_setup.heldout_jsonl.read_text().splitlines(keepends=True)[:1]))
    cfg = TeacherDumpConfig(student_tokenizer=[str(toy_setup.student_tokenizer)], input=InputConfig(data=[str(data)]),
                            teacher=TeacherConfig(teacher=str(toy_setup.teacher_model), engine="hf", dtype="float32"),
                            capture=CaptureConfig(mode="full", max_seq_len=1024), store=StoreConfig(out=str(root / "full")))
    run_teacher_dump(cfg, progress=False)
    return str(root / "full")


def _rows(batch: dict):
    """Flat logit position of each teacher row of a same-tokenizer batch (chunk c has one logit)."""
    import torch

    sc = batch["student_chunk"].reshape(-1)
    pos = torch.nonzero(sc >= 0).squeeze(1)
    assert pos.numel() == int(batch["num_chunks"])
    at = torch.empty_like(pos)
    at[sc[pos]] = pos
    return at[batch["teacher_chunk"]]


def _online(batch: dict, teacher, vocab: int) -> dict:
    """The batch with the teacher's own full-vocabulary arrays (unquantized) in place of the cached ones."""
    import torch

    from stage2_student.student import model_inputs

    with torch.no_grad():
        logp = torch.log_softmax(teacher(**model_inputs(batch)).logits.double(), dim=-1)
    rows = _rows(batch)
    lp = logp.reshape(-1, logp.shape[-1])[rows]  # [R, V_head]; teacher row r is predicted at logit row rows[r]
    return {**batch, "teacher_ids": torch.arange(vocab).expand(len(rows), vocab), "teacher_logprobs": lp[:, :vocab],
            "teacher_residual": torch.logsumexp(lp[:, vocab:], dim=-1).exp()}


def _kd_sum(batch: dict, z):
    """The product objective's KD sum (forward KL at T = 1) of a batch's chunks; labels dropped (KD only)."""
    import torch

    from stage2_student.objective import Objective

    obj = Objective("kl", ce_weight=0.0)
    batch = {**batch, "labels": torch.full_like(batch["labels"], -100)}
    kd, _ = obj.sums(z, obj.prepare(batch, vocab=z.shape[-1]))
    return kd


def _one_row(batch: dict, i: int, at: int) -> dict:
    """The batch reduced to its teacher row i (chunk i alone, predicted at flat logit position `at`)."""
    import torch

    sc = torch.full_like(batch["student_chunk"], -1)
    sc.view(-1)[at] = 0
    one = {key: batch[key][i:i + 1] for key in ("teacher_ids", "teacher_logprobs", "teacher_residual")}
    return {**batch, **one, "student_chunk": sc, "num_chunks": 1, "teacher_chunk": torch.zeros(1, dtype=torch.long)}


def _loss_and_logit_grad(logits, batch):
    """Per-row loss terms and the gradient of the summed loss w.r.t. the logits, through the product's objective."""
    import torch

    rows = _rows(batch)
    z = logits.detach().reshape(-1, logits.shape[-1]).double().requires_grad_(True)
    with torch.no_grad():
        per_row = torch.stack([_kd_sum(_one_row(batch, i, int(rows[i])), z) for i in range(len(rows))])
    total = _kd_sum(batch, z)
    (grad,) = torch.autograd.grad(total, z)
    return per_row.detach(), total.detach(), grad[rows], rows, z.detach()


def test_full_cache_loss_and_gradient_equal_online_kd_within_stated_error(toy_setup, full_store, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from stage2_student.config import LoaderConfig
    from stage2_student.loader import CacheDataset, to_tensors
    from stage2_student.student import model_inputs
    from xtcache.store import CacheReader
    from xtcache.store.codecs import codec_from_config
    from xtcache.testing import toy
    from xtcache.tokenizer import load_tokenizer

    manifest = CacheReader(full_store).manifest
    assert manifest.mode == "full"
    codec = codec_from_config(manifest.codecs["topk_logprobs"])
    delta = codec.max_abs_error + abs(codec.min_logprob) * 2.0**-24  # stated bound + float32 decoding
    vocab = len(load_tokenizer(toy_setup.teacher_tokenizer))
    eps = math.expm1(delta) + vocab * math.exp(codec.min_logprob)

    student_dir = tmp_path / "student"  # a student on the teacher's tokenizer: same-tokenizer KD
    toy.build_tiny_model("llama", toy_setup.teacher_tokenizer, student_dir, hidden=64, layers=2, seed=3)
    student = AutoModelForCausalLM.from_pretrained(str(student_dir), dtype=torch.float32)
    teacher = AutoModelForCausalLM.from_pretrained(str(toy_setup.teacher_model), dtype=torch.float32).eval()
    ds = CacheDataset(full_store, str(toy_setup.teacher_tokenizer), LoaderConfig(seq_len=1024, micro_batch_size=1), split="all",
                      epochs=1, shuffle=False)
    cached = to_tensors(next(iter(ds)))
    assert cached["teacher_ids"].shape[1] == vocab  # every id of the tokenizer is stored
    online = _online(cached, teacher, vocab)
    logits = student(**model_inputs(cached)).logits

    l_c, total_c, g_c, rows, z = _loss_and_logit_grad(logits, cached)
    l_o, total_o, g_o, _, _ = _loss_and_logit_grad(logits, online)
    assert len(rows) > 100

    # the teacher's distribution p (over the V ids, renormalised) and the student's q of every row
    r = online["teacher_residual"]
    big_delta = delta - torch.log1p(-eps / (1 - r))  # [R]
    p = (online["teacher_logprobs"] - torch.log1p(-r)[:, None]).exp()
    log_q = torch.log_softmax(z[rows], dim=-1)
    spread = (p * (p.clamp_min(1e-300).log() - log_q).abs()).sum(-1)  # sum_v p |log(p / q)|
    loss_bound = big_delta + torch.expm1(big_delta) * spread + 1e-9
    assert ((l_c - l_o).abs() <= loss_bound).all(), float(((l_c - l_o).abs() - loss_bound).max())
    grad_l1 = (g_c - g_o).abs().sum(-1)  # per row: ||p~ - p||_1
    assert (grad_l1 <= torch.expm1(big_delta) + 1e-9).all(), float((grad_l1 - torch.expm1(big_delta)).max())
    # the batch loss too (sum of the rows), and the gradient over the student's parameters points the same way
    assert abs(float(total_c - total_o)) <= float(loss_bound.sum())

    # the bound has teeth: the cache read one row off (a misaligned loader) breaks it
    shifted = {**cached, "teacher_logprobs": torch.roll(cached["teacher_logprobs"], 1, dims=0),
               "teacher_residual": torch.roll(cached["teacher_residual"], 1, dims=0)}
    _, _, g_s, _, _ = _loss_and_logit_grad(logits, shifted)
    assert (g_s - g_o).abs().sum(-1).median() > 5 * torch.expm1(big_delta).max()
