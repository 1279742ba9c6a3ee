"""Stage 2 device discipline, proven on a CPU-only torch: the model side on a fake device, the batch
from the host, and every operation of the objective (forward and backward) checked for mixed devices.

Under `xtcache.testing.devices` every operation whose tensors sit on two devices raises, and so does
every read of a device value (`.item()`, a boolean mask): a case that passes also proves the
objective's claim that its call never reads back from the device. Forward and backward run on the
fake accelerator (`meta`: fake `cuda:0` tensors can take neither autograd nor advanced indexing on a
CPU-only build, see `xtcache.testing.devices`).

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/test_device_stage2.py
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from stage2_student.join import join_views
from stage2_student.mix import TeacherMix
from stage2_student.objective import Objective
from stage2_student.trainer import Trainer
from tests.test_losses import _memory_case, _two_teacher_case
from xtcache.testing.devices import (
    FAKE_ACCELERATOR,
    FakeTensorDeviceMismatchError,
    fake_accelerator,
    on_host,
    to_fake,
)

N, V = 24, 32  # positions of the micro-batch, student vocabulary
# each objective's row_chunk: a block's budget of 2 x ROWS x V fp32 holds 8 rows of a top-k KL block, so the
# 24 positions run as 3 blocks (full and P-KL: 5 blocks of up to 5 rows; CE alone: 2); the memory tests' row_chunk
# of 8 would give 24 blocks of one row each
ROWS = 72

CASES = ["topk kl", "topk rkl", "topk jsd", "topk kl T=2", "topk kl T=2 uniform", "full", "sampled", "pkl topk", "pkl full", "pkl T=2",
         "alm", "rkl-pg", "rkl-pg ratio", "ce", "sum", "dynamic likelihood", "dynamic entropy", "dynamic max-prob", "select", "mean-probs"]


def _case(name: str):
    """(objective, CPU micro-batch as the loader yields it) of one objective configuration."""
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    if name.startswith("topk"):
        obj, batch = _memory_case("topk k=16", N, V, gen)
        obj = Objective(name.split()[1], temperature=2.0 if "T=2" in name else 1.0,
                        teacher_tail="uniform" if name.endswith("uniform") else "ghost")
    elif name == "pkl T=2":
        obj, batch = _memory_case("pkl topk", N, V, gen)
        obj = Objective("pkl", projection=obj.projection, temperature=2.0)
    elif name.split()[0] in ("sum", "dynamic", "select"):
        obj, batch = _two_teacher_case(N, V, gen, combine=name.split()[0])
        obj.score = name.split()[1] if name.startswith("dynamic") else obj.score
        obj.vocab_sizes = [V, V // 2]
    elif name.startswith("rkl-pg"):  # rollouts: the realized log-probs, and the sampling ones for the ratio
        obj, batch = _memory_case("alm", N, V, gen)
        cap = 2.0 if name.endswith("ratio") else 0.0
        obj = Objective("rkl-pg", is_cap=cap)
        batch["sampled_logprobs"] = -torch.rand(1, N, generator=gen) * 3
    elif name == "mean-probs":  # two teachers of one tokenizer, trained on their mixture
        (_, a), (_, b) = _memory_case("topk k=16", N, V, gen), _memory_case("topk k=16", N, V, gen)
        for view in (a, b):
            view["chunk_group"] = torch.arange(N)
        obj, batch = TeacherMix([Objective("kl")], combine="mean-probs", weights=[0.7, 0.3]), \
            join_views([a, b], N)
    else:
        obj, batch = _memory_case(name, N, V, gen)
    batch["input_ids"] = torch.randint(0, V, (1, N), generator=gen)
    batch["attention_mask"] = torch.ones(1, N, dtype=torch.int64)
    for o in _objectives(obj):
        o.row_chunk = ROWS
    return obj, batch


def _objectives(obj) -> list:
    return getattr(obj, "objectives", [obj])


def _tensors(x, seen=None):
    """Every tensor reachable from a plan: attributes, lists, tuples, dicts."""
    seen = set() if seen is None else seen
    if id(x) in seen:
        return
    seen.add(id(x))
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, dict):
        for v in x.values():
            yield from _tensors(v, seen)
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _tensors(v, seen)
    elif hasattr(x, "__dict__"):
        yield from _tensors(vars(x), seen)


@pytest.fixture
def sparse_mm_on_fake_devices(monkeypatch):
    """torch has no meta kernel for sparse x dense matmuls (P-KL's W^T p): a stand-in that checks the
    operands' devices, returns the product's shape and keeps the dense operand in the graph."""
    real = torch.sparse.mm

    def checked(sparse, dense):
        if sparse.device != dense.device:
            raise FakeTensorDeviceMismatchError(torch.ops.aten.mm.default, sparse.device, dense.device)
        if sparse.device.type == "cpu":
            return real(sparse, dense)
        return dense.new_zeros(sparse.shape[0], dense.shape[1]) + dense.sum(dim=0, keepdim=True) * 0.0

    monkeypatch.setattr(torch.sparse, "mm", checked)


@pytest.mark.parametrize("name", CASES)
def test_objective_forward_and_backward_on_a_fake_accelerator(name, sparse_mm_on_fake_devices):
    obj, batch = _case(name)
    prep = obj.prepare(batch, vocab=V)  # host planning on the CPU batch, as the trainer does it
    assert all(len(p.blocks) > 1 for p in getattr(prep, "preps", [prep]))  # block boundaries crossed on the device
    with fake_accelerator():
        obj.to(FAKE_ACCELERATOR)
        prep.to(FAKE_ACCELERATOR)
        logits = torch.empty(1, N, V, device=FAKE_ACCELERATOR, requires_grad=True)
        loss, metrics = obj(logits, prep, chunks_total=float(N), tokens_total=float(N))
        loss.backward()
    assert loss.device == FAKE_ACCELERATOR and logits.grad.device == FAKE_ACCELERATOR
    assert all(m.device == FAKE_ACCELERATOR for m in metrics.values()), metrics


def test_the_sparse_matmul_stand_in_checks_devices(sparse_mm_on_fake_devices):
    w = torch.eye(3).to_sparse()
    with fake_accelerator(), pytest.raises(FakeTensorDeviceMismatchError):
        torch.sparse.mm(w, torch.empty(3, 2, device=FAKE_ACCELERATOR))


def test_a_plan_left_on_the_host_is_caught():
    """The check itself: the same call with the plan not moved fails on the first mixed operation."""
    obj, batch = _case("topk kl")
    prep = obj.prepare(batch, vocab=V)
    with fake_accelerator(), pytest.raises(FakeTensorDeviceMismatchError):
        obj(torch.empty(1, N, V, device=FAKE_ACCELERATOR, requires_grad=True), prep, chunks_total=float(N),
            tokens_total=float(N))


class _Engine:
    """The part of a DeepSpeed engine `Trainer.micro_step` uses, around a tiny model."""

    def __init__(self, model):
        self.model = model

    def __call__(self, input_ids, **_):
        return SimpleNamespace(logits=self.model(input_ids))

    def backward(self, loss, scale_wrt_gas):
        loss.backward()

    def step(self):
        pass


class _HostPlanning:
    """The run's objective, its host-side `prepare` outside the fake mode (as on the CPU); keeps the plan."""

    def __init__(self, obj):
        self.obj, self.prep = obj, None

    def prepare(self, batch, *, vocab):
        with on_host():
            return self.obj.prepare(batch, vocab=vocab)

    def __call__(self, logits, prep, **kw):
        self.prep = prep
        return self.obj(logits, prep, **kw)

    def __getattr__(self, name):  # everything else the trainer reads of its objective (staleness_cap, ...)
        return getattr(self.obj, name)


@pytest.mark.parametrize("name", ["topk kl", "sampled", "pkl topk", "alm", "ce", "dynamic entropy", "mean-probs"])
def test_the_trainer_moves_every_tensor_it_gives_the_device(name, sparse_mm_on_fake_devices):
    """`Trainer.micro_step` on a CPU micro-batch with the model on the fake accelerator: the model's
    inputs, the objective's plan and its projection W all reach the device by the trainer's own moves."""
    obj, batch = _case(name)
    obj = obj if isinstance(obj, TeacherMix) else TeacherMix([obj])  # the run's objective (stage2_student.data)
    trainer = Trainer.__new__(Trainer)  # the trainer's own code; no process group, no DeepSpeed
    model = torch.nn.Sequential(torch.nn.Embedding(V, 8), torch.nn.Linear(8, V))
    spy = _HostPlanning(obj)
    trainer.data, trainer.world = SimpleNamespace(objective=spy, measures=[], mixture_measure=None), 1
    with fake_accelerator():
        trainer.engine, trainer.device = _Engine(to_fake(model, FAKE_ACCELERATOR)), FAKE_ACCELERATOR
        obj.to(trainer.device)  # what Trainer.__init__ does with the run's objective
        row, valid_pos = trainer.micro_step(batch, float(N), float(N))
        left = [t for t in _tensors(spy.prep) if t.device != FAKE_ACCELERATOR]
        for o in _objectives(obj):
            if o.projection is not None:
                left += [t for t in (o.projection.student_top, *o.projection.matrices(torch.float32))
                         if t.device != FAKE_ACCELERATOR]
    assert not left, [(tuple(t.shape), t.device) for t in left]
    assert row.device == FAKE_ACCELERATOR and row.shape == (5 + 5 * obj.num_teachers + 4,)  # + onpolicy.staleness
    assert all(p.grad is not None and p.grad.device == FAKE_ACCELERATOR for p in model.parameters())
    assert valid_pos == N


# --------------------------------------------------------------------------------------------
# the process: which device is this rank's, and deterministic algorithms


@pytest.mark.parametrize("env, want", [
    ({"RANK": "9", "WORLD_SIZE": "16", "LOCAL_RANK": "1"}, 1),  # torchrun / deepspeed, second node
    ({}, 0),  # plain python
    ({"RANK": "0", "WORLD_SIZE": "1"}, 0),
    ({"RANK": "11", "WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}, 3),
])
def test_local_rank_comes_from_the_launcher_never_from_the_global_rank(env, want):
    from stage2_student.student import local_rank

    assert local_rank(env) == want


def test_a_multi_process_job_without_local_rank_is_refused():
    from stage2_student.student import local_rank
    from xtcache.errors import ConfigError

    with pytest.raises(ConfigError, match="LOCAL_RANK is not"):
        local_rank({"RANK": "9", "WORLD_SIZE": "16"})


_DETERMINISM = """
import os, torch
from stage2_student.student import set_deterministic
set_deterministic({on})
print(torch.are_deterministic_algorithms_enabled(), os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
      torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
from tests.test_device_stage2 import _case, N, V
for name in ("topk kl", "pkl topk", "dynamic entropy", "alm"):  # every op of the objective is allowed on CPU
    obj, batch = _case(name)
    logits = torch.randn(1, N, V, requires_grad=True)
    obj(logits, obj.prepare(batch, vocab=V), chunks_total=float(N), tokens_total=float(N))[0].backward()
print("objective ok")
"""


@pytest.mark.parametrize("on", [True, False])
def test_deterministic_sets_torch_cudnn_and_cublas_before_cuda_starts(on):
    import os
    import subprocess
    import sys

    from tests.test_train_kd import REPO

    env = {k: v for k, v in os.environ.items() if k != "CUBLAS_WORKSPACE_CONFIG"}
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", _DETERMINISM.format(on=on)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, last = proc.stdout.strip().splitlines()[0], proc.stdout.strip().splitlines()[-1]
    assert first == ("True :4096:8 True False" if on else "False None False False"), first
    assert last == "objective ok"


def test_the_deterministic_flag_reaches_the_config(monkeypatch, tmp_path):
    from tests.commands import xtcache

    seen = []
    monkeypatch.setattr("stage2_student.trainer.train", lambda cfg, checked: seen.append(cfg))
    monkeypatch.setattr("stage2_student.cli.check_inputs", lambda cfg: None)  # empty directories stand for them
    for d in ("c", "s"):  # paths are checked before anything reads them; the training itself is replaced
        (tmp_path / d).mkdir()
    base = ["--cache", str(tmp_path / "c"), "--student", str(tmp_path / "s"), "--out", str(tmp_path / "o")]
    for flags in (base, [*base, "--deterministic"]):
        proc = xtcache("train-student", *flags)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [c.deterministic for c in seen] == [False, True]
