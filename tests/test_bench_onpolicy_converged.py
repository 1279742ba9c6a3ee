"""bench/quality_onpolicy_converged.py's pure parts: the text rows it cuts from documents, and its verdicts (the
rule docs/on-policy.md's converged section states): a row beats continued off-policy KD on a measure only when it
is lower on every seed and the mean paired difference exceeds its standard deviation; the held-out KL is named
within, lower or higher beyond the two rows' spread."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, replace
from pathlib import Path

import pytest

import bench.quality_onpolicy_converged as conv
from bench.quality_onpolicy_converged import (
    ROWS,
    ConvergedSettings,
    filled,
    rounds_plan,
    split_row_flags,
    text_rows,
    verdicts,
    wide_prompt_rows,
)
from xtcache.app.docblock import run_record
from xtcache.app.rounds import CORPUS_MIX
from xtcache.testing.suite import REPO

OFF, ON = ROWS[0][0], ROWS[1][0]


def test_text_rows_cut_prefix_and_completion_at_line_ends_and_mark_the_prompt():
    doc = "".join(f"line {i:03d} " + "x" * 30 + "\n" for i in range(40))  # 40 lines of 40 characters
    rows = text_rows([doc], prefix=100, completion=80)
    assert len(rows) == 3  # at characters 0, 400 and 800
    for r, start in zip(rows, (0, 400, 800)):
        prefix, completion = r["text"][:r["prefix_chars"]], r["text"][r["prefix_chars"]:]
        assert doc[start:].startswith(r["text"]) and prefix.endswith("\n") and completion.endswith("\n")
        assert len(prefix) >= 100 and len(completion) >= 80  # whole lines past each bound
    assert text_rows(["short\n"], prefix=100, completion=80) == []  # too short for either part: skipped


def _runs(rev, nll, kl, tok=0.5, length=40.0):
    return [{"seed": s, "reverse_kl_per_sequence": rev[s], "teacher_nll_per_byte": nll[s], "heldout_kl": kl[s],
             "reverse_kl_per_token": tok, "mean_student_tokens": length} for s in range(3)]


def test_a_row_beats_on_a_measure_only_when_lower_on_every_seed_beyond_the_paired_spread():
    rows = {"converged student": [], OFF: _runs([20, 22, 24], [1.10, 1.12, 1.14], [2.08, 2.09, 2.10]),
            ON: _runs([15, 16, 18], [1.11, 1.10, 1.15], [2.09, 2.10, 2.11])}
    (line,) = verdicts(rows)
    assert "reverse KL/sequence -5.667" in line and "lower on 3/3 seeds" in line
    assert "teacher NLL/byte" in line and "lower on 1/3 seeds" in line  # mixed: not beaten
    assert "**beats it on reverse KL/sequence, held-out KL within the spread**" in line
    rows[ON] = _runs([19, 23, 23], [1.00, 1.02, 1.04], [1.90, 1.91, 1.92])  # one seed higher on reverse KL
    (line,) = verdicts(rows)
    assert "**beats it on teacher NLL/byte, held-out KL lower beyond the spread**" in line
    rows[ON] = _runs([30, 31, 32], [1.2, 1.2, 1.2], [2.30, 2.31, 2.32])
    (line,) = verdicts(rows)
    assert "**beats it on neither, held-out KL higher beyond the spread**" in line


def test_a_row_with_a_continued_row_of_its_own_objective_is_compared_with_both_and_that_row_with_neither():
    """Continued KD on the rounds' objective is an off-policy row: no verdict of its own; the rounds' default row
    gets one against train-student's defaults and one against it, each paired by seed."""
    same_name, rounds_name = conv.SAME_OBJECTIVE[ROWS[2][0]], ROWS[2][0]
    rows = {"converged student": [], OFF: _runs([20, 22, 24], [1.10, 1.12, 1.14], [2.08, 2.09, 2.10]),
            rounds_name: _runs([15, 16, 18], [1.11, 1.13, 1.15], [2.08, 2.09, 2.10]),
            same_name: _runs([25, 27, 29], [1.20, 1.22, 1.24], [2.08, 2.09, 2.10])}
    first, second = verdicts(rows)
    assert first.startswith(f"- {rounds_name} vs {OFF}") and "**beats it on reverse KL/sequence," in first
    assert second.startswith(f"- {rounds_name} vs {same_name}") and "teacher NLL/byte -0.090" in second
    assert "**beats it on reverse KL/sequence and teacher NLL/byte, held-out KL within the spread**" in second
    del rows[same_name]
    assert len(verdicts(rows)) == 1


