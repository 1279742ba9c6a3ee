"""Stage 2 invariances on a real teacher cache, every run (every rank) its own process, one process group each.

- world 1 x grad-accum 2 trains the same model as world 2 x grad-accum 1 (2 ranks, ZeRO-2 and
  ZeRO-3, CPU/gloo): per-step losses, token counts and the exported weights agree; under ZeRO-3
  each rank loads only its partition of the student (zero.Init);
- a run stopped at step k and resumed from its checkpoint continues bit-identically (losses, lr,
  final weights), the loader state included; resumed at another world size (same global batch)
  it continues the same run through DeepSpeed's universal checkpoint;
- the Hugging Face export loads with plain transformers;
- user errors (a student tokenizer the cache was not aligned for, a projection map of other
  tokenizers) reach the user as one clear line.

The runs are forked from one process that imported DeepSpeed once (`tests.commands`), each rank
started with the environment torchrun gives it; tests/test_s3_walkthrough.py runs stage 2 under
torchrun itself.

    pytest -q tests/test_train_distributed.py
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.test_train_kd import run_stage2


def flags(toy_setup, caches, **extra) -> list[str]:
    train, held = caches
    base = {"cache": train, "eval-cache": held, "student": str(toy_setup.student_model), "seq-len": "48",
            "micro-batch-size": "2", "max-steps": "4", "lr": "3e-3", "warmup-steps": "1", "loss": "pkl",
            "ce-weight": "0.1", "eval-batches": "4"}
    base.update({k.replace("_", "-"): str(v) for k, v in extra.items()})
    if "eval-fraction" in base:  # held out from the training cache instead of the second store
        del base["eval-cache"]
    return [x for k, v in base.items() for x in (f"--{k}", v)]


def weights(hf_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(hf_dir / "model.safetensors"))


def same_flags(zero: int) -> dict:
    """The flags the two sides of one ZeRO stage share (grad-accum aside); the whole held-out split on
    both sides (an --eval-batches cap counts per rank)."""
    return dict(zero_stage=zero, eval_fraction=0.15, eval_batches=0, save_every=2)


@pytest.fixture(scope="module")
def pairs(toy_setup, kd_caches, tmp_path_factory, procs):
    """`pairs(zero)`: (run root, world 1 x grad-accum 2 run, world 2 x grad-accum 1 run) of ZeRO `zero`,
    trained once for this module. --deterministic (the flag GPU resumes need) on both: on CPU every op
    of the run must accept it, and the 1-rank run is the one the exact resume continues."""
    done = {}

    def get(zero: int):
        if zero not in done:
            root = tmp_path_factory.mktemp(f"zero{zero}")
            a = procs.run(root / "w1a2", *flags(toy_setup, kd_caches, grad_accum=2, **same_flags(zero)),
                           "--deterministic")
            b = procs.run(root / "w2a1", *flags(toy_setup, kd_caches, grad_accum=1, **same_flags(zero)),
                           "--deterministic", nproc=2)
            done[zero] = root, a, b
        return done[zero]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("zero", [2, 3])
def test_world1_accum2_equals_world2_accum1_and_resumes_at_the_other_world_size(tmp_path, toy_setup, kd_caches, pairs,
                                                                                procs, zero):
    """World 1 x grad-accum 2 and world 2 x grad-accum 1 (the same global batch) train the same
    model; then one of them, stopped at step 2, is resumed as the other (ZeRO-2: the 2-rank run
    resumed on 1 rank, ZeRO-3: the 1-rank run on 2 ranks) through DeepSpeed's universal checkpoint
    and continues the same run. Another global batch cannot continue it: a clear refusal."""
    root, a, b = pairs(zero)
    same = same_flags(zero)
    assert [r["step"] for r in a["train"]] == [r["step"] for r in b["train"]] == [1, 2, 3, 4]
    for key in ("tokens", "chunks"):
        assert [r[key] for r in a["train"]] == [r[key] for r in b["train"]]
    for key in ("loss", "kd", "ce"):
        assert [r[key] for r in a["train"]] == pytest.approx([r[key] for r in b["train"]], rel=1e-5, abs=1e-6), key
    assert a["summary"]["world_size"] == 1 and b["summary"]["world_size"] == 2
    n = a["summary"]["student_params"]
    assert a["summary"]["student_params_local_at_load"] == n
    if zero == 3:  # built under zero.Init: rank 0 never held more than its half of the student
        assert b["summary"]["student_params_local_at_load"] < 0.51 * n
    else:
        assert b["summary"]["student_params_local_at_load"] == n
    assert a["summary"]["final_eval_kl"] == pytest.approx(b["summary"]["final_eval_kl"], rel=1e-4)
    wa, wb = weights(root / "w1a2" / "hf"), weights(root / "w2a1" / "hf")
    initial = weights(Path(toy_setup.student_model))
    assert wa.keys() == wb.keys() == initial.keys()
    assert all(wa[k].shape == initial[k].shape for k in wa)  # consolidated, not ZeRO-3 partitions
    assert any((wa[k] != initial[k]).any() for k in wa)
    for key in wa:
        assert (wa[key] - wb[key]).abs().max().item() <= 1e-5, key

    # (ranks, grad-accum) saved -> resumed
    saved, resumed, full = ((2, 1), (1, 2), b) if zero == 2 else ((1, 2), (2, 1), a)
    full_dir = root / ("w2a1" if saved[0] == 2 else "w1a2")
    step2 = full_dir / "checkpoints" / "step2"
    resume_flags = flags(toy_setup, kd_caches, grad_accum=resumed[1], **{**same, "save_every": 0})
    after = procs.run(tmp_path / "next", *resume_flags, "--resume", str(step2), nproc=resumed[0])
    assert (full_dir / "checkpoints" / "step2_universal").is_dir()
    assert [r["step"] for r in after["train"]] == [3, 4]
    for key in ("tokens", "chunks"):
        assert [r[key] for r in after["train"]] == [r[key] for r in full["train"][2:]], key
    for key in ("loss", "kd", "ce", "lr"):
        assert [r[key] for r in after["train"]] == pytest.approx([r[key] for r in full["train"][2:]],
                                                                 rel=1e-4, abs=1e-6), key
    wf, wr = weights(full_dir / "hf"), weights(tmp_path / "next" / "hf")
    for key in wf:
        assert (wf[key] - wr[key]).abs().max().item() <= 1e-4, key
    # another global batch cannot continue the same sample stream: a clear refusal
    bad = procs.cli("train-student", *flags(toy_setup, kd_caches, grad_accum=1, **{**same, "save_every": 0}), "--out",
                  str(tmp_path / "bad"), "--resume", str(step2))
    want = "--grad-accum 2" if saved[0] != 1 else "grad_accum 2 -> 1"  # another world size / the same one
    assert bad.returncode == 2 and want in bad.stdout + bad.stderr, bad.stderr[-2000:]


@pytest.mark.slow
def test_resume_continues_exactly_and_export_loads(tmp_path, toy_setup, kd_caches, pairs, procs):
    """The 1-rank ZeRO-2 run of `pairs` (--deterministic), stopped after step 2 (only its step-2
    checkpoint survives) and resumed with --resume latest in a new process: the same steps 3-4, bit for bit."""
    root, full, _ = pairs(2)
    run = [*flags(toy_setup, kd_caches, grad_accum=2, **same_flags(2)), "--deterministic"]
    assert full["summary"]["deterministic"] is True
    part = tmp_path / "part" / "checkpoints"
    part.mkdir(parents=True)
    shutil.copytree(root / "w1a2" / "checkpoints" / "step2", part / "step2")
    (part / "latest").write_text("step2")
    resumed = procs.run(tmp_path / "part", *run, "--resume", "latest")
    assert [r["step"] for r in resumed["train"]] == [3, 4]
    for key in ("loss", "kd", "ce", "lr", "tokens", "grad_norm"):
        assert [r[key] for r in resumed["train"]] == [r[key] for r in full["train"][2:]], key
    wf, wr = weights(root / "w1a2" / "hf"), weights(tmp_path / "part" / "hf")
    assert all((wf[k] == wr[k]).all() for k in wf)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(root / "w1a2" / "hf"))
    tok = AutoTokenizer.from_pretrained(str(root / "w1a2" / "hf"))
    ids = tok("def f(x):\n    return x", return_tensors="pt")["input_ids"]
    assert model(input_ids=ids).logits.shape[-1] == model.config.vocab_size
    for key, value in wf.items():
        assert (model.state_dict()[key] == value).all(), key
    summary = full["summary"]
    assert summary["steps"] == 4 and Path(summary["metrics"]).is_file()
    assert summary["final_eval_kl"] is not None and summary["final_eval_ce"] is not None
    assert summary["steps_per_s"] > 0 and summary["tokens_per_s"] > 0


@pytest.mark.slow
def test_wrong_student_tokenizer_is_refused_with_what_to_do(tmp_path, toy_setup, kd_caches, procs):
    from transformers import AutoTokenizer

    other = tmp_path / "student_with_extra_token"  # same weights, a tokenizer the cache was not aligned for
    shutil.copytree(toy_setup.student_model, other)
    tok = AutoTokenizer.from_pretrained(str(other))
    tok.add_tokens(["<extra>"])
    tok.save_pretrained(str(other))
    proc = procs.cli("train-student", *flags(toy_setup, kd_caches, student=other, out=tmp_path / "o"))
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "xtcache align" in last


@pytest.mark.slow
def test_projection_of_other_tokenizers_is_refused(tmp_path, toy_setup, kd_caches, procs):
    from transformers import AutoTokenizer

    from xtcache.projection import build_projection

    tok = AutoTokenizer.from_pretrained(str(toy_setup.teacher_tokenizer))
    build_projection(tok, tok).save(tmp_path / "w.safetensors")  # teacher -> teacher: wrong student side
    proc = procs.cli("train-student", *flags(toy_setup, kd_caches, projection=tmp_path / "w.safetensors", out=tmp_path / "o"))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "does not fit" in proc.stderr and "xtcache projection build" in proc.stderr


@pytest.mark.slow
@pytest.mark.gpu
def test_bf16_on_gpu_trains_and_exports(tmp_path, toy_setup, kd_caches):
    run = run_stage2(tmp_path / "gpu", *flags(toy_setup, kd_caches, max_steps=6, zero_stage=3), "--bf16",
                     "--deterministic", cpu=False)
    assert run["summary"]["steps"] == 6 and run["summary"]["deterministic"] is True
    assert run["summary"]["final_eval_kl"] < run["eval"][0]["kl"]
