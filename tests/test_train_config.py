"""`xtcache train-student` flags, the TrainConfig dataclass and config files stay in sync.

    pytest -q tests/test_train_config.py
"""

from __future__ import annotations

import json

import pytest

from stage2_student.config import TrainConfig, deepspeed_config, lr_lambda
from tests.commands import xtcache
from xtcache.cliconfig import read_config_file
from xtcache.errors import ConfigError


def test_flags_override_config_file_and_file_overrides_defaults(tmp_path, monkeypatch):
    seen = {}
    monkeypatch.setattr("stage2_student.trainer.train", lambda cfg, checked: seen.update(cfg=cfg))
    monkeypatch.setattr("stage2_student.cli.check_inputs", lambda cfg: None)  # empty directories stand for them
    for d in ("c", "s"):  # the paths a command is given must exist
        (tmp_path / d).mkdir()
    (tmp_path / "run.yaml").write_text(f"cache: {tmp_path}/c\nstudent: {tmp_path}/s\nout: /o\n"
                                       "loss: {kd_weight: 0.5, loss: pkl}\nlr: 0.002\nmax-steps: 7\n")
    result = xtcache("train-student", "--config", tmp_path / "run.yaml", "--lr", "0.01", "--bf16")
    assert result.returncode == 0, result.stdout + result.stderr
    cfg = seen["cfg"]
    assert (cfg.cache, cfg.loss.loss, cfg.loss.kd_weight, cfg.optim.max_steps) == ([f"{tmp_path}/c"], "pkl", 0.5, 7)
    assert cfg.optim.lr == 0.01 and cfg.deepspeed.bf16 is True
    assert cfg.optim.grad_accum == 1  # default


def test_toml_and_json_files(tmp_path):
    (tmp_path / "a.toml").write_text('cache = "/c"\n[optim]\nlr = 0.5\n')
    (tmp_path / "a.json").write_text(json.dumps({"deepspeed": {"zero_stage": 3}, "eval-every": 4}))
    assert read_config_file(TrainConfig, tmp_path / "a.toml") == {"cache": "/c", "lr": 0.5}
    assert read_config_file(TrainConfig, tmp_path / "a.json") == {"zero_stage": 3, "eval_every": 4}


def test_round_trip_through_json():
    cfg = TrainConfig.from_flat({"cache": "c", "student": "s", "out": "o", "zero_stage": 3, "jsd_beta": 0.3,
                                 "storage_options": '{"anon": true}'})
    assert cfg.loader.storage_options == {"anon": True}
    assert TrainConfig.from_dict(json.loads(cfg.to_json())) == cfg


@pytest.mark.parametrize("bad, flag", [
    ({"grad_accum": 0}, "--grad-accum"), ({"loss": "mse"}, "--loss"), ({"jsd_beta": 1.0}, "--jsd-beta"),
    ({"pkl_reverse_weight": 1.0}, "--pkl-reverse-weight"),
    ({"eval_fraction": 0.1, "eval_cache": "x"}, "--eval-fraction"), ({"warmup_steps": 5, "max_steps": 3}, "--warmup"),
    ({"zero_stage": 4}, "--zero-stage"), ({"storage_options": "[1]"}, "--storage-options"),
    ({"loss": "ce", "ce_weight": 0.0}, "--ce-weight"),
    ({"cache": ["a", "b"], "teacher_weights": "0.7"}, "--teacher-weights"),
    ({"cache": ["a", "b"], "teacher_weights": "0.7,x"}, "--teacher-weights"),
    ({"cache": ["a", "b"], "teacher_weights": "-1,2"}, "--teacher-weights"),
    ({"teacher_combine": "max"}, "--teacher-combine"), ({"teachers_missing": "keep"}, "--teachers-missing"),
    ({"teacher_combine": "mean-probs", "teachers_missing": "partial"}, "--teacher-combine"),
    ({"cache": ["a", "b"], "eval_cache": ["x"]}, "--eval-cache"),
])
def test_cross_field_checks_name_the_flag(bad, flag):
    with pytest.raises((ValueError, ConfigError), match=flag):
        TrainConfig.from_flat({"cache": "c", "student": "s", "out": "o", **bad})