def test_end_probabilities_read_each_answer_after_its_prompt_one_row_per_answer_token_after_the_first(
        toy_setup, tmp_path):
    """A fake teacher whose logits give the end-of-turn id the logit log(position): the probabilities returned
    are those of the rows that predict answer tokens 2..n, after the prompt in the teacher's own template, and
    of the row after the answer."""
    from types import SimpleNamespace

    import torch

    from bench.onpolicy_end_hazard import HEAD_CHARS, end_probabilities
    from xtcache.chat.render import render
    from xtcache.testing.chat import chat_tokenizer

    tok = chat_tokenizer(toy_setup.teacher_tokenizer, "chatml", tmp_path / "t")
    V, end = len(tok), tok.eos_token_id

    def teacher(input_ids):
        n = input_ids.shape[1]
        logits = torch.full((1, n, V), -1e4)
        logits[0, :, 0] = 0.0  # one other id at logit 0: P(end) at row j = j / (j + 1)
        logits[0, :, end] = torch.log(torch.arange(n, dtype=torch.float64) + 1e-9).float()
        return SimpleNamespace(logits=logits)

    prompt = {"messages": [{"role": "user", "content": "what is the cache?"}]}
    prefix = len(tok(render(tok, prompt, add_generation_prompt=True), add_special_tokens=False)["input_ids"])
    long = "the cache stores the teacher's log-probs once, and many students read them again"
    answers = ["the cache stores teacher log-probs", "x", "", long]
    out = end_probabilities(teacher, tok, prompt, answers)
    n = len(tok(answers[0], add_special_tokens=False)["input_ids"])
    assert [a.text for a in out] == [answers[0], long] and n >= 2  # answers of fewer than two tokens are skipped
    rows = torch.arange(prefix, prefix + n - 1, dtype=torch.float64)
    assert torch.allclose(torch.as_tensor(out[0].inner), rows / (rows + 1), atol=1e-5)
    last = prefix + n - 1  # the row after the answer's last token: the teacher's P(end) where the answer ends
    assert out[0].last == pytest.approx(last / (last + 1), abs=1e-5)
    assert out[0].head_nll is None  # shorter than HEAD_CHARS: not in the like-for-like stretch
    # the long answer's tokens that end within its first HEAD_CHARS characters: token j is read at row
    # prefix - 1 + j, where every id but 0 and the end has logit -1e4 against log-sum-exp log(1 + row)
    enc = tok(long, add_special_tokens=False, return_offsets_mapping=True)
    head = [j for j, (_, stop) in enumerate(enc["offset_mapping"]) if stop <= HEAD_CHARS]
    assert 0 < len(head) < len(enc["input_ids"]) and all(i not in (0, end) for i in enc["input_ids"])
    want = sum(1e4 + math.log(prefix + j) for j in head)  # row prefix - 1 + j: log(1 + row) = log(prefix + j)
    assert out[1].head_nll == pytest.approx(want, rel=1e-6)
    assert out[1].head_bytes == len(long[:enc["offset_mapping"][head[-1]][1]].encode())


