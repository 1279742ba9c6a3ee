"""Stage 2 on a real teacher cache: distillation beats CE-only on held-out KL to the teacher.

The caches are real: stage 1 (`xtcache teacher-dump --engine hf`) runs the toy teacher (a trained
tiny Qwen2) over the toy corpus and aligns the toy student's tokenizer; a held-out store of other
documents is the --eval-cache. Every training run is `python -m stage2_student` in a process of its own,
forked from the worker's warm process (tests/conftest.py `procs`); `run_stage2` starts a new interpreter
(under torchrun for several ranks) for the tests about a real launch.

    pytest -q tests/test_train_kd.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def cpu_env(cpu: bool = True) -> dict:
    """The environment of a stage 2 subprocess: launcher variables cleared, threads at 1; pinned to the
    CPU unless `cpu` is False, so that the suite's CPU invariances (bit-identical resume, world-size
    equivalence, 2 ranks on one host) hold on a GPU host too (rank 1 would find no second GPU there)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    if cpu:
        env.update(CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu")
    return env


def run_stage2(out: Path, *flags: str, nproc: int = 1, cpu: bool = True) -> dict:
    """`python -m stage2_student FLAGS` (under torchrun when nproc > 1), on the CPU unless `cpu` is
    False (GPU tests); returns summary and metrics."""
    cmd = [sys.executable, "-m", "stage2_student", "--out", str(out), *flags]
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               "-m", "stage2_student", "--out", str(out), *flags]
    proc = subprocess.run(cmd, cwd=REPO, env=cpu_env(cpu), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"summary": json.loads((out / "summary.json").read_text()),
            "train": [r for r in rows if r["kind"] == "train"], "eval": [r for r in rows if r["kind"] == "eval"]}


