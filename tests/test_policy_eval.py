"""`xtcache policy-eval` (stage1_teacher/onpolicy/policy_eval.py): the on-policy measure.

Checked against a second construction: the student's own forward on prompt ids + sampled ids (no
rendering, no spans). Same model on both sides (the teacher reads the sampled ids): every sample gives
r = 0, those sampled as other ids than re-tokenizing their text gives too; a teacher whose logits are
exactly twice the student's (its final norm scaled by 2) gives r = sum over the sampled ids of
log_softmax(z) - log_softmax(2 z), which the test computes from the student's logits. Cross-tokenizer: the teacher tokens summed spell exactly the completion text
(and the teacher's end-of-turn marker when the student stopped), with at most the template's newline
before it when a token straddles it.

Cost (2 cores): a chat setup with a briefly trained teacher (so that samples stop), a few seconds of sampling.
"""

from __future__ import annotations

import json
import math
import shutil

import pytest

from tests.commands import xtcache
from xtcache.errors import ConfigError

SAMPLES, NEW_TOKENS = 3, 20


@pytest.fixture(scope="module")
def chat(toy_setup, tmp_path_factory):
    """(chat setup, prompts .jsonl): held-out conversations cut after their last user message."""
    from xtcache.testing.chat import build_chat_setup, write_prompts

    root = tmp_path_factory.mktemp("policy_eval")
    setup = build_chat_setup(toy_setup, root / "chat", num_train=40, num_heldout=6, teacher_steps=60)
    write_prompts(setup.heldout_jsonl, root / "prompts.jsonl")
    return setup, root / "prompts.jsonl", root


def _run(student, teacher, prompts, **kw):
    from stage1_teacher.onpolicy.policy_eval import policy_eval

    return policy_eval(str(student), str(teacher), str(prompts), samples_per_prompt=SAMPLES,
                       max_new_tokens=NEW_TOKENS, seed=kw.pop("seed", 0), teacher_samples=kw.pop("teacher_samples", False),
                       **kw)


def _other_tokens(tok, scores, texts) -> int:
    """How many samples were sampled as other ids than the tokenizer gives their text (the stop token aside):
    those a teacher reading its own tokenization of the text would score on other tokens."""
    stop = set(tok.all_special_ids)
    return sum(list(s.student_ids[:len(s.student_ids) - (s.student_ids[-1] in stop)]) !=
               tok(t, add_special_tokens=False)["input_ids"] for s, t in zip(scores, texts) if s.student_ids)


def _texts(model_dir, prompts_path) -> list[str]:
    """The completion texts of `_run`'s samples of `model_dir`, drawn again."""
    from stage1_teacher.onpolicy.policy_eval import read_prompts, sample_student
    from xtcache.tokenizer import load_tokenizer

    tok = load_tokenizer(model_dir)
    _, texts = sample_student(str(model_dir), tok, read_prompts(str(prompts_path), tok), samples_per_prompt=SAMPLES,
                              max_new_tokens=NEW_TOKENS, seed=0)
    return [t for ts in texts for t in ts]


def _expected_r(model_dir, prompts_path, scores, scale: float) -> list[float]:
    """sum over the sampled ids of log_softmax(z) - log_softmax(scale z), z the model's logits on
    prompt ids + sampled ids (the second construction)."""
    import torch
    from transformers import AutoModelForCausalLM

    from stage1_teacher.onpolicy.policy_eval import read_prompts
    from xtcache.tokenizer import load_tokenizer

    prompts = {p.prompt_id: p for p in read_prompts(str(prompts_path), load_tokenizer(model_dir))}
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    out = []
    for s in scores:
        ids = prompts[s.prompt_id].token_ids
        with torch.inference_mode():
            z = model(input_ids=torch.tensor([ids + list(s.student_ids)])).logits[0].double()  # [L, V]
        z = z[len(ids) - 1:-1]  # [n, V]: the logits that predicted the sampled ids
        y = torch.tensor(s.student_ids)[:, None]
        r = torch.log_softmax(z, -1).gather(1, y).sum() - torch.log_softmax(scale * z, -1).gather(1, y).sum()
        out.append(float(r))
    return out


def test_same_model_gives_zero_on_every_sample_also_those_sampled_as_other_tokens(chat):
    from xtcache.tokenizer import load_tokenizer

    setup, prompts, _ = chat
    report, scores = _run(setup.teacher_model, setup.teacher_model, prompts)
    assert report["teacher_reads"] == "sampled ids" and report["unscored"] == 0
    assert any(s.stopped for s in scores) and any(not s.stopped for s in scores)  # the marker path and the length path
    for s in scores:
        assert s.teacher_ids == s.student_ids
        assert s.student_logprob - s.teacher_logprob == pytest.approx(0.0, abs=1e-3)
        assert s.teacher_logprob < -1.0  # a real sum, not an empty one
    # samples whose text the teacher's tokenizer splits otherwise: scored on their own tokens, so 0 there too
    assert _other_tokens(load_tokenizer(setup.teacher_model), scores, _texts(setup.teacher_model, prompts)) >= 1
    assert report["samples"] == 6 * SAMPLES and report["prompts"] == 6