def test_every_on_policy_row_trains_the_sections_steps_on_as_many_rollouts():
    """A row's own --prompts, --rounds, --steps-per-round and --samples-per-prompt replace the section's (a value
    in braces names a file of the kind's); every row keeps the equal-cost rule: rounds x steps = the section's
    steps, rounds x prompts x samples = 2 rounds' worth (a row mixed 1:1 with a corpus cache's KD: half of it, unless
    the corpus is the converge cache, whose teacher values were paid for before the rows; a row from 7/8 of the
    prompts: 7/8 of it, sized to continued KD's teacher tokens where the samples run to the cap)."""
    s = ConvergedSettings()
    p = {"train_prompts": "train.jsonl", "wide_prompts": "wide.jsonl", "fewer_prompts": "fewer.jsonl",
         "continue_cache": "c", "continue_half_cache": "h", "converge_cache": "v"}
    # what prepare writes (tests below)
    prompts = {"train.jsonl": s.prompts, "wide.jsonl": 2 * s.prompts, "fewer.jsonl": s.prompts * 7 // 8}
    assert rounds_plan(p, s, []) == ["--prompts", "train.jsonl", "--rounds", "2", "--steps-per-round", "8",
                                     "--samples-per-prompt", "2"]
    assert rounds_plan(p, s, ["--loss", "auto", "--rounds", "4"])[2:4] == ["--rounds", "4"]
    assert rounds_plan(p, s, ["--loss", "auto", "--rounds", "4"])[-2:] == ["--loss", "auto"]
    assert rounds_plan(p, s, ["--prompts", "{wide_prompts}"])[:2] == ["--prompts", "wide.jsonl"]
    for _, how, flags, _ in ROWS:
        if how == "on":
            own, train = split_row_flags(flags)
            plan = dict(zip(rounds_plan(p, s, own)[::2], rounds_plan(p, s, own)[1::2], strict=True))
            rounds = int(plan["--rounds"])
            # a corpus whose teacher values train (rounds' --corpus-cache with `-- --corpus-loss kd|auto`) takes the place
            # of rollouts; rounds' default, `--corpus-loss ce`, reads its text only
            mix = {**CORPUS_MIX, **dict(zip(train[::2], train[1::2], strict=True))}
            kd_corpus = ("--corpus-cache" in own and mix["--corpus-loss"] != "ce"
                         and own[own.index("--corpus-cache") + 1] != "{converge_cache}")
            share = float(mix["--rollout-fraction"]) if kd_corpus else 1.0
            share *= (s.prompts * 7 // 8) / s.prompts if "{fewer_prompts}" in own else 1.0
            assert rounds * int(plan["--steps-per-round"]) == s.steps
            assert (rounds * prompts[plan["--prompts"]] * int(plan["--samples-per-prompt"])
                    == 2 * s.prompts * s.samples_per_prompt * share)


def test_every_on_policy_rows_flags_are_ones_xtcache_rounds_takes(tmp_path):
    """Each row's `xtcache rounds` command line, as on_policy builds it, is built into rounds' config without a
    refusal (a row whose flags rounds refuses would fail only after the converged students had trained)."""
    from xtcache.app.rounds import rounds
    from xtcache.cliconfig import config_of

    s = ConvergedSettings()
    p = {key: str(tmp_path / key) for key in ("train_prompts", "wide_prompts", "fewer_prompts", "continue_cache",
                                                         "continue_half_cache", "converge_cache")}
    for name, how, flags, _ in ROWS:
        if how == "on":
            own, train = split_row_flags(flags)
            train = [filled(p, a) for a in train]
            cfg, _ = config_of(rounds, ["--student", "S", "--teacher", "T", "--workdir", str(tmp_path / "w"),
                                        *rounds_plan(p, s, own), "--", *train])
            named = [key for key in ("wide_prompts", "fewer_prompts") if f"{{{key}}}" in own]
            assert cfg.prompts == [p[named[0]] if named else p["train_prompts"]], name


def test_the_wide_rows_prompts_are_the_rounds_and_continuation_prompts_never_a_converged_conversation():
    s = ConvergedSettings()
    wide = wide_prompt_rows(s.chat_train, s.prompts, s.chat_continue)
    converged = set(range(s.prompts, s.chat_train - s.chat_continue))  # prepare's converge.jsonl
    assert len(set(wide)) == 2 * s.prompts and not converged & set(wide)
    assert wide[:s.prompts] == list(range(s.prompts))


FIGURES = {"reverse_kl_per_sequence": 1.0, "teacher_nll_per_byte": 1.0, "reverse_kl_per_token": 0.1,
           "teacher_nll_per_token": 2.5, "mean_student_tokens": 9.0, "stopped_fraction": 1.0, "max_new_tokens": 100,
           "teacher_mean_student_tokens": 50.0}  # a measure's figures


def _fake_stages(monkeypatch, calls):
    """The section's stages replaced: prepare and converge read nothing, a trained run writes its held-out KL
    where train-student and rounds write it, and a measure records which student it graded."""
    def prepare(kind, work, s, log_file):  # the text kind's documents give three prompts fewer than asked
        work.mkdir(parents=True, exist_ok=True)
        (work / "prompts.jsonl").write_text("{}\n" * (s.prompts - 3 * (kind == "text")))
        return {"kind": kind, "train_prompts": work / "prompts.jsonl"}

    def converge(p, out, s, seed, log_file):
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.json").write_text(json.dumps({"final_eval_kl": 2.0 + seed}))
        return {"final_eval_kl": 2.0 + seed}

    def train(p, start, out, s, seed, flags, log_file):  # a continued off-policy row or rounds
        calls.append(("train", out.name))
        return {"hf": out / "hf", "heldout_kl": 1.0, "teacher_positions": 10}

    def measure(p, student, s):
        calls.append(("measure", str(student)))
        return {"samples": conv.eval_samples(p["kind"], s) * s.eval_prompts, **FIGURES}

    monkeypatch.setattr(conv, "prepare", prepare)
    monkeypatch.setattr(conv, "converge", converge)
    monkeypatch.setattr(conv, "off_policy", train)
    monkeypatch.setattr(conv, "on_policy", train)
    monkeypatch.setattr(conv, "measure", measure)


def test_adding_rows_keeps_a_reports_runs_measures_them_again_at_a_new_sample_count_and_trains_only_new_rows(
        tmp_path, monkeypatch):
    s = ConvergedSettings(seeds=1, chat_eval_samples=12, text_eval_samples=3)
    earlier = replace(s, chat_eval_samples=3)
    base_rows = {kind: {"converged student": [{"seed": 0, "converge_kl": 2.0, "samples": 96}],
                        **{name: [{"seed": 0, "heldout_kl": 1.5 + i, "samples": 96}]
                           for i, (name, _, _, _) in enumerate(ROWS[:3])}} for kind in conv.KINDS}
    base = {"settings": {**asdict(earlier), "eval_samples": 3}, "kinds": base_rows, "wall_s": 60.0}
    for kind in conv.KINDS:  # the earlier run's trained rows, where the section leaves them
        runs = tmp_path / "w" / kind / "runs"
        (runs / "row0-seed0").mkdir(parents=True)
        (runs / "row0-seed0" / "summary.json").write_text(json.dumps({"final_eval_kl": 1.5}))
        for i in (1, 2):
            (runs / f"row{i}-seed0").mkdir()
            (runs / f"row{i}-seed0" / "metrics.jsonl").write_text(
                json.dumps({"final_eval_kl": 1.5 + i, "hf_dir": f"/students/{kind}{i}"}) + "\n")
    calls = []
    _fake_stages(monkeypatch, calls)
    report = conv.run_converged(tmp_path / "w", s, base=base)
    measured = [c[1] for c in calls if c[0] == "measure"]
    assert measured[:4] == [str(tmp_path / "w/chat/converged-s0/hf"), str(tmp_path / "w/chat/runs/row0-seed0/hf"),
                            "/students/chat1", "/students/chat2"]  # each earlier chat run, graded at 384
    new_chat, new_text = ([i for i in range(3, len(ROWS)) if kind in ROWS[i][3]]  # rows the earlier report lacks
                          for kind in ("chat", "text"))
    assert [c[1] for c in calls if c[0] == "train"] == [f"row{i}-seed0" for i in [*new_chat, *new_text]]
    # text: its earlier rows already at their 96 samples, kept as they were; only its new rows measured
    assert [m for m in measured if "text" in m] == [str(tmp_path / f"w/text/runs/row{i}-seed0/hf") for i in new_text]
    assert {k: v for k, v in report["kinds"]["text"].items() if k in base_rows["text"]} == base_rows["text"]
    assert report["kinds"]["chat"][ROWS[1][0]][0]["heldout_kl"] == 2.5  # the earlier figures kept beside the new
    assert all(r[0]["samples"] == 384 for r in report["kinds"]["chat"].values())
    assert set(report["kinds"]["chat"]) == {"converged student", *(ROWS[i][0] for i in [0, 1, 2, *new_chat])}
    assert report["runs_s"][0] == 60.0 and len(report["runs_s"]) == 2  # the earlier run's wall time, then this one's
    # the prompts each kind's rounds sampled, as prepare wrote them, in the report and its block
    assert report["train_prompts"] == {"chat": s.prompts, "text": s.prompts - 3}
    assert report["measured"] == [run_record()]  # the earlier report records no run: this one's date and machine
    dated = conv.run_converged(tmp_path / "w", s, base={**base, "measured": [{"date": "2026-11-25", "machine": "M"}]})
    assert dated["measured"] == [{"date": "2026-11-25", "machine": "M"}, run_record()]

    (tmp_path / "w/chat/runs/row2-seed0/metrics.jsonl").write_text(json.dumps({"final_eval_kl": 9.9}) + "\n")
    with pytest.raises(SystemExit, match="row2-seed0: not the run of the report's row"):
        conv.run_converged(tmp_path / "w", s, base=base)
    with pytest.raises(SystemExit, match="trained with other settings"):
        conv.run_converged(tmp_path / "w", replace(s, lr=1e-3), base=base)


def test_a_table_rendered_again_from_its_report_is_stamped_with_the_runs_that_measured_it(tmp_path, monkeypatch):
    import argparse

    import bench.quality as quality

    doc = tmp_path / "docs" / "on-policy.md"
    doc.parent.mkdir()
    doc.write_text("<!-- quality-on-policy-converged:start -->\n<!-- quality-on-policy-converged:end -->\n")
    monkeypatch.setattr(quality, "REPO", tmp_path)
    args = argparse.Namespace(out=str(tmp_path), write_docs=True, quick=False, from_report="r.json")
    runs = [{"date": "2026-11-25", "machine": "2 CPU cores (B), no GPU"}]
    quality._publish(args, "quality-on-policy-converged", "| t |", {"measured": runs})
    assert "from a report measured on 2026-11-25, 2 CPU cores (B), no GPU._" in doc.read_text()
    quality._publish(args, "quality-on-policy-converged", "| t |", {"date": "2026-11-26", "machine": "C"})  # one run
    assert "from a report measured on 2026-11-26, C._" in doc.read_text()
    quality._publish(argparse.Namespace(**{**vars(args), "from_report": None}), "quality-on-policy-converged", "| t |",
                     {"measured": [*runs, run_record()]})  # measured now: this machine, as any fresh run
    assert f"{run_record()['date']}, {run_record()['machine']}._" in doc.read_text()
    for name in ("quality-on-policy", "quality-on-policy-converged", "quality-on-policy-converged-stronger",
                 "quality-on-policy-converged-same"):  # every published report names its runs
        assert quality.measured_runs(json.loads((REPO / "bench" / "results" / f"{name}.json").read_text())), name


def test_the_hazard_bench_reads_the_teacher_and_each_seeds_three_students_from_the_sections_runs(tmp_path):
    """Its models are the section's runs found as the section writes them: the converged student's and continued
    KD's exports, the rounds' last round's export; a run that did not finish is named."""
    from bench.onpolicy_end_hazard import hazard_models

    off = next(i for i, (_, how, _, _) in enumerate(ROWS) if how == "off")
    on = next(i for i, (_, how, flags, _) in enumerate(ROWS) if how == "on" and flags == ["--loss", "forward"])
    for run in (tmp_path / "converged-s0", tmp_path / "runs" / f"row{off}-seed0"):
        (run / "hf").mkdir(parents=True)
        (run / "summary.json").write_text(json.dumps({"final_eval_kl": 2.0}))
    rounds = tmp_path / "runs" / f"row{on}-seed0"
    (rounds / "round-001" / "train" / "hf").mkdir(parents=True)
    (rounds / "metrics.jsonl").write_text("".join(json.dumps({"round": r, "final_eval_kl": 2.0, "hf_dir": str(
        rounds / f"round-{r:03d}" / "train" / "hf")}) + "\n" for r in (0, 1)))
    assert hazard_models(tmp_path, [0]) == [
        ("teacher", "-", tmp_path / "chat" / "teacher"),
        ("converged student", 0, tmp_path / "converged-s0" / "hf"),
        ("continued off-policy KD", 0, tmp_path / "runs" / f"row{off}-seed0" / "hf"),
        ("on-policy rounds (rounds' defaults)", 0, rounds / "round-001" / "train" / "hf")]
    reverse = next(i for i, (_, how, flags, _) in enumerate(ROWS) if how == "on" and i != on)  # --row picks another
    (tmp_path / "runs" / f"row{reverse}-seed0" / "round-001" / "train" / "hf").mkdir(parents=True)
    (tmp_path / "runs" / f"row{reverse}-seed0" / "metrics.jsonl").write_text(json.dumps(
        {"round": 1, "hf_dir": str(tmp_path / "runs" / f"row{reverse}-seed0" / "round-001" / "train" / "hf")}) + "\n")
    assert hazard_models(tmp_path, [0], reverse)[-1] == (
        ROWS[reverse][0], 0, tmp_path / "runs" / f"row{reverse}-seed0" / "round-001" / "train" / "hf")
    for bad in (off, len(ROWS)):  # continued KD is no on-policy row; past the rows
        with pytest.raises(SystemExit, match=f"--row {bad}: not an on-policy row"):
            hazard_models(tmp_path, [0], bad)
    (rounds / "metrics.jsonl").write_text("")  # a run killed before its first round ended
    with pytest.raises(SystemExit, match=f"row{on}-seed0: no finished run there"):
        hazard_models(tmp_path, [0])


def test_rows_chosen_by_index_run_beside_continued_kd_and_an_unknown_index_is_refused(tmp_path, monkeypatch):
    calls = []
    _fake_stages(monkeypatch, calls)
    report = conv.run_converged(tmp_path / "w", ConvergedSettings(seeds=2), only={2})
    assert [c[1] for c in calls if c[0] == "train"] == ["row0-seed0", "row2-seed0", "row0-seed1", "row2-seed1"] * 2
    for rows in report["kinds"].values():
        assert list(rows) == ["converged student", ROWS[0][0], ROWS[2][0]] and all(len(r) == 2 for r in rows.values())
    with pytest.raises(SystemExit, match=f"--rows 2,{len(ROWS)}: the rows are 0 to {len(ROWS) - 1}"):
        conv.run_converged(tmp_path / "w", ConvergedSettings(seeds=1), only={2, len(ROWS)})


def test_a_report_from_before_the_chat_teacher_settings_counts_as_trained_with_the_small_teacher(tmp_path,
                                                                                                monkeypatch):
    s = ConvergedSettings(seeds=1)
    older = {k: v for k, v in asdict(s).items() if k not in conv.LATER_SETTINGS}  # as the reports of 2026-11-29
    base = {"settings": older, "kinds": {}, "wall_s": 1.0}
    _fake_stages(monkeypatch, [])
    report = conv.run_converged(tmp_path / "w", s, kinds=("chat",), base=base, only=set())
    assert set(report["kinds"]["chat"]) == {"converged student", OFF}
    stronger = replace(s, **conv.STRONGER_CHAT_TEACHER)
    assert (stronger.chat_teacher_hidden, stronger.chat_teacher_steps) != (s.chat_teacher_hidden, s.chat_teacher_steps)
    with pytest.raises(SystemExit, match="trained with other settings"):
        conv.run_converged(tmp_path / "w2", stronger, kinds=("chat",), base=base, only=set())
    runs = [{"seed": 0, **FIGURES, "samples": 384}]
    text = conv.markdown({"settings": asdict(stronger), "kinds": {"chat": {"converged student": runs, OFF: runs}}})
    assert "a 2-layer Qwen2 of hidden size 128 pre-trained for 400 steps" in text
    assert "the corpus caches top-16, the rounds' caches of their rollouts teacher-dump's default top-64" in text
    assert "| 0.100 | 2.400 | 9.0 |" in text  # reverse KL/token, then the student's own NLL/token (2.5 - 0.1)


def test_the_same_tokenizer_section_trains_a_student_of_the_teachers_tokenizer_without_a_projection(
        toy_setup, tmp_path, monkeypatch):
    """`--section on-policy-converged-same`: the chat student is the setup's fresh Llama on the teacher's tokenizer
    and chat template (built once), the text student one on the text teacher's tokenizer, no projection map is
    built or passed to train-student, and the table says one tokenizer. The stages' commands are recorded, not run."""
    from xtcache.chat.render import chat_fingerprint
    from xtcache.testing import chat
    from xtcache.tokenizer import load_tokenizer

    real = chat.build_chat_setup
    monkeypatch.setattr(chat, "build_chat_setup", lambda base, root, **kw: real(base, root, **{**kw, "teacher_steps": 0}))
    calls = []

    def run_xtcache(*args, log_file):
        calls.append(args)
        if args[0] == "train-student":
            out = args[args.index("--out") + 1]
            (tmp_path / out).mkdir(parents=True, exist_ok=True)
            (tmp_path / out / "summary.json").write_text(json.dumps({"final_eval_kl": 1.0}))

    monkeypatch.setattr(conv, "run_xtcache", run_xtcache)
    monkeypatch.setattr(conv, "dump_caches", lambda setup, dumps, projection, log_file: calls.append(("dumps", projection)))
    monkeypatch.setattr(conv, "trained_positions", lambda cache: 0)
    s = replace(conv.QUICK, **conv.SAME_TOKENIZER)
    p = conv.prepare("chat", tmp_path / "chat", s, tmp_path / "log")
    setup = p["setup"]
    assert setup.student_tokenizer == setup.teacher_tokenizer and setup.student_model == tmp_path / "chat" / "student-same"
    student, teacher = load_tokenizer(setup.student_model), load_tokenizer(setup.teacher_model)
    assert chat_fingerprint(student) == chat_fingerprint(teacher)  # tokenizer and template
    assert p["projection"] is None and calls == [("dumps", None)]
    conv.converge(p, tmp_path / "conv", s, 0, tmp_path / "log")
    conv.off_policy(p, tmp_path / "conv" / "hf", tmp_path / "off", s, 0, [], tmp_path / "log")
    conv.off_policy(p, tmp_path / "conv" / "hf", tmp_path / "off", s, 0, ROWS[12][2], tmp_path / "log")
    assert [c[0] for c in calls[1:]] == ["train-student"] * 3
    defaults, own = calls[2], calls[3]  # train-student's defaults, or the row's loss flags in their place
    assert defaults[defaults.index("--loss") + 1] == "auto" and "--ce-weight" not in defaults
    assert own.count("--loss") == 1 and own[own.index("--loss") + 1] == "pkl"
    assert own[own.index("--ce-weight") + 1] == "0.1" and own[own.index("--pkl-divergence") + 1] == "forward"
    assert not any("--projection" in c for c in calls)
    cross = conv.prepare("chat", tmp_path / "cross", replace(conv.QUICK, chat_teacher_steps=0), tmp_path / "log")
    assert cross["projection"] == tmp_path / "cross" / "projection.safetensors"
    assert conv.projection_flags(cross) == ["--projection", str(cross["projection"])]
    runs = [{"seed": 0, **FIGURES, "samples": 6}]
    text = conv.markdown({"settings": asdict(s), "kinds": {"chat": {"converged student": runs, OFF: runs}}})
    assert "One tokenizer: the student reads the teacher's tokenizer (and the chat student its chat template" in text
    assert "Cross-tokenizer" not in text
    calls.clear()  # text prefixes: a fresh Llama on the text teacher's tokenizer, no projection either
    text_p = conv.prepare("text", tmp_path / "text", s, tmp_path / "log")
    assert text_p["setup"].student_model == tmp_path / "text" / "student-same"
    assert text_p["setup"].student_tokenizer == text_p["setup"].teacher_tokenizer == toy_setup.teacher_tokenizer
    assert load_tokenizer(text_p["setup"].student_model).get_vocab() == load_tokenizer(toy_setup.teacher_model).get_vocab()
    assert text_p["projection"] is None and calls == [("dumps", None)]


def test_chunk_shapes_end_where_both_tokenizations_end_a_token_and_name_each_tokens_shape():
    """Chunks of 'abcdefghijklmn' cut by hand: 'abc' (one teacher token, two student tokens: split by the
    student), 'defghi' (two teacher tokens, one student token: split by the teacher), 'j' (1:1), 'klmn' (teacher
    'kl' 'mn', student 'k' 'lmn': split by both), against shapes_of's codes (SHAPES' order)."""
    from bench.onpolicy_chunk_shapes import SHAPES, shapes_of

    teacher = [(0, 3), (3, 5), (5, 9), (9, 10), (10, 12), (12, 14)]
    student = [(0, 1), (1, 3), (3, 9), (9, 10), (10, 11), (11, 14)]
    t_shape, s_shape, ends, shape = shapes_of(teacher, student)
    assert ends.tolist() == [3, 9, 10, 14]
    named = [SHAPES[i] for i in shape.tolist()]
    assert named == ["split by the student", "split by the teacher", "1:1", "split by both"]
    assert [SHAPES[i] for i in t_shape.tolist()] == [named[0], named[1], named[1], named[2], named[3], named[3]]
    assert [SHAPES[i] for i in s_shape.tolist()] == [named[0], named[0], named[1], named[2], named[3], named[3]]


def test_answer_tokens_tile_the_answer_in_each_template(toy_setup, tmp_path):
    """Each side's answer tokens cover the answer's characters end to end with no gap (one after the other up to
    the CJK characters), and their ids in the rendering decode to the answer; an empty answer is None."""
    from bench.onpolicy_chunk_shapes import answer_tokens
    from xtcache.testing.chat import chat_tokenizer

    answer = "the cache stores 4690 log-probs once, 東京"
    convs = [{"messages": [{"role": "user", "content": "what is the cache?"}, {"role": "assistant", "content": c}]}
             for c in (answer, "")]
    for family, base in (("chatml", toy_setup.teacher_tokenizer), ("llama3", toy_setup.student_tokenizer)):
        tok = chat_tokenizer(base, family, tmp_path / family)
        got, empty = answer_tokens(tok, convs)
        assert empty is None
        ids, spans, cover = got
        assert spans[0][0] == 0 and spans[-1][1] == len(answer)
        # no gap; tokens overlap only where byte tokens share a character (東京: several tokens of one character)
        assert all(b[0] <= a[1] <= b[1] and a[0] <= b[0] for a, b in zip(spans, spans[1:]))
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]) if b[1] <= answer.index("東"))
        assert tok.decode([ids[j] for j in cover]) == answer