def test_several_caches_from_a_config_file_with_their_weights(tmp_path):
    (tmp_path / "run.yaml").write_text("cache: [/a, /b]\nstudent: /s\nout: /o\nteacher-weights: '0.7,0.3'\n"
                                       "loss: {teacher_combine: select}\nprojection: [/w.safetensors]\n")
    cfg = TrainConfig.from_flat(read_config_file(TrainConfig, tmp_path / "run.yaml"))
    assert cfg.cache == ["/a", "/b"] and cfg.teacher_weights() == [0.7, 0.3]
    assert cfg.loss.teacher_combine == "select" and cfg.loss.projection == ["/w.safetensors"]
    assert TrainConfig.from_flat({"cache": "c", "student": "s", "out": "o"}).teacher_weights() == [1.0]


def test_unknown_config_key_is_refused():
    with pytest.raises(ValueError, match="unknown setting 'learning_rate'"):
        TrainConfig.from_flat({"cache": "c", "student": "s", "out": "o", "learning_rate": 1})


def test_missing_required_flags_are_reported():
    result = xtcache("train-student", "--cache", "c")
    # a ConfigError: main() prints it as one `error: ...` line and exits 2
    assert result.returncode == 2 and result.stderr.startswith("error: ") and "--student" in result.stderr, result.stderr


def test_deepspeed_config_follows_flags(tmp_path):
    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 3}, "train_batch_size": 999}))
    cfg = TrainConfig.from_flat({"cache": "c", "student": "s", "out": "o", "deepspeed": str(tmp_path / "ds.json"),
                                 "micro_batch_size": 3, "grad_accum": 5, "grad_clip": 0.5, "bf16": True})
    ds = deepspeed_config(cfg, num_params=10)
    assert "train_batch_size" not in ds
    assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (3, 5)
    assert ds["zero_optimization"]["stage"] == 3 and ds["zero_optimization"]["stage3_param_persistence_threshold"] == 0
    assert ds["optimizer"]["params"]["torch_adam"] is True and ds["bf16"] == {"enabled": True}


@pytest.mark.parametrize("text, says", [("{\"zero_optimization\": ", "not JSON"), ("[1, 2]", "a DeepSpeed config is a JSON object, not list"),
                                        ("{\"zero_optimization\": 2}", "zero_optimization is a JSON object, not int")])
def test_a_deepspeed_file_that_is_not_a_json_object_is_named(tmp_path, text, says):
    from xtcache.errors import ConfigError

    (tmp_path / "ds.json").write_text(text)
    cfg = TrainConfig.from_flat({"cache": "c", "student": "s", "out": "o", "deepspeed": str(tmp_path / "ds.json")})
    with pytest.raises(ConfigError, match=f"--deepspeed {tmp_path / 'ds.json'}: {says}"):
        deepspeed_config(cfg)


def test_warmup_then_cosine():
    cfg = TrainConfig.from_flat({"cache": "c", "student": "s", "out": "o", "warmup_steps": 4, "max_steps": 14,
                                 "min_lr_ratio": 0.1})
    f = lr_lambda(cfg)
    assert [f(i) for i in range(4)] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert f(4) == pytest.approx(1.0) and f(14) == pytest.approx(0.1)
    assert all(f(i) >= f(i + 1) for i in range(4, 14))


def test_a_step_without_valid_chunks_raises_instead_of_a_silent_zero_kd():
    """The guard in Trainer.train_step, on a batch whose windows hold no valid chunk."""
    import types

    import torch

    from stage2_student.losses import NoValidChunksError
    from stage2_student.objective import Objective
    from stage2_student.rollout_mix import CORPUS_OBJECTIVE_KEY
    from stage2_student.trainer import Trainer

    batch = {"num_chunks": 0, "labels": torch.tensor([[5, 6, -100]]), "input_ids": torch.tensor([[1, 5, 6]])}
    corpus = {**batch, CORPUS_OBJECTIVE_KEY: True}  # --corpus-loss ce: its objective is CE alone
    stub = types.SimpleNamespace(step=3, data=types.SimpleNamespace(objective=Objective("kl"),
                                                                    corpus_objective=Objective(None, ce_weight=1.0)),
                                 all_reduce=lambda values: [float(v) for v in values])
    stub.objective_of = lambda b: Trainer.objective_of(stub, b)
    with pytest.raises(NoValidChunksError, match="optimizer step 4.*--seq-len"):
        Trainer.train_step(stub, [batch, dict(batch)])
    with pytest.raises(NoValidChunksError):  # a KD micro-batch beside a CE-only one: still no chunk to train
        Trainer.train_step(stub, [batch, corpus])

    class Passed(Exception):
        pass

    def get_lr():
        raise Passed
    stub.engine = types.SimpleNamespace(get_lr=get_lr)  # the step goes on past the guard
    with pytest.raises(Passed):  # every micro-batch CE-only (--corpus-loss ce): no KD was asked for
        Trainer.train_step(stub, [corpus])