def common_flags(toy_setup, train: str, held: str, steps: int) -> list[str]:
    return ["--cache", train, "--eval-cache", held, "--student", str(toy_setup.student_model),
            "--seq-len", "64", "--micro-batch-size", "4", "--max-steps", str(steps), "--lr", "3e-3",
            "--warmup-steps", "2", "--eval-every", str(steps // 2), "--zero-stage", "2"]


@pytest.mark.slow
def test_projected_kl_beats_ce_only_on_heldout_kl(tmp_path, toy_setup, kd_caches, procs):
    train, held = kd_caches
    steps = 30
    kd = procs.run(tmp_path / "kd", *common_flags(toy_setup, train, held, steps), "--loss", "pkl",
                   "--kd-weight", "1.0", "--ce-weight", "0.1")
    ce = procs.run(tmp_path / "ce", *common_flags(toy_setup, train, held, steps), "--loss", "ce",
                   "--ce-weight", "1.0")
    start = kd["summary"]["first_eval"]
    assert start is not None
    first_kl = kd["eval"][0]["kl"]
    final_kd, final_ce = kd["summary"]["final_eval_kl"], ce["summary"]["final_eval_kl"]
    assert final_kd < 0.6 * first_kl, (first_kl, final_kd)
    assert final_kd < final_ce, (final_kd, final_ce)
    assert kd["summary"]["kd_loss"] == "pkl" and ce["summary"]["kd_loss"] is None
    assert kd["summary"]["objective"]["kind"] == "pkl" and kd["summary"]["objective"]["ce_weight"] == 0.1
    assert ce["summary"]["objective"] == {"kind": None, "ce_weight": 1.0}
    # the evaluation's KL is the same measure whatever the training loss, and says what it is
    assert kd["summary"]["eval_kl_definition"] == ce["summary"]["eval_kl_definition"]
    assert "lower bound" in kd["summary"]["eval_kl_definition"]
    assert kd["eval"][-1]["objective_kd_name"] == "pkl" and ce["eval"][-1]["objective_kd"] is None
    assert all(r["valid_share"] > 0.5 for r in kd["train"])
    assert kd["train"][-1]["top1_agree"] > kd["train"][0]["top1_agree"]
    # no --projection: both runs built the map from the two tokenizers; the summary says so and names it by content,
    # the digest of a map built here again from the tokenizer files
    from xtcache.projection import build_projection
    from xtcache.tokenizer import load_tokenizer

    again = build_projection(load_tokenizer(toy_setup.student_tokenizer), load_tokenizer(toy_setup.teacher_tokenizer))
    unreached = len(set(range(again.teacher_vocab_size)) - set(again.indices.ravel().tolist()))  # teacher ids W misses
    assert unreached > 0  # the toy student splits some of the toy teacher's tokens (docs/losses.md)
    for run in (kd, ce):
        assert run["summary"]["data"]["projections"] == [{"cache": train, "map": "built", "sha256": again.digest(),
                                                          "unreached_teacher_ids": unreached}]


def test_the_next_round_continues_the_corpus_stream_where_init_from_left_it(tmp_path, toy_setup, kd_caches, procs):
    """A mixed run (--corpus-cache) on two ranks started --init-from another mixed run's checkpoint over the same
    corpus cache (the next round of `xtcache rounds`) reads, on each rank, the corpus micro-batches after that
    run's, not its first ones again: each rank's saved corpus position counts both runs' corpus micro-batches of
    that rank (the stratified schedule's share of each rank); its rollout stream starts afresh."""
    from stage2_student.rollout_mix import draws_rollout

    train, held = kd_caches
    mix = ["--cache", held, "--corpus-cache", train, "--rollout-fraction", "0.5", "--student",
           str(toy_setup.student_model), "--seq-len", "64", "--micro-batch-size", "1", "--grad-accum", "3",
           "--lr", "1e-3", "--zero-stage", "1", "--seed", "5"]
    procs.run(tmp_path / "r0", *mix, "--max-steps", "2", nproc=2)
    procs.run(tmp_path / "r1", *mix, "--max-steps", "4", "--init-from", str(tmp_path / "r0/checkpoints/step2"),
              nproc=2)

    def loader(run: str, step: int, rank: int) -> dict:
        state = tmp_path / run / f"checkpoints/step{step}/trainer_state_rank{rank}.json"
        return json.loads(state.read_text())["loader"]

    for rank in (0, 1):  # each run: 2 steps x 3 micro-batches a rank
        corpus_batches = sum(not draws_rollout(5, j, 0.5, rank=rank, world_size=2) for j in range(6))
        assert corpus_batches in (2, 3, 4)
        first, second = loader("r0", 2, rank), loader("r1", 4, rank)
        assert first["corpus"]["consumed"] == corpus_batches
        assert second["corpus"]["consumed"] == 2 * corpus_batches, rank  # continued: not corpus_batches again
        assert second["rollouts"]["consumed"] == 6 - corpus_batches  # the new run's own rollouts from their start


def _first_step_on_the_corpus(toy_setup) -> list[str]:
    """train-student flags of one optimizer step of one micro-batch, at a seed whose mixed stream (rollout fraction
    0.5) reads that micro-batch from the corpus cache."""
    from stage2_student.rollout_mix import draws_rollout

    seed = next(s for s in range(64) if not draws_rollout(s, 0, 0.5))
    return ["--student", str(toy_setup.student_model), "--seq-len", "64", "--micro-batch-size", "1", "--max-steps",
            "1", "--lr", "1e-3", "--zero-stage", "1", "--seed", str(seed)]


def test_corpus_loss_auto_trains_the_corpus_micro_batches_with_train_students_defaults(tmp_path, toy_setup, kd_caches,
                                                                                       procs):
    """--corpus-loss auto: a corpus micro-batch trains train-student's off-policy defaults for that cache (across
    tokenizers the forward-reverse P-KL + 0.5 CE), whatever the run's loss flags, and a rollout micro-batch the
    run's objective. One micro-batch a step, the first from the corpus: from the same student, that step's loss
    under a JSD run equals the loss of a run whose own objective is the defaults, and differs under
    --corpus-loss kd (the JSD on the corpus too); its `corpus_kd` metric is that run's `kd`, and its `kd` (the
    rollouts', none this step) is not mixed with it. The summary records both objectives."""
    train, held = kd_caches
    mix = ["--cache", held, "--corpus-cache", train, "--rollout-fraction", "0.5", *_first_step_on_the_corpus(toy_setup)]
    jsd = ["--loss", "pkl", "--pkl-divergence", "jsd", "--ce-weight", "0.1"]
    auto = procs.run(tmp_path / "auto", *mix, *jsd, "--corpus-loss", "auto")
    kd = procs.run(tmp_path / "kd", *mix, *jsd, "--corpus-loss", "kd")
    defaults = procs.run(tmp_path / "defaults", *mix, "--corpus-loss", "kd")
    loss = {name: run["train"][0]["loss"] for name, run in (("auto", auto), ("kd", kd), ("defaults", defaults))}
    assert loss["auto"] == pytest.approx(loss["defaults"], rel=1e-6), loss
    assert abs(loss["auto"] - loss["kd"]) > 1e-3 * abs(loss["kd"]), loss
    # the step's metrics keep the objectives apart: its one micro-batch trained the corpus objective alone
    step = auto["train"][0]
    assert step["kd"] is None and step["kd_name"] == "pkl" and step["corpus_kd_name"] == "pkl"
    assert step["corpus_kd"] == pytest.approx(defaults["train"][0]["kd"], rel=1e-6)
    assert "corpus_kd" not in kd["train"][0] and kd["train"][0]["kd"] is not None
    corpus = auto["summary"]["corpus_objective"]
    assert {k: corpus.get(k) for k in ("kind", "ce_weight", "pkl_divergence", "pkl_reverse_weight")} == {
        "kind": "pkl", "ce_weight": 0.5, "pkl_divergence": "forward-reverse", "pkl_reverse_weight": 0.5}
    assert auto["summary"]["objective"]["pkl_divergence"] == "jsd" and auto["summary"]["objective"]["ce_weight"] == 0.1
    assert "corpus_objective" not in auto["summary"]["data"] and kd["summary"]["corpus_objective"] is None


def test_corpus_loss_ce_trains_the_corpus_micro_batches_as_loss_ce_trains_the_corpus_alone(tmp_path, toy_setup,
                                                                                          kd_caches, procs):
    """--corpus-loss ce: a corpus micro-batch trains CE alone at weight 1, whatever the run's loss flags. One
    micro-batch a step, the first from the corpus: that step's loss under a JSD + 0.1 CE run equals the first step
    of `--loss ce --ce-weight 1` on the corpus cache alone (a second construction: a run that never mixes)."""
    train, held = kd_caches
    run = _first_step_on_the_corpus(toy_setup)
    mixed = procs.run(tmp_path / "mixed", "--cache", held, "--corpus-cache", train, "--rollout-fraction", "0.5", *run,
                      "--loss", "pkl", "--pkl-divergence", "jsd", "--ce-weight", "0.1", "--corpus-loss", "ce")
    alone = procs.run(tmp_path / "alone", "--cache", train, *run, "--loss", "ce", "--ce-weight", "1")
    assert mixed["train"][0]["loss"] == pytest.approx(alone["train"][0]["loss"], rel=1e-6)
    assert mixed["summary"]["corpus_objective"] == {"kind": None, "ce_weight": 1.0}