def test_token_scores_are_each_tokens_nll_and_the_entropy_of_the_row_that_predicts_it():
    """A fake model whose row i puts logit log(i + 1) on id 0 and 0 on the other V - 1 ids: p0 = (i + 1) / (i + V),
    against closed forms (the second construction: the entropy written out from p0)."""
    import math
    from types import SimpleNamespace

    import torch

    from bench.onpolicy_chunk_shapes import token_scores

    V = 5

    def model(input_ids):
        n = input_ids.shape[1]
        logits = torch.zeros((1, n, V))
        logits[0, :, 0] = torch.log(torch.arange(n, dtype=torch.float64) + 1).float()
        return SimpleNamespace(logits=logits)

    ids = [3, 0, 2, 0]
    nll, ent = token_scores(model, ids)
    for j in range(1, len(ids)):
        i = j - 1  # the row that predicts token j
        p0 = (i + 1) / (i + V)
        q = 1 / (i + V)  # each of the other ids
        assert nll[i] == pytest.approx(-math.log(p0 if ids[j] == 0 else q), rel=1e-5)
        assert ent[i] == pytest.approx(-p0 * math.log(p0) - (V - 1) * q * math.log(q), rel=1e-5)


def test_a_mixed_row_counts_its_corpus_as_teacher_scored_only_when_the_corpus_trains_its_kd(tmp_path, monkeypatch):
    """on_policy's teacher-scored tokens: every round's rollout cache, plus the corpus cache when its KD trains
    (`-- --corpus-loss kd`); with --corpus-loss ce, rounds' default, its teacher values are never read, so it adds
    none; nor does the converge cache's KD, whose teacher values were paid for before the rows start."""
    from types import SimpleNamespace

    def run_xtcache(*args, log_file):  # rounds: two rounds' metrics, as `xtcache rounds` writes them
        out = tmp_path / "run"
        out.mkdir(exist_ok=True)
        (out / "metrics.jsonl").write_text("".join(json.dumps({"round": r, "hf_dir": str(out / f"r{r}")}) + "\n"
                                                   for r in range(2)))

    sizes = {"cache": 100, "corpus": 7, "converge": 9}  # each round's cache, the corpus caches
    monkeypatch.setattr(conv, "run_xtcache", run_xtcache)
    monkeypatch.setattr(conv, "trained_positions", lambda cache: sizes[cache.name])
    p = {"setup": SimpleNamespace(teacher_model="T"), "train_prompts": "train.jsonl", "projection": None,
         "eval_cache": tmp_path / "eval", "continue_cache": str(tmp_path / "corpus"),
         "converge_cache": tmp_path / "converge"}
    s = ConvergedSettings()
    mix = ["--loss", "forward", "--corpus-cache", "{continue_cache}"]
    counted = {name: conv.on_policy(p, tmp_path / "start", tmp_path / "run", s, 0, flags, tmp_path / "log")
               ["teacher_positions"] for name, flags in [("rollouts", ["--loss", "forward"]),
                                                         ("kd", [*mix, "--", "--corpus-loss", "kd"]), ("ce", mix),
                                                         ("converge", ROWS[15][2])]}
    assert counted == {"rollouts": 200, "kd": 207, "ce": 200, "converge": 200}
    assert ROWS[13][2] == mix  # the section's row of it