@pytest.mark.parametrize("run_loss", ["kl", None])
def test_a_mixed_steps_kd_metrics_keep_the_objectives_apart_and_the_normaliser_counts_kd_chunks_only(run_loss):
    """Trainer.train_step over rollout, corpus (--corpus-loss auto) and rollout micro-batches of 3, 5 and 2 chunks
    whose KD sums are 1.5, 10 and 0.5: `kd` is the rollouts' 2.0 / 5, `corpus_kd` the corpus's 10 / 5, and every
    KD term is divided by the chunks of the micro-batches that train KD (10; 5 when the run itself trains CE alone,
    `--loss ce`, and only the corpus objective has a KD term)."""
    import types

    import torch

    from stage2_student.mix import TeacherMix
    from stage2_student.objective import Objective
    from stage2_student.rollout_mix import CORPUS_OBJECTIVE_KEY
    from stage2_student.trainer import Trainer

    def batch(chunks: int, corpus: bool = False) -> dict:
        b = {"num_chunks": chunks, "labels": torch.tensor([[5, 6, 7]]), "attention_mask": torch.ones(1, 3)}
        return {**b, CORPUS_OBJECTIVE_KEY: True} if corpus else b

    normalisers = []

    def micro_step(b, chunks_total, tokens_total):
        normalisers.append(chunks_total)
        row = torch.zeros(5 + 5 + 4, dtype=torch.float64)
        row[1] = {3: 1.5, 5: 10.0, 2: 0.5}[b["num_chunks"]]
        return row, 0

    run = TeacherMix([Objective(run_loss, ce_weight=1.0 if run_loss is None else 0.1)])
    stub = types.SimpleNamespace(step=0, device="cpu", all_reduce=lambda values: [float(v) for v in values],
                                 micro_step=micro_step,
                                 data=types.SimpleNamespace(objective=run, corpus_objective=TeacherMix([Objective("kl")])),
                                 engine=types.SimpleNamespace(get_lr=lambda: [1e-3], train=lambda: None,
                                                              get_global_grad_norm=lambda: 1.0))
    stub.objective_of = lambda b: Trainer.objective_of(stub, b)
    row = Trainer.train_step(stub, [batch(3), batch(5, corpus=True), batch(2)])
    assert row["corpus_kd"] == pytest.approx(2.0) and row["corpus_kd_name"] == "kl" and row["chunks"] == 10
    if run_loss is None:
        assert "kd" not in row and normalisers == [5.0] * 3
    else:
        assert row["kd"] == pytest.approx(0.4) and row["kd_name"] == "kl" and normalisers == [10.0] * 3


