"""On-policy objectives of stage 2 (docs/on-policy.md): the reverse-KL policy gradient on sampled text
(`--loss rkl-pg`), its truncated importance ratio, and its chunk-level form across tokenizers.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q -p no:cacheprovider tests/test_on_policy.py
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from stage2_student.config import TrainConfig
from stage2_student.objective import Capabilities, Objective, resolve_kind
from stage2_student.onpolicy import SAMPLED_KEY, reverse_kl_pg, staleness, truncated_ratio
from xtcache.errors import ConfigError, XtcacheError

V = 5


def _sample_batch(y: torch.Tensor, log_pt: torch.Tensor, log_pb: torch.Tensor | None = None) -> dict:
    """A same-tokenizer rollout micro-batch: position n predicts the sampled y[n], one chunk each."""
    n = y.shape[0]
    batch = {"student_chunk": torch.arange(n)[None], "labels": y[None].clone(), "num_chunks": n,
             "teacher_chunk": torch.arange(n), "teacher_ids": torch.zeros(n, 1, dtype=torch.int64),
             "teacher_logprobs": torch.zeros(n, 1), "teacher_residual": torch.zeros(n),
             "teacher_realized": log_pt[y]}
    if log_pb is not None:
        batch["sampled_logprobs"] = log_pb[y][None].float()
    return batch


def _estimated_grad(z, batch, is_cap):
    """d(loss)/dz through the product's objective (KD only, normalised by the sample count)."""
    n = batch["num_chunks"]
    z = z.clone().requires_grad_(True)
    obj = Objective("rkl-pg", ce_weight=0.0, is_cap=is_cap, measure_agreement=False, row_chunk=4096)
    loss, _ = obj(z.expand(1, n, V), obj.prepare(batch, vocab=V), chunks_total=float(n), tokens_total=float(n))
    loss.backward()
    return z.grad


def _reverse_kl_grad(z, log_pt):
    z = z.clone().requires_grad_(True)
    log_q = torch.log_softmax(z, -1)
    (log_q.exp() * (log_q - log_pt)).sum().backward()
    return z.grad


def _standard_error(z, y, log_pt, weights):
    """Standard error of the mean of the per-sample gradients w_n r_n (e_{y_n} - q), per component."""
    log_q = torch.log_softmax(z, -1)
    r = (log_q[y] - log_pt[y]) * weights  # [N]
    g = r[:, None] * (torch.nn.functional.one_hot(y, V).double() - log_q.exp())  # [N, V]
    return g.std(dim=0) / math.sqrt(y.shape[0])


@pytest.mark.parametrize("behaviour", ["student", "other policy, ratio", "other policy, no ratio"])
def test_reverse_kl_policy_gradient_matches_the_analytic_gradient_in_expectation(behaviour):
    """Many sampled tokens of a tiny vocabulary: the mean policy gradient equals grad KL(q || p_t) within 5
    standard errors of the mean, when the student sampled or when another policy did and the importance
    ratio corrects for it; without the ratio, samples of another policy give another gradient."""
    gen = torch.Generator().manual_seed(7)
    z = torch.randn(V, generator=gen, dtype=torch.float64)
    log_pt = torch.log_softmax(torch.randn(V, generator=gen, dtype=torch.float64) * 1.5, -1)
    log_q = torch.log_softmax(z, -1)
    log_b = log_q if behaviour == "student" else torch.log_softmax(z + torch.tensor([1.0, -1.0, 0.5, 0.0, -0.5],
                                                                                    dtype=torch.float64), -1)
    n = 40_000
    y = torch.multinomial(log_b.exp(), n, replacement=True, generator=gen)
    ratio = behaviour == "other policy, ratio"
    got = _estimated_grad(z, _sample_batch(y, log_pt, log_b if ratio else None), is_cap=1e6 if ratio else 0.0)
    want = _reverse_kl_grad(z, log_pt)
    weights = (log_q[y] - log_b[y]).exp() if ratio else torch.ones(n, dtype=torch.float64)
    tol = 5 * _standard_error(z, y, log_pt, weights) + 1e-6
    forward_kl_grad = log_q.exp() - log_pt.exp()  # what a forward-KL loss would give: must be told apart
    assert ((forward_kl_grad - want).abs() > 3 * tol).any()
    if behaviour == "other policy, no ratio":
        assert ((got - want).abs() > 3 * tol).any(), (got, want, tol)
    else:
        assert ((got - want).abs() <= tol).all(), (got, want, tol)