def test_the_real_teacher_section_runs_both_kinds_on_the_real_tier_with_a_llama3_student(
        toy_setup, tmp_path, monkeypatch):
    """`--section on-policy-converged --teacher real`: the text kind's corpus, teacher and tokenizers are the real
    tier's (here stood in by the toy's files), the fresh student a 2-layer Llama built once on the Llama-3
    vocabulary, a projection map between them; the chat kind's conversations are real.doc_conversations' (train
    topics to train, held-out topics to grade); policy-eval grades text at the fixed cap, which the table names as
    fixed, and conversations at twice the teacher's mean length; the other sections are refused. The stages'
    commands are recorded, not run."""
    from xtcache.testing import real

    models = real.RealModels(root=tmp_path / "real", teacher=toy_setup.teacher_model,
                             llama3_tokenizer=toy_setup.student_tokenizer, qwen3_tokenizer=toy_setup.student_tokenizer,
                             train_jsonl=toy_setup.train_jsonl, heldout_jsonl=toy_setup.heldout_jsonl)
    monkeypatch.setattr(real, "build_real_models", lambda: models)
    calls = []
    monkeypatch.setattr(conv, "dump_caches", lambda setup, dumps, projection, log_file: calls.append(
        (setup, [d[1].name for d in dumps], projection)))
    monkeypatch.setattr(conv, "trained_positions", lambda cache: 0)
    s = replace(conv.QUICK, **conv.REAL_TEACHER)
    p = conv.prepare("text", tmp_path / "text", s, tmp_path / "log")
    setup = p["setup"]
    assert (setup.teacher_model, setup.teacher_tokenizer) == (models.teacher, models.teacher)
    assert setup.student_tokenizer == models.llama3_tokenizer and setup.train_jsonl == models.train_jsonl
    assert setup.student_model == tmp_path / "text" / "student-real"
    assert "the Llama-3 vocabulary" in (setup.student_model / "DONE").read_text()
    assert calls == [(setup, ["cache-converge", "cache-continue", "cache-heldout"], p["projection"])]
    assert p["projection"] == tmp_path / "text" / "projection.safetensors"
    fewer, prompts = (Path(p[key]).read_text().splitlines() for key in ("fewer_prompts", "train_prompts"))
    assert fewer == prompts[:len(prompts) * 7 // 8] and 0 < len(fewer) < len(prompts)

    chat = conv.prepare("chat", tmp_path / "chat", s, tmp_path / "log")
    read = lambda path: [json.loads(x) for x in Path(path).read_text().splitlines()]  # noqa: E731
    train, heldout = read(chat["setup"].train_jsonl), read(chat["setup"].heldout_jsonl)
    assert (len(train), len(heldout)) == (s.chat_train, 2 * s.eval_prompts)
    answers = {r["messages"][-1]["content"] for r in train}
    assert answers.isdisjoint(r["messages"][-1]["content"] for r in heldout)
    prompts = read(chat["eval_prompts"])  # the held-out conversations up to their last user turn
    assert [r["messages"] for r in prompts] == [r["messages"][:-1] for r in heldout[:s.eval_prompts]]
    assert chat["setup"].student_tokenizer == models.llama3_tokenizer
    import stage1_teacher.onpolicy.policy_eval as pe

    graded = []
    monkeypatch.setattr(pe, "policy_eval", lambda *a, **kw: (graded.append(kw["max_new_tokens"]), ({}, None))[1])
    for q in (p, chat):
        with pytest.raises(KeyError):  # the report's keys: only the cap it was asked for matters here
            conv.measure(q, setup.student_model, s)
    assert graded == [96, 0]  # text: fixed; conversations: twice the teacher's mean length
    assert conv.eval_cap("text", asdict(conv.ConvergedSettings())) == 0  # the toy's: auto
    runs = [{"seed": 0, **FIGURES, "stopped_fraction": 0.1, "samples": 6, "max_new_tokens": 96,
             "teacher_mean_student_tokens": 90.0}]
    text = conv.markdown({"settings": asdict(s), "kinds": {"chat": {"converged student": runs, OFF: runs},
                                                           "text": {"converged student": runs, OFF: runs}}})
    assert "The teacher: SmolLM2-135M-Instruct" in text and "The chat teacher" not in text
    chat_part, text_part = text.split("**text**")
    assert "twice the teacher's mean length" in chat_part and "cap 96 tokens (fixed:" in text_part
    # a report written when one cap served both kinds
    before = {k: v for k, v in asdict(s).items() if not k.endswith("eval_max_new_tokens")}
    assert "cap 96 tokens (fixed:" in conv.markdown({"settings": {**before, "eval_max_new_tokens": 96},
                                                     "kinds": {"text": {"converged student": runs, OFF: runs}}})
    older = conv.markdown({"settings": {k: v for k, v in asdict(conv.QUICK).items() if k not in conv.LATER_SETTINGS
                                        and not k.endswith("eval_max_new_tokens")},
                           "kinds": {"text": {"converged student": runs, OFF: runs}}})
    assert "SmolLM2" not in older and "twice the teacher's mean length" in older
    from bench.quality import main

    with pytest.raises(SystemExit):
        main(["--section", "on-policy-converged-same", "--teacher", "real"])


def test_the_real_tiers_conversations_answer_with_their_topics_paragraphs():
    """real.doc_conversations: each assistant turn is a paragraph of its topic's documentation (prose unwrapped:
    whitespace and rule lines aside the same characters), within the length bounds; a later answer's conversation carries the
    answer before it and "Go on."; the train and held-out conversations come from disjoint topics."""
    import re

    from xtcache.testing import real

    topics = real.doc_topics()
    squash = lambda t: re.sub(r"\s+", "", t)  # noqa: E731
    rules = re.compile(r"^[*=-]+$", re.M)  # a heading's underline, a section rule: not an answer's text
    by_title = {t.split("\n", 1)[0].strip(): squash(rules.sub("", t)) for _, t in topics}
    titles = {}
    for heldout in (False, True):
        rows = real.doc_conversations(heldout=heldout)
        titles[heldout] = set()
        for r in rows:
            m = r["messages"]
            title = re.fullmatch(r"Explain (.*) in Python\.", m[0]["content"]).group(1)
            titles[heldout].add(title)
            answer = m[-1]["content"]
            assert squash(answer) in by_title[title] and 120 <= len(answer) <= 400
            assert [x["role"] for x in m] in (["user", "assistant"], ["user", "assistant", "user", "assistant"])
            if len(m) == 4:
                assert m[2]["content"] == "Go on." and squash(m[1]["content"]) in by_title[title]
    assert titles[False] and titles[True] and titles[False].isdisjoint(titles[True])
    assert len(titles[True]) == len(real.held_topics(len(topics)))


def test_the_block_gives_each_kinds_prompts_as_the_run_wrote_them():
    s = ConvergedSettings(seeds=1)
    runs = [{"seed": 0, "heldout_kl": 1.0, "samples": 96, **FIGURES}]
    report = {"settings": asdict(s), "kinds": {kind: {"converged student": runs, OFF: runs} for kind in conv.KINDS}}
    assert "on 24 training prompts x 2 samples" in conv.markdown(report)  # reports from before the counts
    report["train_prompts"] = {"chat": 24, "text": 21}  # the real tier's text: 8 documents gave 21 prefixes
    assert "on training prompts (chat 24, text 21) x 2 samples" in conv.markdown(report)