def test_trainer_state_of_the_previous_version_loads_and_a_newer_one_is_refused(tmp_path):
    """Version 1 records (written before the objective was recorded) and version 2 (its kind alone) still
    resume; unknown versions are refused with the version needed."""
    from stage2_student.checkpoint import TRAINER_STATE_VERSION, read_trainer_state, resume_point
    from xtcache.errors import ConfigError

    ckpt = tmp_path / "checkpoints" / "step3"
    ckpt.mkdir(parents=True)
    loader = {"next_micro_batch": 6, "seed": 0}
    (ckpt / "trainer_state_rank0.json").write_text(json.dumps({"step": 3, "world": 1, "loader": loader}))
    (tmp_path / "checkpoints" / "latest").write_text("step3")
    point = resume_point(tmp_path, "latest", rank=0, world=1, grad_accum=2)
    assert point.state == {"version": TRAINER_STATE_VERSION, "step": 3, "world": 1, "loader": loader,
                           "objective": None}
    assert point.loader == loader and not point.reshard
    (ckpt / "trainer_state_rank0.json").write_text(json.dumps({"version": 2, "step": 3, "world": 1, "loader": loader,
                                                               "objective": "pkl"}))
    assert read_trainer_state(ckpt / "trainer_state_rank0.json")["objective"] == {"kind": "pkl"}
    (ckpt / "trainer_state_rank0.json").write_text(json.dumps({"version": 99, "step": 3, "world": 1, "loader": {}}))
    with pytest.raises(ConfigError, match="version 99"):
        read_trainer_state(ckpt / "trainer_state_rank0.json")


def test_a_resume_under_another_objective_names_every_changed_setting():
    from stage2_student.checkpoint import objective_changes
    from stage2_student.mix import TeacherMix
    from stage2_student.objective import Objective

    was = Objective("kl", ce_weight=0.1).describe()
    assert objective_changes(was, Objective("kl", ce_weight=0.1)) == []
    assert objective_changes(was, Objective("kl", ce_weight=0.5, temperature=2.0)) == [
        "ce_weight 0.1 -> 0.5", "temperature 1.0 -> 2.0"]
    assert objective_changes(was, Objective(None, ce_weight=1.0)) == [
        "ce_weight 0.1 -> 1.0", "dynamic_scaling False -> None", "kd_weight 1.0 -> None", "kind 'kl' -> None",
        "teacher_tail 'ghost' -> None", "temperature 1.0 -> None"]
    assert objective_changes({"kind": "kl"}, Objective("kl", ce_weight=0.5)) == []  # a version 2 record
    two = TeacherMix([Objective("kl"), Objective("kl", with_ce=False)], weights=[1.0, 1.0])
    assert objective_changes({"kind": "kl+kl"}, two) == []  # version 2 of two teachers: their kinds
    assert objective_changes({"kind": "kl+kl"}, TeacherMix([Objective("kl")])) == ["kind 'kl+kl' -> 'kl'"]
    assert objective_changes(two.describe(), two) == []
    assert objective_changes(None, Objective("kl")) == []  # version 1: nothing recorded


@pytest.mark.parametrize("rank", [0, 1])
def test_a_checkpoint_is_marked_complete_only_after_every_rank_wrote_its_files(tmp_path, monkeypatch, rank):
    """train_config.json (rank 0's, what `xtcache rounds` reads as "this checkpoint is complete") is written after
    a barrier that every rank reaches only once its DeepSpeed files, trainer state and RNG are written."""
    import types

    import torch.distributed

    from stage2_student import checkpoint

    events = []
    monkeypatch.setattr(torch.distributed, "barrier", lambda: events.append("barrier"))

    def save_checkpoint(root, tag, client_state):
        (tmp_path / "checkpoints" / tag).mkdir(parents=True)
        events.append("deepspeed")

    trainer = types.SimpleNamespace(
        out=tmp_path, step=3, world=2, rank=rank, engine=types.SimpleNamespace(save_checkpoint=save_checkpoint),
        data=types.SimpleNamespace(train=types.SimpleNamespace(state_dict=lambda: {"next_micro_batch": 6}),
                                   objective=types.SimpleNamespace(kind="kl", describe=lambda: {"kind": "kl"})),
        cfg=types.SimpleNamespace(to_json=lambda: "{}", checkpoint=types.SimpleNamespace(keep_checkpoints=0)))
    real_write = type(tmp_path).write_text
    monkeypatch.setattr(type(tmp_path), "write_text",
                        lambda p, *a, **k: (events.append(p.name), real_write(p, *a, **k))[1])
    monkeypatch.setattr("torch.save", lambda obj, path: events.append(path.name))
    checkpoint.save(trainer)
    mine = [f"trainer_state_rank{rank}.json", f"rng_rank{rank}.pt"]
    assert events[:4] == ["barrier", "deepspeed", *mine]
    assert events[4:] == (["barrier", "train_config.json", "barrier"] if rank == 0 else ["barrier", "barrier"])