def test_teacher_with_doubled_logits_gives_the_independent_value(chat, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    setup, prompts, _ = chat
    sharp = tmp_path / "sharp"
    shutil.copytree(setup.teacher_model, sharp)
    model = AutoModelForCausalLM.from_pretrained(str(sharp), dtype=torch.float32)
    with torch.no_grad():
        model.model.norm.weight.mul_(2.0)  # logits = lm_head(norm(h)) are exactly doubled
    model.save_pretrained(str(sharp))
    report, scores = _run(setup.teacher_model, sharp, prompts)
    assert report["teacher_reads"] == "sampled ids" and report["scored"] == len(scores) == 6 * SAMPLES
    want = _expected_r(setup.teacher_model, prompts, scores, 2.0)
    got = [s.student_logprob - s.teacher_logprob for s in scores]
    assert got == pytest.approx(want, abs=1e-3)
    assert sum(abs(w) > 0.1 for w in want) >= len(want) - 2  # values away from 0 (one sample's can be of either sign)
    assert report["reverse_kl_per_token"] > 0.01


def test_cross_tokenizer_teacher_sums_exactly_the_completion_text(chat):
    from xtcache.tokenizer import load_tokenizer

    setup, prompts, _ = chat
    report, scores = _run(setup.student_model, setup.teacher_model, prompts)
    t_tok = load_tokenizer(setup.teacher_model)
    flat = _texts(setup.student_model, prompts)
    assert report["unscored"] == sum(not t for t in flat)  # only empty completions are left out
    for s, text in zip(scores, flat):
        if s.scored:
            spelled = t_tok.decode(list(s.teacher_ids))
            turn = text + ("<|im_end|>" if s.stopped else "")
            # a token may straddle the template's newline before the text (BPE merges whitespace runs)
            assert spelled.endswith(turn) and spelled[:len(spelled) - len(turn)] in ("", "\n")
    assert math.isfinite(report["reverse_kl_per_token"]) and report["reverse_kl_per_token"] > 0
    assert report["teacher_nll_per_token"] > 0 and report["teacher_nll_per_byte"] > 0


def test_summary_is_the_ratio_of_sums():
    from stage1_teacher.onpolicy.policy_eval import SampleScore, summarize

    scores = [SampleScore("a", 0, (1, 2), -3.0, -5.0, (1, 2), 4, True),
              SampleScore("a", 1, (1, 2, 3, 4), -6.0, -7.0, (1,), 6, False),
              SampleScore("b", 0, (1,), -1.0, float("nan"), (), 0, True)]
    r = summarize(scores)
    assert r["reverse_kl_per_token"] == pytest.approx((2.0 + 1.0) / 6)
    assert r["teacher_nll_per_token"] == pytest.approx(12.0 / 6)
    assert r["teacher_nll_per_byte"] == pytest.approx(12.0 / 10)
    assert (r["samples"], r["scored"], r["unscored"]) == (3, 2, 1)
    assert r["stopped_fraction"] == pytest.approx(2 / 3)
    # delta-method standard error of sum(r) / sum(n): residuals r_i - R n_i = 2 - 1, 1 - 2
    assert r["reverse_kl_per_token_se"] == pytest.approx(math.sqrt(2.0 / 2) / 3)
    # and of the teacher's NLL per byte, 12 / 10 = 1.2: residuals 5 - 1.2 * 4, 7 - 1.2 * 6; mean bytes 5
    assert r["teacher_nll_per_byte_se"] == pytest.approx(math.sqrt((0.2 ** 2 + 0.2 ** 2) / 1 / 2) / 5)
    assert r["teacher_nll_per_token_se"] == pytest.approx(math.sqrt((1.0 ** 2 + 1.0 ** 2) / 1 / 2) / 3)


def test_bad_prompts_are_refused_in_one_line(chat, tmp_path):
    from stage1_teacher.onpolicy.policy_eval import read_prompts
    from xtcache.tokenizer import load_tokenizer

    setup, _, _ = chat
    tok = load_tokenizer(setup.student_model)
    with pytest.raises(ConfigError, match=r"^--prompts .*missing\.jsonl: no such file"):
        read_prompts(str(tmp_path / "missing.jsonl"), tok)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})
                   + "\n")
    with pytest.raises(ConfigError, match=r"^--prompts .*bad\.jsonl row 0: the last message is the 'assistant'"):
        read_prompts(str(bad), tok)