def _cross_rollout(gen, labels_vocab=V):
    """4 chunks: 1:1, 2:1 (two student tokens), 1:2 (two teacher rows), 1:1; and an invalid logit."""
    student_chunk = torch.tensor([[-1, 0, 1, 1, 2], [3, -1, -1, -1, -1]])
    labels = torch.randint(0, labels_vocab, (2, 5), generator=gen)
    return {"student_chunk": student_chunk, "labels": labels, "num_chunks": 4,
            "teacher_chunk": torch.tensor([0, 1, 2, 2, 3]), "teacher_ids": torch.zeros(5, 1, dtype=torch.int64),
            "teacher_logprobs": torch.zeros(5, 1), "teacher_residual": torch.zeros(5),
            "teacher_realized": -torch.rand(5, generator=gen, dtype=torch.float64) * 3,
            "sampled_logprobs": -torch.rand(2, 5, generator=gen) * 3}


def _terms(obj, logits, batch):
    z = logits.clone().requires_grad_(True)
    kd, _ = obj.terms(z, obj.prepare(batch, vocab=z.shape[-1]))
    kd.sum().backward()
    return kd.detach(), z.grad


def test_chunk_signal_sums_each_sides_log_probs_and_equals_the_per_token_signal_on_one_to_one_chunks():
    gen = torch.Generator().manual_seed(3)
    batch = _cross_rollout(gen)
    logits = torch.randn(2, 5, V, generator=gen, dtype=torch.float64)
    kd, grad = _terms(Objective("rkl-pg", measure_agreement=False), logits, batch)
    log_q = torch.log_softmax(logits, -1)
    lp = log_q.gather(-1, batch["labels"].clamp(min=0)[..., None])[..., 0]  # [2, 5] label log-probs
    real = batch["teacher_realized"]
    log_ps = torch.stack([lp[0, 1], lp[0, 2] + lp[0, 3], lp[0, 4], lp[1, 0]])
    log_pt = torch.stack([real[0], real[1], real[2] + real[3], real[4]])
    torch.testing.assert_close(kd, log_ps - log_pt)
    # gradient: r_c times grad log p_s of the chunk, i.e. r_c (onehot - q) at each of its student positions
    want = torch.zeros_like(logits)
    onehot = torch.nn.functional.one_hot(batch["labels"].clamp(min=0), V).double()
    for c, positions in enumerate([[(0, 1)], [(0, 2), (0, 3)], [(0, 4)], [(1, 0)]]):
        for b, i in positions:
            want[b, i] = (log_ps[c] - log_pt[c]) * (onehot[b, i] - log_q[b, i].exp())
    torch.testing.assert_close(grad, want)
    # a same-tokenizer batch (every chunk 1:1) gives per token r_t = log p_s(y_t) - log p_t(y_t)
    same = {**batch, "student_chunk": torch.tensor([[0, 1, 2, 3, 4], [-1] * 5]), "teacher_chunk": torch.arange(5),
            "num_chunks": 5}
    kd_same, _ = _terms(Objective("rkl-pg", measure_agreement=False), logits, same)
    torch.testing.assert_close(kd_same, lp[0] - real)


