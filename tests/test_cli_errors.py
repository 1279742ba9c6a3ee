"""Mistakes a user makes at the command line get one line that points home: the flag (or the file)
and what is wrong, exit 2, before anything reads the mistyped input.

Every command runs through the installed entry point (`tests.commands.xtcache`); the refusals come
before any model loads or any process group starts.

    pytest -q tests/test_cli_errors.py
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from tests.commands import xtcache


def _one_line_error(proc) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    return lines[0]


def _commands(toy_setup, tmp_path) -> dict[str, tuple[list, str, str]]:
    """name -> (argv with one mistyped path, the flag it names, the path)."""
    s, data = toy_setup, tmp_path / "d.jsonl"
    data.write_text('{"text": "hello"}\n')
    store, missing = tmp_path / "store", tmp_path / "art" / "studnet"
    store.mkdir()
    train = ["train-student", "--cache", store, "--student", s.student_model, "--out", tmp_path / "run"]
    return {
        "train-student --student": (["train-student", "--cache", store, "--student", missing, "--out", tmp_path / "r"],
                                    "--student", missing),
        "train-student --cache": (["train-student", "--cache", missing, "--student", s.student_model, "--out",
                                   tmp_path / "r"], "--cache", missing),
        "train-student --eval-cache": ([*train, "--eval-cache", missing], "--eval-cache", missing),
        "train-student --projection": ([*train, "--projection", missing], "--projection", missing),
        "train-student --deepspeed": ([*train, "--deepspeed", missing], "--deepspeed", missing),
        "generate --student": (["generate", "--student", missing, "--data", data, "--out", tmp_path / "g"],
                               "--student", missing),
        "align --student-tokenizer": (["align", store, "--student-tokenizer", missing], "--student-tokenizer",
                                      missing),
        "teacher-dump --student-tokenizer": (["teacher-dump", "--teacher", s.teacher_model, "--student-tokenizer",
                                              missing, "--data", data, "--out", tmp_path / "o"],
                                             "--student-tokenizer", missing),
        "verify": (["verify", missing], "STORE", missing),
        "inspect": (["inspect", missing], "STORE", missing),
        "cache ls": (["cache", "ls", "--cache-dir", missing], "--cache-dir", missing),
    }


CASES = ["train-student --student", "train-student --cache", "train-student --eval-cache",
         "train-student --projection", "train-student --deepspeed", "generate --student", "align --student-tokenizer",
         "teacher-dump --student-tokenizer", "verify", "inspect", "cache ls"]


@pytest.mark.parametrize("case", CASES)
def test_a_mistyped_path_is_one_line_naming_its_flag(case, toy_setup, tmp_path):
    argv, flag, path = _commands(toy_setup, tmp_path)[case]
    line = _one_line_error(xtcache(*argv))
    assert line == f"error: {flag} {path}: no such directory" or line == f"error: {flag} {path}: no such file", line


def test_a_config_files_bad_value_names_the_file_and_an_unknown_section_lists_the_sections(tmp_path):
    bad = tmp_path / "run.yaml"
    bad.write_text("cache: c\nstudent: s\nout: o\noptim:\n  max-steps: four\n")
    line = _one_line_error(xtcache("train-student", "--config", bad))
    assert line == f"error: --config {bad}: --max-steps 'four': expected int", line
    bad.write_text("cache: c\nstudent: s\nout: o\noptimization:\n  lr: 0.1\n")
    line = _one_line_error(xtcache("train-student", "--config", bad))
    assert f"--config {bad}: unknown section 'optimization'" in line, line
    assert "loader, loss, optim, deepspeed, checkpoint, eval" in line, line


def test_out_holding_another_key_names_the_setting_that_differs(toy_setup, tmp_path):
    from tests.conftest import teacher_dump

    store = teacher_dump(tmp_path / "store", toy_setup, toy_setup.train_jsonl, 2)  # --top-k 16
    proc = xtcache("teacher-dump", "--teacher", toy_setup.teacher_model, "--student-tokenizer",
                   toy_setup.student_tokenizer, "--data", tmp_path / "store.jsonl", "--out", store, "--mode", "topk",
                   "--top-k", "8", "--engine", "hf", "--docs-per-part", "16")
    line = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and line.startswith(f"error: --out {store} holds a cache of another key"), proc.stderr
    assert "(--top-k: 16 in the store, 8 now)" in line, line


def test_cache_ls_of_an_empty_directory_says_where_stores_come_from(tmp_path):
    proc = xtcache("cache", "ls", "--cache-dir", tmp_path)
    assert proc.returncode == 0 and f"no caches under {tmp_path}" in proc.stdout and "--cache-dir" in proc.stdout


TRAIN_INPUTS = ["--cache", "--eval-cache", "--corpus-cache", "--student without a tokenizer",
                "--student without a model"]


@pytest.mark.parametrize("case", TRAIN_INPUTS)
def test_train_student_refuses_a_directory_that_is_not_what_its_flag_needs_before_deepspeed(
        case, toy_setup, manifest_only, tmp_path, monkeypatch):
    """An existing directory of the wrong kind: one line naming the flag, and DeepSpeed is never imported
    (blocked here: a refusal that came after its import would be an ImportError instead)."""
    monkeypatch.setitem(sys.modules, "deepspeed", None)
    empty, tokenizer_only = tmp_path / "empty", tmp_path / "tokenizer_only"
    empty.mkdir()
    tokenizer_only.mkdir()
    for f in Path(toy_setup.student_model).glob("tokenizer*"):
        (tokenizer_only / f.name).write_bytes(f.read_bytes())
    train = ["train-student", "--cache", manifest_only, "--student", toy_setup.student_model, "--out", tmp_path / "r"]
    argv, want = {
        "--cache": (["train-student", "--cache", empty, "--student", toy_setup.student_model, "--out", tmp_path / "r"],
                    f"error: --cache {empty} is not an xtcache store (no manifest.json)"),
        "--eval-cache": ([*train, "--eval-cache", empty], f"error: --eval-cache {empty} is not an xtcache store"),
        "--corpus-cache": ([*train, "--corpus-cache", empty, "--rollout-fraction", "0.5"],
                           f"error: --corpus-cache {empty} is not an xtcache store"),
        "--student without a tokenizer": (["train-student", "--cache", manifest_only, "--student", empty, "--out",
                                           tmp_path / "r"], f"error: --student {empty}: the directory holds no tokenizer"),
        "--student without a model": (["train-student", "--cache", manifest_only, "--student", tokenizer_only,
                                       "--out", tmp_path / "r"],
                                      f"error: --student {tokenizer_only}: the directory holds no model (no config.json)"),
    }[case]
    line = _one_line_error(xtcache(*argv))
    assert line.startswith(want), line
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("case", ["--cache unaligned", "--eval-cache unaligned", "--cache incomplete"])
def test_train_student_refuses_a_store_it_cannot_read_for_this_student_before_deepspeed(
        case, toy_setup, two_doc_store, manifest_only, tmp_path, monkeypatch):
    """A store without an alignment group for the --student tokenizer, or one whose teacher-dump has not
    finished: the loader's own refusal, named by flag, before DeepSpeed (blocked here) starts."""
    monkeypatch.setitem(sys.modules, "deepspeed", None)
    running = tmp_path / "running"  # a store whose writer left no done marker: crashed or still running
    if case == "--cache incomplete":
        shutil.copytree(two_doc_store, running, ignore=lambda d, names: ["done"] if Path(d) == two_doc_store else [])
    base = ["train-student", "--student", toy_setup.student_model, "--out", tmp_path / "r"]
    argv, want = {
        "--cache unaligned": ([*base, "--cache", manifest_only],
                              f"error: --cache {manifest_only} has no alignment for the student tokenizer "),
        "--eval-cache unaligned": ([*base, "--cache", two_doc_store, "--eval-cache", manifest_only],
                                   f"error: --eval-cache {manifest_only} has no alignment for the student tokenizer "),
        "--cache incomplete": ([*base, "--cache", running],
                               f"error: --cache store {running}: 1 of 1 writer(s) have not finished"),
    }[case]
    line = _one_line_error(xtcache(*argv))
    assert line.startswith(want), line
    assert ("xtcache align" in line) if "unaligned" in case else line.endswith("pass --allow-incomplete to use the "
                                                                               "committed parts only"), line
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("command", ["generate", "projection build"])
def test_a_tokenizer_directory_without_a_tokenizer_is_one_line_naming_its_flag(command, toy_setup, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    data = tmp_path / "p.jsonl"
    data.write_text('{"text": "def f():"}\n')
    argv, flag = {
        "generate": (["generate", "--student", empty, "--data", data, "--out", tmp_path / "g", "--engine", "hf"],
                     "--student"),
        "projection build": (["projection", "build", "--student-tokenizer", empty, "--teacher-tokenizer",
                              toy_setup.teacher_tokenizer, "--out", tmp_path / "w.safetensors"], "--student-tokenizer"),
    }[command]
    line = _one_line_error(xtcache(*argv))
    assert line.startswith(f"error: {flag} {empty}: the directory holds no tokenizer (none of tokenizer.json, "), line


@pytest.mark.parametrize("prompts, says", [("nope.jsonl", "no such file"), ("nope-*.jsonl", "the pattern matches no file")])
def test_rounds_names_its_prompts_flag_for_a_missing_file_before_anything_runs(prompts, says, toy_setup, tmp_path,
                                                                              monkeypatch):
    monkeypatch.chdir(tmp_path)
    line = _one_line_error(xtcache("rounds", "--student", toy_setup.student_model, "--teacher",
                                   toy_setup.teacher_model, "--prompts", prompts, "--workdir", tmp_path / "w"))
    assert line == f"error: --prompts {prompts}: {says}", line
    assert not (tmp_path / "w").exists()  # no work directory, no stage started


@pytest.mark.parametrize("held", ["finished", "checkpoint"])
def test_train_student_refuses_to_overwrite_an_earlier_run_without_resume(held, toy_setup, manifest_only, tmp_path,
                                                                         monkeypatch):
    """A second train-student into the --out of an earlier run overwrote its checkpoints, metrics and export; now
    it is one line naming the way to continue, before DeepSpeed (blocked here), and the run's files are kept."""
    monkeypatch.setitem(sys.modules, "deepspeed", None)
    out = tmp_path / "run"
    if held == "finished":
        (out / "hf").mkdir(parents=True)
        (out / "summary.json").write_text("{}")
    else:
        (out / "checkpoints" / "step3").mkdir(parents=True)
        (out / "checkpoints" / "step3" / "train_config.json").write_text("{}")
    before = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    line = _one_line_error(xtcache("train-student", "--cache", manifest_only, "--student", toy_setup.student_model,
                                   "--out", out))
    assert line == f"error: --out {out} holds " + (
        "a finished run (summary.json, hf/): train it further with --resume latest and a larger --max-steps"
        if held == "finished" else "a run's checkpoint checkpoints/step3: continue it with --resume latest") + (
        ", or give another --out: a fresh run would overwrite it"), line
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == before


def test_train_student_checks_its_stores_once_and_train_alone_checks_them(toy_setup, two_doc_store, tmp_path,
                                                                        monkeypatch):
    """`xtcache train-student` (and so each rank of a launch, a process of its own) checks its stores once,
    before DeepSpeed starts, and hands the record to the trainer, which does not check them again;
    `trainer.train` called from Python checks them itself, and so it does given a record of another config."""
    import dataclasses

    import stage2_student.data as data
    import stage2_student.trainer as trainer
    from stage2_student.config import TrainConfig
    from stage2_student.student import load_tokenizer
    from xtcache.errors import ConfigError

    calls, check_stores = [], data.check_stores

    def counted(cfg, tokenizer):
        calls.append(cfg.out)
        return check_stores(cfg, tokenizer)

    def stop(*args, **kwargs):  # the step after the check: no loader, no model, no process group
        raise ConfigError("stopped after the store checks")

    monkeypatch.setattr(data, "check_stores", counted)
    monkeypatch.setattr(data, "make_loaders", stop)
    monkeypatch.setattr(trainer, "setup_distributed", lambda: (0, 0, 1))
    monkeypatch.setattr(trainer, "teardown_distributed", lambda: None)
    out = tmp_path / "run"
    proc = xtcache("train-student", "--cache", two_doc_store, "--student", toy_setup.student_model, "--out", out)
    assert proc.returncode == 2 and "stopped after the store checks" in proc.stderr, proc.stderr
    assert len(calls) == 1, calls
    cfg = TrainConfig.from_flat({"cache": str(two_doc_store), "student": str(toy_setup.student_model), "out": str(out)})
    record = check_stores(cfg, load_tokenizer(cfg.student))  # not counted
    for run_cfg, given, checks in ((cfg, None, 1),  # from Python, no record: it checks
                                   (cfg, record, 0),  # the record of this config: it does not again
                                   (dataclasses.replace(cfg, seed=1), record, 1)):  # of another config: it checks
        calls.clear()
        with pytest.raises(ConfigError, match="stopped after the store checks"):
            trainer.train(run_cfg, checked=given)
        assert len(calls) == checks, (run_cfg, given, calls)


def test_a_run_killed_before_its_first_complete_checkpoint_is_no_earlier_run(tmp_path):
    """Nothing of it to keep: a fresh run may start there (as `xtcache rounds` restarts such a stage)."""
    from stage2_student.checkpoint import earlier_run

    out = tmp_path / "run"
    (out / "checkpoints" / "step5").mkdir(parents=True)  # killed while saving: no train_config.json yet
    (out / "metrics.jsonl").write_text("{}\n")
    assert earlier_run(out) is None and earlier_run(tmp_path / "new") is None
    (out / "checkpoints" / "step2").mkdir()
    (out / "checkpoints" / "step2" / "train_config.json").write_text("{}")
    assert earlier_run(out) == "a run's checkpoint checkpoints/step2: continue it with --resume latest"