def test_cli_writes_the_report_and_refuses_a_missing_file(chat, tmp_path):
    """`xtcache policy-eval` through the command's entry point, in this process (`tests.commands.xtcache`):
    its exit status (0, and 2 for a missing file), the report it prints and writes, its one-line error."""
    setup, prompts, _ = chat
    out = tmp_path / "report.json"
    base = ["policy-eval", "--student", str(setup.teacher_model), "--teacher", str(setup.teacher_model),
            "--samples-per-prompt", "1", "--max-new-tokens", "4"]
    proc = xtcache(*base, "--prompts", str(prompts), "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["samples"] == 6 and "reverse_kl_per_token" in proc.stdout
    # the teacher sampled as the student is: the same model and seeds draw the same completions
    assert report["teacher_mean_bytes"] == report["student_mean_bytes"] > 0
    assert report["teacher_stopped_fraction"] == report["stopped_fraction"] and "teacher_mean_bytes" in proc.stdout
    # its NLL per byte of its own samples (from its sampler's log-probs) is the student's own NLL per byte of the
    # same samples: the teacher's NLL of them less their reverse KL (from the scorer and the student's sampler)
    assert report["unscored"] == 0
    own = report["teacher_nll_per_byte"] - report["reverse_kl_per_sequence"] / report["student_mean_bytes"]
    assert report["teacher_self_nll_per_byte"] == pytest.approx(own, rel=1e-4)
    assert "teacher_self_nll_per_byte" in proc.stdout
    proc = xtcache(*base, "--prompts", str(tmp_path / "none.jsonl"))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("error: --prompts ")


@pytest.fixture(scope="module")
def prefixes(toy_setup, tmp_path_factory):
    """Text prefixes: six held-out documents of the plain-text toy corpus cut after a line (within their first
    200 characters), so that most completions start a token of their own."""
    from pathlib import Path

    path = tmp_path_factory.mktemp("prefixes") / "prefixes.jsonl"
    rows = [json.loads(line)["text"] for line in Path(toy_setup.heldout_jsonl).read_text().splitlines()[:6]]
    path.write_text("".join(json.dumps({"text": r[:r.rfind("\n", 0, 200) + 1] or r[:120]}) + "\n" for r in rows))
    return path


def test_text_prefixes_same_model_gives_zero_and_the_per_sequence_mean(toy_setup, prefixes):
    from xtcache.tokenizer import load_tokenizer

    report, scores = _run(toy_setup.teacher_model, toy_setup.teacher_model, prefixes)
    assert report["teacher_reads"] == "sampled ids"
    same = [s for s in scores if s.scored]
    assert len(same) == sum(bool(s.student_ids) for s in scores) >= 4
    assert _other_tokens(load_tokenizer(toy_setup.teacher_model), scores, _texts(toy_setup.teacher_model, prefixes)) >= 1
    for s in same:
        assert s.student_logprob - s.teacher_logprob == pytest.approx(0.0, abs=1e-3)
        assert s.teacher_logprob < -1.0
    scored = [s for s in scores if s.scored]
    r = [s.student_logprob - s.teacher_logprob for s in scored]
    assert report["reverse_kl_per_sequence"] == pytest.approx(sum(r) / len(r))
    assert report["samples"] == 6 * SAMPLES and report["prompts"] == 6


def test_text_prefixes_cross_tokenizer_teacher_sums_exactly_the_completion(toy_setup, prefixes):
    from stage1_teacher.onpolicy.policy_eval import read_prompts, sample_student
    from xtcache.tokenizer import load_tokenizer

    report, scores = _run(toy_setup.student_model, toy_setup.teacher_model, prefixes)
    s_tok, t_tok = load_tokenizer(toy_setup.student_model), load_tokenizer(toy_setup.teacher_model)
    prompts = read_prompts(str(prefixes), s_tok)
    _, texts = sample_student(str(toy_setup.student_model), s_tok, prompts, samples_per_prompt=SAMPLES,
                              max_new_tokens=NEW_TOKENS, seed=0)
    flat = [(p.text, t) for p, ts in zip(prompts, texts) for t in ts]
    assert report["scored"] >= len(flat) - sum(not t for _, t in flat) and report["scored"] > 0
    eos = t_tok.eos_token_id
    for s, (prefix, text) in zip(scores, flat):
        if s.scored:
            ids = [i for i in s.teacher_ids if not (s.stopped and i == eos)]
            spelled = t_tok.decode(ids)
            # the completion's characters, with at most the end of the prefix where a token straddles the boundary
            assert spelled.endswith(text) and prefix.endswith(spelled[:len(spelled) - len(text)])
    assert math.isfinite(report["reverse_kl_per_sequence"]) and report["teacher_nll_per_byte"] > 0


def test_prompts_of_both_kinds_are_refused(chat, prefixes, tmp_path):
    setup, prompts, _ = chat
    both = tmp_path / "both.jsonl"
    both.write_text(prompts.read_text() + prefixes.read_text())
    with pytest.raises(ConfigError, match=r"^--prompts \S*both\.jsonl row 6: missing messages field"):
        _run(setup.student_model, setup.teacher_model, both)


def test_defaults_draw_96_samples_and_cap_at_twice_the_teacher_mean_length(chat):
    """--samples-per-prompt 0: ceil(96 / prompts) per prompt; --max-new-tokens 0: twice the mean length, in the
    student's tokens, of the teacher's own samples (drawn first, cap 512), so the cap rarely cuts a student."""
    import math

    from stage1_teacher.onpolicy.policy_eval import policy_eval

    setup, prompts, _ = chat
    report, _ = policy_eval(str(setup.student_model), str(setup.teacher_model), str(prompts), samples_per_prompt=0,
                            max_new_tokens=4, teacher_samples=False)
    assert (report["prompts"], report["samples_per_prompt"], report["samples"]) == (6, 16, 96)
    report, _ = policy_eval(str(setup.student_model), str(setup.teacher_model), str(prompts), samples_per_prompt=1,
                            max_new_tokens=0)
    mean = report["teacher_mean_student_tokens"]
    assert report["max_new_tokens_auto"] and report["teacher_max_new_tokens"] == 512 and mean > 1
    assert report["max_new_tokens"] == max(8, math.ceil(2 * mean))
    assert report["mean_student_tokens"] <= report["max_new_tokens"]
    # the teacher's NLL per byte of its own samples: those samples drawn again here, summed here
    from stage1_teacher.onpolicy.policy_eval import read_prompts, sample_student
    from xtcache.tokenizer import load_tokenizer

    tok = load_tokenizer(str(setup.teacher_model))
    comps, texts = sample_student(str(setup.teacher_model), tok, read_prompts(str(prompts), tok), samples_per_prompt=1,
                                  max_new_tokens=512, seed=0)
    nll = -sum(sum(c.logprobs) for cs in comps for c in cs)
    assert report["teacher_self_nll_per_byte"] == pytest.approx(nll / sum(len(t.encode()) for ts in texts for t in ts))
    student_own = report["teacher_nll_per_byte"] - report["reverse_kl_per_sequence"] / report["student_mean_bytes"]
    assert abs(report["teacher_self_nll_per_byte"] - student_own) > 0.05  # not the student's samples
    with pytest.raises(ConfigError, match="auto"):
        policy_eval(str(setup.student_model), str(setup.teacher_model), str(prompts), max_new_tokens=0,
                    teacher_samples=False)


def test_a_sampled_id_past_the_teachers_tokenizer_is_left_unscored(chat):
    """A student whose output layer is padded past its tokenizer can sample an id that names no token: the
    teacher does not read it (unscored), where it would index past its embedding."""
    from stage1_teacher.onpolicy.policy_eval import TeacherScorer

    setup, _, _ = chat
    scorer = TeacherScorer(str(setup.teacher_model))
    past = len(scorer.tokenizer)
    got = scorer.score_sampled([[1, 2], [1, 2], [], [1, 2]], [[3, 4], [3, past], [3], []])
    assert got[1] is None and got[2] is None and got[3] is None
    assert got[0][1] == (3, 4) and got[0][0] == pytest.approx(float(scorer.token_logprobs([1, 2, 3, 4])[1:].sum()))


def test_the_teachers_own_samples_are_drawn_once_per_process_for_the_same_prompts_and_settings(chat, tmp_path,
                                                                                              monkeypatch):
    """A bench grades many students on the same prompts: the teacher's own samples (the same whichever student is
    graded) are drawn once, and again when the prompts or the settings change."""
    from stage1_teacher.onpolicy import policy_eval as pe
    from xtcache.tokenizer import load_tokenizer

    setup, prompts, _ = chat
    mine = tmp_path / "prompts.jsonl"
    mine.write_text(prompts.read_text())
    drawn = []
    real = pe.sample_student
    monkeypatch.setattr(pe, "sample_student", lambda *a, **k: (drawn.append(k["samples_per_prompt"]), real(*a, **k))[1])
    tok = load_tokenizer(str(setup.student_model))

    def lengths(**kw):
        return pe.teacher_lengths(str(setup.teacher_model), str(mine), tok, **{"samples_per_prompt": 1,
                                                                               "max_new_tokens": 6, "seed": 0, **kw})

    first = lengths()
    assert lengths() == first and drawn == [1]  # the second call draws nothing, and gives the same measures
    lengths(samples_per_prompt=2)
    assert drawn == [1, 2]
    mine.write_text("".join(mine.read_text().splitlines(keepends=True)[:2]))  # other prompts: drawn again
    lengths()
    assert drawn == [1, 2, 1]