def test_the_ratio_is_one_and_changes_nothing_when_the_policy_has_not_moved():
    gen = torch.Generator().manual_seed(4)
    batch = _cross_rollout(gen)
    logits = torch.randn(2, 5, V, generator=gen, dtype=torch.float64)
    lp = torch.log_softmax(logits, -1).gather(-1, batch["labels"][..., None])[..., 0]
    unchanged = {**batch, "sampled_logprobs": lp.float().double()}  # the sampler was these very weights
    no_ratio = _terms(Objective("rkl-pg", measure_agreement=False, is_cap=0.0), logits, batch)
    with_ratio = _terms(Objective("rkl-pg", measure_agreement=False, is_cap=2.0), logits, unchanged)
    torch.testing.assert_close(with_ratio[0], no_ratio[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(with_ratio[1], no_ratio[1], rtol=1e-6, atol=1e-6)
    # the policy moved: each chunk is weighted by min(exp(log p_s - log p_b), C)
    for shift, cap in [(5.0, 2.0), (-1.0, 2.0), (0.3, 1.0)]:
        moved = {**batch, "sampled_logprobs": (lp - shift).float()}  # every token: ratio exp(shift)
        kd, _ = _terms(Objective("rkl-pg", measure_agreement=False, is_cap=cap), logits, moved)
        tokens = torch.tensor([1.0, 2.0, 1.0, 1.0], dtype=torch.float64)  # student tokens per chunk
        w = torch.clamp(torch.exp(shift * tokens), max=cap)
        torch.testing.assert_close(kd, w * no_ratio[0], rtol=1e-5, atol=1e-6)
        assert bool((w <= cap).all())


def test_truncated_ratio_is_bounded_and_has_no_gradient():
    log_ps = torch.tensor([0.0, -1.0, -50.0, -1e-3], requires_grad=True)
    log_pb = torch.tensor([-100.0, -1.0, -1.0, -1e-3])  # ratio e^100 (overflow without log space), 1, e^-49, 1
    w = truncated_ratio(log_ps, log_pb, 3.0)
    torch.testing.assert_close(w, torch.tensor([3.0, 1.0, math.exp(-49.0), 1.0]))
    assert not w.requires_grad
    value = reverse_kl_pg(log_ps, torch.zeros(4), log_pb, is_cap=3.0)
    value.sum().backward()
    torch.testing.assert_close(log_ps.grad, (w * log_ps.detach()))  # d/d log_ps of w r log_ps with w, r held


def test_missing_or_partial_sampling_log_probs_are_refused():
    gen = torch.Generator().manual_seed(5)
    batch = _cross_rollout(gen)
    obj = Objective("rkl-pg", measure_agreement=False, is_cap=2.0)
    no_logprobs = {k: v for k, v in batch.items() if k != "sampled_logprobs"}
    with pytest.raises(ConfigError, match="--is-cap 0"):
        obj.prepare(no_logprobs, vocab=V)
    hole = {**batch, "sampled_logprobs": batch["sampled_logprobs"].clone()}
    hole["sampled_logprobs"][0, 2] = float("nan")
    with pytest.raises(XtcacheError, match="1 trained position"):
        obj.prepare(hole, vocab=V)
    Objective("rkl-pg", measure_agreement=False, is_cap=0.0).prepare(no_logprobs, vocab=V)  # no ratio: fine
    obj.prepare(no_logprobs, vocab=V, ratio=False)  # held-out evaluation: the ratio left out, whatever the cap


@pytest.mark.parametrize("train_on", [None, "assistant"])
def test_a_trained_prompt_position_without_sampling_log_prob_is_refused_advising_the_sampled_turn_only(train_on):
    """--train-on other than last-assistant trains positions nobody sampled: refused, naming the flag."""
    batch = _cross_rollout(torch.Generator().manual_seed(5))
    batch["sampled_logprobs"][0, 2] = float("nan")
    if train_on is not None:
        batch["train_on"] = train_on
    with pytest.raises(XtcacheError, match="1 trained position") as refused:
        Objective("rkl-pg", measure_agreement=False, is_cap=2.0).prepare(batch, vocab=V)
    message = str(refused.value)
    assert "--train-on last-assistant" in message and "--is-cap 0" in message


def test_a_generated_turn_without_sampling_log_probs_trains_without_the_ratio_and_the_others_with_it(caplog):
    """--train-on last-assistant: a hole is a turn stored on re-tokenized ids (its sampled ids do not spell its
    text). Its chunk trains without the ratio (w = 1, the value and gradient of --is-cap 0), every other chunk
    with it (here the policy moved: ratio exp(0.5) a token, capped at 2), and a warning says so once."""
    import logging

    from stage2_student import onpolicy

    gen = torch.Generator().manual_seed(5)
    batch = _cross_rollout(gen)
    logits = torch.randn(2, 5, V, generator=gen, dtype=torch.float64)
    lp = torch.log_softmax(logits, -1).gather(-1, batch["labels"].clamp(min=0)[..., None])[..., 0]
    moved = {**batch, "sampled_logprobs": (lp - 0.5).float(), "train_on": "last-assistant"}
    moved["sampled_logprobs"][0, 2] = float("nan")  # one of chunk 1's two student tokens
    onpolicy._warned_unsampled = False
    with caplog.at_level(logging.WARNING, logger="stage2_student.onpolicy"):
        kd, grad = _terms(Objective("rkl-pg", measure_agreement=False, is_cap=2.0), logits, moved)
        _terms(Objective("rkl-pg", measure_agreement=False, is_cap=2.0), logits, moved)
    no_ratio, no_ratio_grad = _terms(Objective("rkl-pg", measure_agreement=False, is_cap=0.0), logits, batch)
    tokens = torch.tensor([1.0, 2.0, 1.0, 1.0], dtype=torch.float64)  # student tokens per chunk
    w = torch.clamp(torch.exp(0.5 * tokens), max=2.0)
    w[1] = 1.0  # the chunk with the hole
    torch.testing.assert_close(kd, w * no_ratio, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad[0, 2:4], no_ratio_grad[0, 2:4], rtol=1e-5, atol=1e-6)  # chunk 1's tokens
    assert not torch.allclose(grad[0, 1], no_ratio_grad[0, 1])  # chunk 0: weighted by its ratio
    assert caplog.text.count("train without the importance ratio (w = 1)") == 1


def test_rkl_pg_is_allowed_on_every_cache_never_picked_by_auto_and_trains_at_t1():
    for same in (True, False):
        for mode in ("topk", "full", "sampled"):
            caps = Capabilities(same_tokenizer=same, mode=mode)
            assert resolve_kind("rkl-pg", caps) == "rkl-pg"
            assert resolve_kind("auto", caps) != "rkl-pg"
    with pytest.raises(ConfigError, match="--temperature 2 with --loss rkl-pg"):
        Objective("rkl-pg", temperature=2.0)
    base = {"cache": ["c"], "student": "s", "out": "o", "loss": "rkl-pg"}
    assert TrainConfig.from_flat(base).loss.is_cap == 2.0
    for bad in (0.5, -1.0):
        with pytest.raises(ValueError, match="--is-cap"):
            TrainConfig.from_flat({**base, "is_cap": bad})
    assert np.isclose(TrainConfig.from_flat({**base, "is_cap": 0}).loss.is_cap, 0.0)


def test_mixture_flags_are_checked_against_each_other():
    base = {"cache": ["rollouts"], "student": "s", "out": "o"}
    cfg = TrainConfig.from_flat({**base, "corpus_cache": "corpus", "rollout_fraction": 0.25})
    assert (cfg.loader.corpus_cache, cfg.loader.rollout_fraction) == ("corpus", 0.25)
    for extra, match in [({"corpus_cache": "corpus"}, "strictly between 0 and 1"),
                         ({"corpus_cache": "corpus", "rollout_fraction": 0.0}, "strictly between 0 and 1"),
                         ({"rollout_fraction": 0.5}, "needs --corpus-cache"),
                         ({"corpus_cache": "corpus", "rollout_fraction": 0.5, "loss": "rkl-pg"}, "sampled"),
                         ({"corpus_cache": "corpus", "rollout_fraction": 0.5, "cache": ["a", "b"]}, "one --cache"),
                         ({"corpus_loss": "ce"}, "--corpus-loss ce needs --corpus-cache"),
                         ({"corpus_cache": "corpus", "rollout_fraction": 0.5, "corpus_loss": "sft"}, "choose kd, auto or ce")]:
        with pytest.raises(ValueError, match=match):
            TrainConfig.from_flat({**base, **extra})
    assert TrainConfig.from_flat({**base, "corpus_cache": "c", "rollout_fraction": 0.5}).loader.corpus_loss == "kd"


@pytest.mark.parametrize("kind", ["kl", "rkl", "jsd"])
def test_a_corpus_micro_batch_under_corpus_loss_ce_trains_cross_entropy_alone_at_weight_one(kind):
    """--corpus-loss ce: the mixed stream marks a corpus micro-batch for the corpus objective and drops its teacher
    keys, and that objective, whatever the run's loss and CE weight, gives the loss and gradient of CE at 1.0 over
    its labelled tokens (a second construction: torch's cross_entropy) and counts no chunk toward the step's KD
    normalisation."""
    from stage2_student.data import CORPUS_CE_WEIGHT, corpus_objective
    from stage2_student.mix import TeacherMix
    from stage2_student.rollout_mix import CORPUS_OBJECTIVE_KEY, corpus_batch

    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, V, (6,), generator=g)
    batch = _sample_batch(y, torch.log_softmax(torch.randn(V, generator=g), -1))
    batch["labels"][0, 2] = -100  # a position that trains nothing
    batch["input_ids"] = torch.zeros_like(batch["labels"])
    plain = corpus_batch(batch, "ce")
    assert plain[CORPUS_OBJECTIVE_KEY] and corpus_batch(batch, "kd") is batch
    assert not {"teacher_ids", "teacher_logprobs", "student_chunk", "teacher_chunk", "num_chunks"} & set(plain)
    assert torch.equal(plain["labels"], batch["labels"])
    cfg = TrainConfig.from_flat({"cache": ["rollouts"], "student": "s", "out": "o", "corpus_cache": "corpus",
                                 "rollout_fraction": 0.5, "corpus_loss": "ce", "loss": kind, "ce_weight": 0.1})
    caps = Capabilities(same_tokenizer=True, mode="topk")
    ce = corpus_objective(cfg, caps, None)
    assert ce.describe() == {"kind": None, "ce_weight": 1.0}
    run = TeacherMix([Objective.from_config(cfg.loss, caps)])
    assert ce.counts(plain) == (0, 5) and run.counts(batch) == (6, 5)
    z = torch.randn((1, 6, V), generator=g, requires_grad=True)
    loss, m = ce(z, ce.prepare(plain, vocab=V), chunks_total=6.0, tokens_total=8.0)
    loss.backward()
    want_z = z.detach().clone().requires_grad_(True)
    keep = batch["labels"][0] != -100
    want = CORPUS_CE_WEIGHT * torch.nn.functional.cross_entropy(want_z[0][keep], batch["labels"][0][keep],
                                                                 reduction="sum") / 8.0
    want.backward()
    assert CORPUS_CE_WEIGHT == 1.0 and float(m["kd_sum"]) == 0.0
    assert torch.allclose(loss, want.to(loss.dtype), atol=1e-6) and torch.allclose(z.grad, want_z.grad, atol=1e-6)
    kd_loss, _ = run(z, run.prepare(batch, vocab=V), chunks_total=6.0, tokens_total=8.0)
    assert not torch.allclose(kd_loss, loss)  # the same batch with its teacher, on the run's objective: KD + 0.1 CE


@pytest.mark.parametrize("corpus_loss", ["kd", "ce", "auto"])
def test_a_corpus_cache_of_another_kd_kind_is_refused_only_where_it_would_train_the_runs_objective(
        corpus_loss, manifest_only, tmp_path):
    """Rollouts of top-k targets (KL) beside a corpus cache of sampled ones: --corpus-loss kd would train the run's
    KL on draws, and is refused naming both kinds; ce reads no teacher value and auto trains the corpus cache's own
    defaults, so both take it."""
    import json

    from stage2_student.data import check_corpus
    from xtcache.store import CacheReader

    rollouts = CacheReader(str(manifest_only)).manifest
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "manifest.json").write_text(json.dumps({**json.loads((manifest_only / "manifest.json").read_text()),
                                                      "mode": "sampled"}))
    cfg = TrainConfig.from_flat({"cache": [str(manifest_only)], "student": "s", "out": "o", "corpus_cache": str(corpus),
                                 "rollout_fraction": 0.5, "corpus_loss": corpus_loss})
    fp = rollouts.fingerprints["teacher_tokenizer"]  # a student of the teacher's tokenizer
    if corpus_loss == "kd":
        with pytest.raises(ConfigError, match=r"--loss auto gives sampled on it \(mode sampled\) and kl on the rollouts"):
            check_corpus(cfg, rollouts, "kl", fp)
    else:
        assert check_corpus(cfg, rollouts, "kl", fp) == Capabilities(same_tokenizer=True, mode="sampled")


def test_staleness_counts_log_ratios_at_sampled_labels_only():
    """Against a second construction per label (numpy log-softmax): the sum of |log p_s - log p_b| over the
    labels with a sampling log-prob, the number with p_s / p_b above the cap, and their count."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn((2, 5, 7), generator=g)
    labels = torch.randint(0, 7, (2, 5), generator=g)
    labels[0, 4] = labels[1, 0] = -100
    log_pb = torch.full((2, 5), float("nan"))
    log_pb[0, :3] = torch.tensor([-1.0, -9.0, -0.2])  # the middle label: the student now far more likely (ratio > 2)
    log_pb[1, 0] = -1.0  # a sampling log-prob at an ignored label: not counted
    log_pb[1, 2:4] = torch.tensor([-3.0, -0.5])
    got = staleness(logits, {"labels": labels, SAMPLED_KEY: log_pb}, cap=2.0)
    z = logits.double().numpy()
    lp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    want_abs, want_over, n = 0.0, 0, 0
    for b, i in [(0, 0), (0, 1), (0, 2), (1, 2), (1, 3)]:
        d = lp[b, i, int(labels[b, i])] - float(log_pb[b, i])
        want_abs, want_over, n = want_abs + abs(d), want_over + int(d > math.log(2.0)), n + 1
    assert want_over >= 1 and got[2].item() == got[3].item() == n == 5
    assert got[1].item() == want_over
    assert got[0].item() == pytest.approx(want_abs, rel=1e-5)
    assert staleness(logits, {"labels": labels}, cap=2.0).tolist() == [0.0] * 4  # not a rollout batch


def test_staleness_reads_at_most_its_row_cap_evenly_spaced(monkeypatch):
    """Above STALENESS_ROWS sampled labels it reads rows i * total // cap only (one [cap, V] block), and
    still counts every labelled sampled position."""
    import stage2_student.onpolicy as onpolicy

    monkeypatch.setattr(onpolicy, "STALENESS_ROWS", 3)
    logits = torch.zeros((1, 8, 4))
    logits[0, :, 0] = torch.arange(8.0)  # row i: its label 0 more likely as i grows
    labels = torch.zeros((1, 8), dtype=torch.int64)
    log_pb = torch.zeros((1, 8))  # the sampler gave each label probability 1
    got = onpolicy.staleness(logits, {"labels": labels, SAMPLED_KEY: log_pb}, cap=2.0)
    rows = [0, 2, 5]  # i * 8 // 3
    want = sum(abs(float(torch.log_softmax(logits[0, i], -1)[0])) for i in rows)
    assert got[2].item() == 3 and got[3].item() == 8 and got[1].item() == 0  # log p_s - 0 <= 0: no ratio over 2
    assert got[0].item() == pytest.approx(want, rel=1e-6)


def test_corpus_loss_auto_builds_the_corpus_caches_defaults_whatever_the_runs_loss_flags():
    """`data.corpus_objective`: train-student's defaults for the corpus cache, not the run's loss flags (here the
    JSD at CE 0.3): with one tokenizer the KL + 0.1 CE; across tokenizers P-KL needs the run's projection map."""
    from stage2_student.data import corpus_objective

    cfg = TrainConfig.from_flat({"cache": ["rollouts"], "student": "s", "out": "o", "corpus_cache": "corpus",
                                 "rollout_fraction": 0.25, "corpus_loss": "auto", "loss": "jsd", "ce_weight": 0.3})
    same = corpus_objective(cfg, Capabilities(same_tokenizer=True, mode="topk"), None).describe()
    assert (same["kind"], same["ce_weight"]) == ("kl", 0.1)
    with pytest.raises(ConfigError, match="--corpus-loss auto: the corpus cache corpus trains the projected KL"):
        corpus_objective(cfg, Capabilities(same_tokenizer=False, mode="topk"), None)
