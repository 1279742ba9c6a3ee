"""`xtcache rounds`: two on-policy rounds end to end, cross-tokenizer and conversational (the Llama-3-style
student generates in its template, the ChatML teacher scores in its own).

- With `--engine vllm` for generate and teacher-dump (round 1 samples with vLLM from round 0's trained
  export): the rounds chain their policies and checkpoints, print their commands, and every round's
  cache is aligned and trains exactly the generated turn. CPU vLLM does not sample reproducibly, so
  this run is not compared bit for bit.
- With `--engine hf` (seeded: reproducible): a run failed in train-student (its --deepspeed file not JSON)
  and rerun with the file fixed keeps its finished stages; the driver killed with SIGKILL once in each stage and
  rerun resumes to the same final weights, bit for bit, as the stage commands it recorded
  (round-RRR/done/STAGE.json) replayed in order in another work directory without the driver, as
  they would run on separate clusters. The replay forks each command from the worker's warm process
  (tests/conftest.py `procs`: each still a process of its own, CPU-pinned like the driver's stages).

Cost (2 cores): the vLLM run is 1 prompt x 2 samples and 1 step a round, each stage on two processes (six
engine starts: each round's generate job 0, whose job 1 has no prompt and starts none, and both teacher-dump
jobs, with `--no-fast-path`, the teacher's own prompt log-probs, which needs no first-batch check engine; the
fast path and its check are tests/test_stage1_vllm.py's); the hf run is 3 prompts x 2 samples, 2 steps a round.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.commands import xtcache
from tests.test_train_kd import cpu_env
from xtcache.testing.suite import REPO

STEPS = 2


@pytest.fixture(scope="module")
def chat(toy_setup, tmp_path_factory):
    """(chat setup, prompts .jsonl): conversations cut after their last user message."""
    from xtcache.testing.chat import build_chat_setup, write_prompts

    root = tmp_path_factory.mktemp("rounds")
    setup = build_chat_setup(toy_setup, root / "chat", num_train=6, num_heldout=3, teacher_steps=0)
    return setup, write_prompts(setup.train_jsonl, root / "prompts.jsonl", range(3))


def _cmd(setup, prompts, workdir, *, engine: str = "hf", steps: int = STEPS, micro_batch: int = 2,
         dump_args: str = "", nproc: int = 1) -> list[str]:
    return [sys.executable, "-m", "xtcache.app.cli", "rounds", "--student", str(setup.student_model), "--teacher",
            str(setup.teacher_model), "--prompts", str(prompts), "--rounds", "2", "--workdir", str(workdir),
            "--engine", engine, *(["--dump-args", dump_args] if dump_args else []), "--samples-per-prompt", "2",
            "--max-new-tokens", "8", "--steps-per-round", str(steps), "--nproc-per-node", str(nproc),
            "--", "--seq-len", "64", "--micro-batch-size", str(micro_batch), "--zero-stage", "0", "--save-every", "1",
            "--lr", "1e-3"]


# a launcher's job index and process group in the driver's environment (a Slurm array running one rounds run per
# seed): a stage that read them would sample and score half the prompts, or wait for a second rank
LAUNCHED = {"SLURM_ARRAY_TASK_ID": "1", "SLURM_ARRAY_TASK_COUNT": "2", "RANK": "1", "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}


def _run(cmd, timeout: int = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=REPO, env=env or cpu_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _weights(workdir: Path) -> dict[str, bytes]:
    hf = workdir / "round-001" / "train" / "hf"
    return {p.name: p.read_bytes() for p in sorted(hf.glob("*.safetensors"))}


@pytest.fixture(scope="module")
def vllm_run(chat, tmp_path_factory):
    """Two rounds with vLLM generating and scoring (issue 26's test): 1 prompt x 2 samples, 1 step a round, each
    round's stages under torchrun on two processes (generate and teacher-dump two jobs, train-student two ranks
    with one sample each)."""
    setup, prompts = chat
    root = tmp_path_factory.mktemp("vllm")
    one = root / "prompt.jsonl"
    one.write_text(prompts.read_text().splitlines(keepends=True)[0])
    workdir = root / "w"
    proc = _run(_cmd(setup, one, workdir, engine="vllm", steps=1, micro_batch=1, dump_args="--no-fast-path",
                     nproc=2), timeout=1800)  # a hang guard
    return workdir, proc.stdout + proc.stderr


def test_two_rounds_chain_policies_checkpoints_and_print_their_commands(vllm_run):
    workdir, out = vllm_run
    steps = 1
    commands = (workdir / "commands.sh").read_text().splitlines()
    torchrun = "torchrun --standalone --nproc-per-node 2 -m"  # every stage on two processes
    assert all(c.startswith(f"{torchrun} xtcache.app.cli ") for c in commands[::3] + commands[1::3])
    assert [c.split()[6] for c in commands[::3] + commands[1::3]] == ["generate"] * 2 + ["teacher-dump"] * 2
    assert all(c.startswith(f"{torchrun} stage2_student --cache {workdir}/round-00{r}/cache ")
               for r, c in enumerate(commands[2::3]))
    for r in (0, 1):  # generate and teacher-dump ran as two jobs each (one prompt: job 0 samples it, job 1 none)
        for stage_out in ("rollouts", "cache"):
            assert sorted(p.name for p in (workdir / f"round-00{r}" / stage_out / "done").iterdir()) == [
                "w00000.json", "w00001.json"], (r, stage_out)
    assert all(f"$ {c}" in out for c in commands)
    assert sum("--engine vllm" in c for c in commands) == 4  # generate and teacher-dump, both rounds
    assert all(c.endswith("--no-fast-path") for c in commands if " teacher-dump " in c)
    assert f"--student {workdir}/round-000/train/hf" in commands[3]  # round 1 samples with round 0's export
    assert f"--init-from {workdir}/round-000/train/checkpoints/step{steps}" in commands[5]
    metrics = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert [m["round"] for m in metrics] == [0, 1]
    for r in (0, 1):  # the loss each round resolved, recorded beside its command (compared between rounds)
        objective = json.loads((workdir / f"round-{r:03d}" / "done" / "train-student.json").read_text())["objective"]
        assert (objective["kind"], objective["pkl_divergence"], objective["ce_weight"]) == ("pkl", "jsd", 0.1)
    assert [m["step"] for m in metrics] == [steps, 2 * steps] and all(m["train_steps"] == steps for m in metrics)
    assert all(m["rollouts"] == 2 and m["teacher_positions"] > 0 for m in metrics)
    assert metrics[0]["policy"] != metrics[1]["policy"]  # the second round's rollouts come from the trained student
    # one step a round: it reads its rollouts with the weights that sampled them, so the staleness metric
    # measures only the sampler's numerics (vLLM under --dtype auto: bfloat16 on this CPU, 0.058 measured)
    # against the trainer's float32, and no ratio passes the cap of 2
    for m in metrics:
        assert m["stale_mean_abs_log_ratio"] < 0.2 and m["stale_share_over_cap"] == 0.0, m
    assert "last step |log p/p_sampler|" in out
    assert "tokens scored" in out and "final student:" in out
    train1 = [json.loads(x) for x in (workdir / "round-001" / "train" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in train1 if r["kind"] == "train"] == [steps + 1]  # continued, not restarted
    for r in (0, 1):  # both rounds trained on two ranks
        summary = json.loads((workdir / f"round-00{r}" / "train" / "summary.json").read_text())
        assert summary["world_size"] == 2, summary


def test_vllm_rounds_are_aligned_and_train_exactly_the_generated_turn(vllm_run, chat):
    _assert_rounds_aligned(vllm_run[0], chat[0], rollouts=2)


def _assert_rounds_aligned(workdir: Path, setup, *, rollouts: int) -> None:
    """Each round's cache: inspect reports 0 misaligned characters, and the trained positions of every
    conversation are one run, exactly its generated turn (its end-of-turn token trained or not)."""
    from xtcache.app.store_commands import store_summary
    from xtcache.chat.render import chat_fingerprint, trained_roles
    from xtcache.store import CacheReader
    from xtcache.tokenizer import load_tokenizer

    tok = load_tokenizer(str(setup.student_model))
    fp = chat_fingerprint(tok)
    special = [i for i, t in tok.added_tokens_decoder.items() if t.special]
    for r in (0, 1):
        cache = workdir / f"round-{r:03d}" / "cache"
        inspect = xtcache("inspect", cache)
        assert inspect.returncode == 0 and "misaligned chars" in inspect.stdout, inspect.stderr[-2000:]
        assert store_summary(str(cache)).conversation[fp]["misaligned_chars"] == 0
        reader = CacheReader(str(cache))
        seen = 0
        for shard in reader.shards:
            al = reader.read_alignment(fp, shard.shard_id)
            convs = reader.read_shard(shard.shard_id).conversations
            for d, conv in enumerate(map(json.loads, convs)):
                a, b = int(al.doc_student_offsets[d]), int(al.doc_student_offsets[d + 1])
                ids, trained = al.student_ids[a:b], trained_roles(al.student_role[a:b], "last-assistant")
                first, end = int(np.argmax(trained)), len(trained) - int(np.argmax(trained[::-1]))
                prompt = tok.apply_chat_template(conv["messages"][:-1], tools=conv.get("tools"), tokenize=False,
                                                 add_generation_prompt=True)
                while first > 0 and int(ids[first - 1]) in special and tok.decode(ids[:first]) != prompt:
                    first -= 1  # a special token the student sampled first: kept where sampled, untrained
                assert tok.decode(ids[:first]) == prompt
                # one run of trained tokens, but for special tokens sampled inside it (kept, untrained)
                assert np.all(trained[first:end] | np.isin(ids[first:end], special))
                # the generated turn; its end-of-turn token is trained or not (not sampled: a 'length' stop),
                # and nothing else follows. Its text as the template renders it (trimmed), or, where the sampled
                # ids were spliced in, the message's own text with the whitespace the student sampled
                content = conv["messages"][-1]["content"]
                assert tok.decode(ids[first:end], skip_special_tokens=True) in (content.strip(), content)
                assert tok.decode(ids[first:], skip_special_tokens=True) in (content.strip(), content)
                seen += 1
        assert seen == rollouts


def _kill_when(cmd, workdir: Path, marker: str, env: dict) -> None:
    """Start the driver, SIGKILL it (the driver only: its stage dies with it) once `marker` exists."""
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while not (workdir / marker).exists():
            assert proc.poll() is None, f"the driver ended (exit {proc.returncode}) before {marker} appeared"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    assert proc.returncode == -signal.SIGKILL


@pytest.fixture(scope="module")
def killed_run(chat, tmp_path_factory):
    """The hf rounds with a --deepspeed file that is not JSON, the driver started inside a launcher's job
    (LAUNCHED): failed in round 0's train-student; then, the file fixed, killed three times, once in each stage,
    each time rerun with the same command: (work directory, the last rerun's output, the failed run's output)."""
    setup, prompts = chat
    root = tmp_path_factory.mktemp("killed")
    workdir, ds = root / "w", root / "ds.json"
    cmd, env = [*_cmd(setup, prompts, workdir), "--deepspeed", str(ds)], {**cpu_env(), **LAUNCHED}
    ds.write_text('{"zero_optimization": ')  # it exists, so the check before round 0 passes it
    failed = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert failed.returncode == 2, failed.stdout[-2000:] + failed.stderr[-3000:]
    ds.write_text("{}")
    # train-student once its first checkpoint is complete (train_config.json is written last: a driver killed
    # before that restarts the stage, with no --resume)
    for marker in ("round-000/train/checkpoints/step1/train_config.json",
                   "round-001/rollouts/manifest.json",  # generate, once it has started its output
                   "round-001/cache/manifest.json"):  # teacher-dump, likewise
        _kill_when(cmd, workdir, marker, env)
    assert not (workdir / "round-001" / "done" / "train-student.json").exists()
    return workdir, _run(cmd, env=env), failed


def test_driver_killed_in_each_stage_resumes_to_the_weights_of_its_commands_replayed(killed_run, procs, tmp_path):
    workdir, out, _ = killed_run
    commands = (workdir / "commands.sh").read_text().splitlines()
    resumed = [c.split()[1] for c in commands if "--resume" in c]
    assert {"generate", "teacher-dump", "train-student"} <= set(resumed), out.stderr[-2000:]
    # the launcher's variables are named once and reach no stage: every prompt sampled and scored (the aligned
    # test below), one process trained, and the weights are those of the commands replayed without them
    assert out.stderr.count("its environment leaves out SLURM_ARRAY_TASK_ID=1, SLURM_ARRAY_TASK_COUNT=2, RANK=1, "
                            "WORLD_SIZE=2, MASTER_ADDR=127.0.0.1, MASTER_PORT=1") == 1, out.stderr[-3000:]
    replay = tmp_path / "replay"
    replay.mkdir()
    for r in (0, 1):
        for stage in ("generate", "teacher-dump", "train-student"):
            recorded = json.loads((workdir / f"round-{r:03d}" / "done" / f"{stage}.json").read_text())["command"]
            assert recorded[0] == stage and "--resume" not in recorded
            args = [a.replace(str(workdir), str(replay)) for a in recorded]
            proc = procs.cli(*args)
            assert proc.returncode == 0, f"replayed {stage} of round {r}:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}"
    assert _weights(workdir) == _weights(replay) != {}


def test_each_round_cache_of_the_killed_run_is_aligned_and_trains_exactly_the_generated_turn(killed_run, chat):
    _assert_rounds_aligned(killed_run[0], chat[0], rollouts=6)


def test_rounds_on_text_prefixes_with_its_defaults_train_each_completion_and_no_prompt_token(chat, tmp_path):
    """`xtcache rounds` on text prefixes with no loss or --train-on flag: two rounds run end to end, each trains
    the cross-tokenizer default (the generalized JSD + 0.1 CE), and in each round's cache the trained tokens of
    every document are one run after its prefix, spelling the completion that generate wrote (prefix_chars)."""
    from xtcache.chat.render import trained_roles
    from xtcache.fingerprint import tokenizer_fingerprint
    from xtcache.store import CacheReader
    from xtcache.tokenizer import load_tokenizer

    setup, _ = chat
    prompts = tmp_path / "prefixes.jsonl"
    prompts.write_text("".join(json.dumps({"text": f"The cache stores {w} and"}) + "\n" for w in ("ids", "values")))
    workdir = tmp_path / "w"
    _run(_cmd(setup, prompts, workdir, steps=1))
    tok = load_tokenizer(str(setup.student_model))
    fp = tokenizer_fingerprint(tok)  # text: aligned for the tokenizer, not a chat template
    for r in (0, 1):
        done = json.loads((workdir / f"round-{r:03d}" / "done" / "train-student.json").read_text())
        assert done["command"][done["command"].index("--train-on") + 1] == "last-assistant"
        objective = done["objective"]
        assert (objective["kind"], objective["pkl_divergence"], objective["ce_weight"]) == ("pkl", "jsd", 0.1)
        rows = [json.loads(x) for f in sorted((workdir / f"round-{r:03d}" / "rollouts" / "parts").glob("*.jsonl"))
                for x in f.read_text().splitlines() if x.strip()]
        completions = {x["text"]: x["text"][x["prefix_chars"]:] for x in rows}
        reader = CacheReader(str(workdir / f"round-{r:03d}" / "cache"))
        seen = 0
        for shard in reader.shards:
            al = reader.read_alignment(fp, shard.shard_id)
            for d, text in enumerate(reader.read_shard(shard.shard_id).texts):
                a, b = int(al.doc_student_offsets[d]), int(al.doc_student_offsets[d + 1])
                ids, trained = al.student_ids[a:b], trained_roles(al.student_role[a:b], "last-assistant")
                first = int(np.argmax(trained))
                assert trained.any() and np.all(trained[first:]), (r, d)  # one run, to the end of the document
                assert tok.decode(ids[first:], skip_special_tokens=True) == completions[text], (r, d)
                assert completions[text] and text.endswith(completions[text])
                seen += 1
        assert seen == len(rows) == 4


def _cfg(tmp_path, **kw):
    from xtcache.app.rounds import RoundsConfig

    # loss auto: the default (forward) reads the student's and teacher's tokenizers, which S and T are not
    return RoundsConfig(**{"student": "S", "teacher": "T", "prompts": ["p.jsonl"], "rounds": 2, "loss": "auto",
                           "workdir": str(tmp_path / "w"), "engine": "hf", "train_on": "last-assistant", **kw})


def test_the_default_loss_is_the_measured_one_for_the_tokenizer_pair_and_the_prompts(chat, tmp_path):
    """Across tokenizers the generalized JSD + 0.1 CE (the forward P-KL on drawn caches); one tokenizer: the reverse
    KL without CE on conversations, the forward KL + 0.1 CE on text prefixes and on drawn caches (docs/on-policy.md)."""
    from xtcache.app.rounds import RoundsConfig, stage_command
    from xtcache.errors import ConfigError

    setup, prompts = chat
    text = tmp_path / "prefixes.jsonl"
    text.write_text(json.dumps({"text": "def main():\n"}) + "\n")

    def train(student: str, **kw) -> list[str]:
        cfg = RoundsConfig(**{"student": student, "teacher": str(setup.teacher_model), "prompts": [str(prompts)],
                              "workdir": str(tmp_path / "w"), **kw})
        return stage_command(cfg, 0, "train-student")

    def loss(command: list[str]) -> tuple[list[str], str]:
        at = command.index("--loss")
        return command[at:at + (4 if command[at + 1] == "pkl" else 2)], command[command.index("--ce-weight") + 1]

    cross = train(str(setup.student_model))
    assert loss(cross) == (["--loss", "pkl", "--pkl-divergence", "jsd"], "0.1")  # an anchor on its own samples
    assert loss(train(str(setup.student_model), prompts=[str(text)]))[0][-1] == "jsd"
    same = train(str(setup.teacher_model))  # a student on the teacher's own tokenizer, conversations
    assert loss(same) == (["--loss", "rkl"], "0.0") and "--pkl-divergence" not in same
    assert loss(train(str(setup.teacher_model), prompts=[str(text)])) == (["--loss", "kl"], "0.1")
    for drawn in ("--mode sampled --num-samples 8", "--mode=headtail"):  # the reverse needs top-k or full; the
        assert loss(train(str(setup.teacher_model), dump_args=drawn)) == (["--loss", "sampled"], "0.1")  # forward KL
    assert loss(train(str(setup.student_model), dump_args="--mode=sampled"))[0][-1] == "forward"  # P-KL of the draws
    named = train(str(setup.teacher_model), prompts=[str(text)], generate_args="--messages-field turns")
    assert loss(named) == (["--loss", "rkl"], "0.0")  # generate reads conversations from that field
    assert loss(train(str(setup.teacher_model), loss="forward")) == (["--loss", "kl"], "0.1")  # given: as given
    assert loss(train(str(setup.teacher_model), train_args=["--ce-weight", "0.5"]))[0] == ["--loss", "rkl"]
    assert train(str(setup.teacher_model), train_args=["--ce-weight", "0.5"]).count("--ce-weight") == 1
    with pytest.raises(ConfigError, match=r"^--prompts \S+missing.jsonl: no such file"):  # read for the choice
        train(str(setup.teacher_model), prompts=[str(tmp_path / "missing.jsonl")])
    reverse = train(str(setup.student_model), loss="reverse", train_args=["--ce-weight", "0"])
    assert reverse[reverse.index("--loss"):reverse.index("--loss") + 4] == ["--loss", "pkl", "--pkl-divergence",
                                                                            "reverse"]
    assert train(str(setup.teacher_model), loss="reverse")[same.index("--loss") + 1] == "rkl"
    given = train(str(setup.student_model), loss="pkl", train_args=["--pkl-divergence", "jsd"])
    assert given[given.index("--loss") + 1] == "pkl" and given.count("--pkl-divergence") == 1
    with pytest.raises(ValueError, match="--pkl-divergence: set by xtcache rounds"):
        RoundsConfig(student="S", teacher="T", prompts=["p"], workdir="w", train_args=["--pkl-divergence", "jsd"])
    with pytest.raises(ValueError, match=r"--loss reverse with --dump-args '--mode sampled': .*--loss forward \(the default"):
        RoundsConfig(student="S", teacher="T", prompts=["p"], workdir="w", loss="reverse",
                     dump_args="--mode sampled --num-samples 8")
    with pytest.raises(ValueError, match=r"--loss reverse with --dump-args '--mode sampled': "):
        RoundsConfig(student="S", teacher="T", prompts=["p"], workdir="w", loss="reverse", dump_args="--mode=sampled")


def test_loss_jsd_and_a_corpus_cache_give_train_student_the_measured_mix(chat, tmp_path):
    """`--loss jsd`: P-KL's jsd divergence across tokenizers, train-student's jsd with one; `--corpus-cache C`: the
    cache mixed in with --rollout-fraction 0.5 and --corpus-loss ce unless given after `--`, which may not name the
    cache itself (docs/on-policy.md)."""
    from xtcache.app.rounds import RoundsConfig, stage_command

    setup, prompts = chat

    def train(student: str, **kw) -> list[str]:
        cfg = RoundsConfig(**{"student": student, "teacher": str(setup.teacher_model), "prompts": [str(prompts)],
                              "workdir": str(tmp_path / "w"), **kw})
        return stage_command(cfg, 1, "train-student")

    def after(command: list[str], flag: str) -> list[str]:
        return [command[i + 1] for i, x in enumerate(command) if x == flag]

    cross = train(str(setup.student_model), loss="jsd", corpus_cache="C")
    assert after(cross, "--loss") == ["pkl"] and after(cross, "--pkl-divergence") == ["jsd"]
    assert after(cross, "--ce-weight") == ["0.1"]  # the rollouts' anchor, as with the forward KL
    assert after(cross, "--corpus-cache") == ["C"] and after(cross, "--rollout-fraction") == ["0.5"]
    assert after(cross, "--corpus-loss") == ["ce"]
    assert after(train(str(setup.teacher_model), loss="jsd"), "--loss") == ["jsd"]  # one tokenizer
    mine = train(str(setup.student_model), corpus_cache="C", train_args=["--rollout-fraction", "0.75", "--corpus-loss",
                                                                         "kd"])
    assert after(mine, "--rollout-fraction") == ["0.75"] and after(mine, "--corpus-loss") == ["kd"]  # given: as given
    plain = train(str(setup.student_model))
    assert not {"--corpus-cache", "--rollout-fraction", "--corpus-loss"} & set(plain)
    with pytest.raises(ValueError, match="--corpus-cache: set by xtcache rounds itself"):
        RoundsConfig(student="S", teacher="T", prompts=["p"], workdir="w", train_args=["--corpus-cache", "C"])
    with pytest.raises(ValueError, match=r"--loss jsd with --dump-args '--mode sampled': "):
        RoundsConfig(student="S", teacher="T", prompts=["p"], workdir="w", loss="jsd", dump_args="--mode sampled")


def test_a_work_directory_that_recorded_the_forward_default_is_refused_the_picked_loss_once_it_trained(chat, tmp_path):
    """Before rounds picked its loss, a work directory recorded --loss forward: a same-tokenizer run on conversations
    rerun without --loss would train the reverse KL, refused once a train-student has finished."""
    from xtcache.app.rounds import STAGES, RoundsConfig, check_settings
    from xtcache.errors import ConfigError

    setup, prompts = chat
    kw = {"student": str(setup.teacher_model), "teacher": str(setup.teacher_model), "prompts": [str(prompts)],
          "workdir": str(tmp_path / "w"), "engine": "hf"}
    old = RoundsConfig(**kw, loss="forward")
    check_settings(old)
    for stage in STAGES:
        _finish(old, 0, stage)
    with pytest.raises(ConfigError, match=r"--loss forward -> no --loss changes round 0 train-student, which has "
                                          r"finished .*Rerun with --loss forward to go on"):
        check_settings(RoundsConfig(**kw))
    check_settings(RoundsConfig(**kw, loss="forward"))


def test_teacher_dump_flags_of_every_round_and_the_check_trusted_after_round_0(tmp_path):
    from xtcache.app.rounds import stage_command

    cfg = _cfg(tmp_path, engine="vllm", dump_args="--top-k 32")
    first, later = stage_command(cfg, 0, "teacher-dump"), stage_command(cfg, 1, "teacher-dump")
    assert first[-2:] == later[-2:] == ["--top-k", "32"] and "--trust-check-from" not in first
    assert later[later.index("--trust-check-from") + 1] == str(tmp_path / "w" / "round-000" / "cache")
    no_check = stage_command(_cfg(tmp_path, engine="vllm", dump_args="--no-fast-path"), 1, "teacher-dump")
    assert "--trust-check-from" not in no_check  # no fast path: no first-batch check to trust
    with pytest.raises(ValueError, match="--out set by xtcache rounds"):
        _cfg(tmp_path, dump_args="--out elsewhere")


def test_generate_flags_of_every_round_and_the_ones_rounds_sets_itself_refused(tmp_path):
    from xtcache.app.rounds import stage_command

    cfg = _cfg(tmp_path, generate_args="--top-p 0.9 --dtype float32")
    for r in (0, 1):
        args = stage_command(cfg, r, "generate")
        assert args[-4:] == ["--top-p", "0.9", "--dtype", "float32"]
        assert args[args.index("--seed") + 1] == str(r)  # rounds' own flags stay where they were
    for flag in ("--seed=3", "--samples-per-prompt 8", "--num-shards 2", "--out x", "--no-resume", "--config g.yaml"):
        with pytest.raises(ValueError, match=rf"^--generate-args '{flag}': {flag.split()[0].split('=')[0]} set by "
                                             "xtcache rounds itself"):
            _cfg(tmp_path, generate_args=flag)


def test_a_workdir_refuses_other_settings_changed_outputs_and_owned_flags(killed_run, chat, tmp_path):
    import shutil

    from xtcache.app.rounds import check_settings, run_stage
    from xtcache.errors import ConfigError

    with pytest.raises(ValueError, match="--max-steps: set by xtcache rounds"):
        _cfg(tmp_path, train_args=["--max-steps", "9"])
    check_settings(_cfg(tmp_path))
    check_settings(_cfg(tmp_path, rounds=5))  # more rounds: the same work directory goes on
    setup, prompts = chat
    workdir = tmp_path / "copy"
    shutil.copytree(killed_run[0], workdir)
    cfg = _cfg(tmp_path, workdir=str(workdir), student=str(setup.student_model), teacher=str(setup.teacher_model),
               prompts=[str(prompts)], samples_per_prompt=2, max_new_tokens=8, steps_per_round=STEPS)
    with pytest.raises(ConfigError, match="round 0 generate was run as"):  # the record names the copied workdir
        run_stage(cfg, 0, "generate")


def _finish(cfg, r: int, stage: str) -> None:
    """A done record of round r's `stage` as run_stage writes it (its outputs' hashes are not read here)."""
    from xtcache.app.rounds import round_dir, stage_command

    done = round_dir(cfg, r) / "done" / f"{stage}.json"
    done.parent.mkdir(parents=True, exist_ok=True)
    done.write_text(json.dumps({"stage": stage, "round": r, "command": stage_command(cfg, r, stage), "outputs": {}}))
    (round_dir(cfg, r) / {"generate": "rollouts", "teacher-dump": "cache", "train-student": "train"}[stage]).mkdir()


def test_a_rerun_may_change_the_settings_of_unfinished_stages_and_a_refusal_names_the_setting_and_way_out(tmp_path, caplog):
    import shutil

    from xtcache.app.rounds import check_settings
    from xtcache.errors import ConfigError

    cfg = _cfg(tmp_path, max_new_tokens=8, train_args=["--lr", "-1"])
    check_settings(cfg)
    for stage in ("generate", "teacher-dump"):  # round 0 failed in train-student
        _finish(cfg, 0, stage)
    check_settings(_cfg(tmp_path, max_new_tokens=8, train_args=["--lr", "1e-3"]))  # the fixed flag: unfinished stage
    check_settings(_cfg(tmp_path, max_new_tokens=8, train_args=["--lr", "1e-3"], steps_per_round=7))
    with pytest.raises(ConfigError) as refused:
        check_settings(_cfg(tmp_path, max_new_tokens=9, train_args=["--lr", "1e-3"]))
    message = str(refused.value)
    w = tmp_path / "w" / "round-000"
    assert "--max-new-tokens 8 -> --max-new-tokens 9 changes round 0 generate, which has finished" in message
    assert "Rerun with --max-new-tokens 8 to go on" in message and "--lr" not in message
    removed = message.split("rm -r ", 1)[1].split(";")[0].split()
    assert removed == [str(w / "rollouts"), str(w / "done" / "generate.json"), str(w / "cache"),
                       str(w / "done" / "teacher-dump.json")]
    for path in map(Path, removed):  # the way out it gives: then the new setting is taken
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    check_settings(_cfg(tmp_path, max_new_tokens=9, train_args=["--lr", "1e-3"]))
    assert json.loads((tmp_path / "w" / "rounds.json").read_text())["max_new_tokens"] == 9
    for stage in ("generate", "teacher-dump"):
        _finish(_cfg(tmp_path, max_new_tokens=9), 0, stage)
    with pytest.raises(ConfigError, match=r"^--workdir \S+: no --dump-args -> --dump-args '--top-k 8' changes round 0 "
                                          r"teacher-dump, which has finished"):
        check_settings(_cfg(tmp_path, max_new_tokens=9, train_args=["--lr", "1e-3"], dump_args="--top-k 8"))
    with pytest.raises(ConfigError, match=r"^--workdir \S+: no --generate-args -> --generate-args '--top-p 0.9' "
                                          r"changes round 0 generate, which has finished"):
        check_settings(_cfg(tmp_path, max_new_tokens=9, train_args=["--lr", "1e-3"], generate_args="--top-p 0.9"))
    settings = tmp_path / "w" / "rounds.json"  # as an xtcache without --generate-args recorded it: no change
    settings.write_text(json.dumps({k: v for k, v in json.loads(settings.read_text()).items() if k != "generate_args"}))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="xtcache.app.rounds"):
        check_settings(_cfg(tmp_path, max_new_tokens=9, train_args=["--lr", "1e-3"]))
    assert "settings changed" not in caplog.text


def test_a_stage_started_with_other_settings_starts_again_from_nothing(tmp_path):
    from xtcache.app.rounds import restart_if_changed, round_dir, stage_command

    cfg, fixed = _cfg(tmp_path, train_args=["--lr", "-1"]), _cfg(tmp_path, train_args=["--lr", "1e-3"])
    train = round_dir(cfg, 0) / "train"
    restart_if_changed(cfg, 0, "train-student", stage_command(cfg, 0, "train-student"))
    (train / "checkpoints" / "step1").mkdir(parents=True)
    restart_if_changed(cfg, 0, "train-student", stage_command(cfg, 0, "train-student"))
    assert train.exists()  # the same command: resumed from what it left
    restart_if_changed(fixed, 0, "train-student", stage_command(fixed, 0, "train-student"))
    assert not train.exists()  # another command: its output would mix both settings
    started = json.loads((round_dir(cfg, 0) / "started" / "train-student.json").read_text())
    assert started["command"] == stage_command(fixed, 0, "train-student")


def test_a_round_resolving_another_loss_from_the_same_settings_is_refused_naming_the_change_and_way_out(tmp_path):
    """An xtcache upgrade between runs of one work directory may change a default that the same command resolves:
    the later round's recorded objective differs from the earlier one's, and the driver stops naming both."""
    from xtcache.app.rounds import check_objective, loss_settings, round_dir
    from xtcache.errors import ConfigError

    cfg = _cfg(tmp_path, rounds=3)

    def done(r: int, objective: dict | None, c=cfg) -> dict:
        record = {"stage": "train-student", "round": r, "command": [], "outputs": {}, "objective": objective,
                  "loss_settings": loss_settings(c)}
        path = round_dir(cfg, r) / "done" / "train-student.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record))
        (round_dir(cfg, r) / "train").mkdir(exist_ok=True)
        return record

    was = {"kind": "pkl", "ce_weight": 0.5, "pkl_divergence": "forward-reverse", "pkl_reverse_weight": 0.5}
    done(0, was)
    check_objective(cfg, 1, done(1, was))  # the same loss: goes on
    now = {**was, "pkl_reverse_weight": 0.75}
    with pytest.raises(ConfigError) as refused:
        check_objective(cfg, 2, done(2, now))
    message, d = str(refused.value), round_dir(cfg, 2)
    assert message.startswith("round 2 train-student resolved another loss than round 0 from the same settings "
                              "(pkl_reverse_weight 0.5 -> 0.75): the xtcache that ran round 0 filled in other defaults")
    redo = f"{d / 'train'} {d / 'done' / 'train-student.json'}"
    assert f"Finish the run with that xtcache (after rm -r {redo})" in message
    assert message.endswith("in another --workdir with `-- --pkl-reverse-weight 0.5` among the flags after -- to train "
                            "as round 0 did")
    # the flags after -- changed on purpose for the later rounds (allowed while they had not run): not compared
    pinned = _cfg(tmp_path, rounds=3, train_args=["--pkl-reverse-weight", "0.75"])
    check_objective(pinned, 2, done(2, now, pinned))
    check_objective(cfg, 2, done(2, None))  # a round of an xtcache that recorded no objective: nothing to compare
    done(0, None)  # an earlier round without one is passed over: round 1 is compared
    with pytest.raises(ConfigError, match="^round 2 train-student resolved another loss than round 1 "):
        check_objective(cfg, 2, done(2, now))


def test_each_stage_on_several_processes_is_recorded_as_its_torchrun_command_and_checked_like_one(tmp_path,
                                                                                              monkeypatch, caplog):
    """--nproc-per-node N: each stage's command is torchrun's with the stage's own flags (checked before anything
    runs as those of one process are): generate N jobs, teacher-dump N / TP jobs, train-student N ranks; an N that
    TP does not divide is refused; the process count is part of the finished stages' settings."""
    from xtcache.app import rounds
    from xtcache.errors import ConfigError

    monkeypatch.setattr(rounds, "cuda_device_count", lambda: 0)  # this CPU machine, also on a host with a GPU
    with pytest.raises(ValueError, match="--nproc-per-node 0: must be at least 1"):
        _cfg(tmp_path, nproc_per_node=0)
    with pytest.raises(ValueError, match="--nproc-per-node 3 with --dump-args '--tensor-parallel-size 2': teacher-dump "
                                         "runs N / TP jobs of TP GPUs each; give an N that TP divides"):
        _cfg(tmp_path, nproc_per_node=3, dump_args="--tensor-parallel-size 2")
    with pytest.raises(ValueError, match="--tensor-parallel-size x: give a whole number"):
        _cfg(tmp_path, dump_args="--tensor-parallel-size=x")
    one, two = _cfg(tmp_path), _cfg(tmp_path, nproc_per_node=2)
    launch = ["torchrun", "--standalone", "--nproc-per-node"]
    for stage in rounds.STAGES:
        flags = rounds.stage_command(one, 1, stage)
        module = ["stage2_student"] if stage == "train-student" else ["xtcache.app.cli", stage]
        assert rounds.stage_command(two, 1, stage) == [*launch, "2", "-m", *module, *flags[1:]]
        assert rounds.stage_flags(rounds.stage_command(two, 1, stage)) == rounds.stage_flags(flags) == flags[1:]
    tp = {"dump_args": "--tensor-parallel-size 2"}  # teacher-dump: N / TP jobs, TP GPUs each
    assert rounds.stage_command(_cfg(tmp_path, nproc_per_node=2, **tp), 1, "teacher-dump")[0] == "teacher-dump"
    assert rounds.stage_command(_cfg(tmp_path, nproc_per_node=4, **tp), 1, "teacher-dump")[:4] == [*launch, "2"]
    for d in ("S", "T"):
        (tmp_path / d).mkdir()
    (tmp_path / "p.jsonl").write_text("")
    base = {"student": str(tmp_path / "S"), "teacher": str(tmp_path / "T"), "prompts": [str(tmp_path / "p.jsonl")],
            "nproc_per_node": 2}
    with caplog.at_level(logging.WARNING, logger="xtcache.app.rounds"):
        rounds.check_commands(_cfg(tmp_path, **base, train_args=["--lr", "1e-4"]))
    assert "--nproc-per-node 2 on a machine without GPUs: each stage's 2 processes share its CPU cores" in caplog.text
    with pytest.raises(ConfigError, match=r"^round 0 train-student would be refused: --lr -1.0: must be positive"):
        rounds.check_commands(_cfg(tmp_path, **base, train_args=["--lr", "-1"]))
    monkeypatch.setattr(rounds, "cuda_device_count", lambda: 1)  # a one-GPU machine: one process per GPU
    with pytest.raises(ConfigError, match=r"^--nproc-per-node 2: this machine shows 1 GPUs, one for each "
                                          r"process of a stage .*; nothing has run$"):
        rounds.check_commands(_cfg(tmp_path, **base))
    rounds.check_settings(one)
    for stage in rounds.STAGES:
        _finish(one, 0, stage)
    with pytest.raises(ConfigError, match=r"^--workdir \S+: --nproc-per-node 1 -> --nproc-per-node 2 changes round 0 "
                                          r"generate, which has finished"):
        rounds.check_settings(two)
    settings = tmp_path / "w" / "rounds.json"  # as an xtcache before the option recorded it: one process, no change
    settings.write_text(json.dumps({k: v for k, v in json.loads(settings.read_text()).items() if k != "nproc_per_node"}))
    with caplog.at_level(logging.INFO, logger="xtcache.app.rounds"):
        rounds.check_settings(one)
    assert "settings changed" not in caplog.text


FAKE_RANK = """import os, pathlib, sys, time
pid = pathlib.Path(sys.argv[sys.argv.index("--out") + 1], f"rank{os.environ['RANK']}.pid")
pid.with_suffix(".tmp").write_text(str(os.getpid()))
pid.with_suffix(".tmp").rename(pid)  # whole or absent: the test reads it as soon as it appears
time.sleep(600)
"""


@pytest.mark.parametrize("launcher_too", [False, True], ids=["driver", "driver-and-torchrun"])
def test_a_killed_driver_leaves_no_torchrun_rank_running(tmp_path, launcher_too):
    """The driver killed with SIGKILL while torchrun runs train-student's ranks: torchrun and both ranks end (here
    each rank is a stand-in `stage2_student` that records its pid and sleeps). Killed alone, torchrun stops its
    ranks (SIGTERM on the driver's death); killed with torchrun, the ranks are left to xtcache's process watcher."""
    import psutil

    fake = tmp_path / "fake" / "stage2_student"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "__main__.py").write_text(FAKE_RANK)
    out = tmp_path / "train"
    out.mkdir()
    driver = ("import sys; from xtcache.app.rounds import RoundsConfig, run_xtcache; "
              f"cfg = RoundsConfig(student='S', teacher='T', prompts=['p'], workdir={str(tmp_path)!r}, loss='auto'); "
              f"run_xtcache(cfg, ['torchrun', '--standalone', '--nproc-per-node', '2', '-m', 'stage2_student', "
              f"'--out', {str(out)!r}])")
    env = {**cpu_env(), "PYTHONPATH": f"{fake.parent}{os.pathsep}{REPO}"}
    proc = subprocess.Popen([sys.executable, "-c", driver], cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while len(list(out.glob("rank*.pid"))) < 2:
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            assert time.time() < deadline, "torchrun's ranks did not start"
            time.sleep(0.1)
        ranks = [psutil.Process(int(p.read_text())) for p in sorted(out.glob("rank*.pid"))]
        launcher = ranks[0].parent()
        assert "torch.distributed.run" in " ".join(launcher.cmdline()) and launcher.parent().pid == proc.pid
        time.sleep(1.0)  # the driver's watcher registers new descendants twice a second
        if launcher_too:
            launcher.kill()
    finally:  # also when an assertion above fails: a driver left running would wait out its ranks' sleep
        proc.kill()
        proc.wait()
    _, alive = psutil.wait_procs([launcher, *ranks], timeout=30)
    assert not alive, [p.cmdline() for p in alive]
    assert (tmp_path / "commands.sh").read_text() == (
        f"torchrun --standalone --nproc-per-node 2 -m stage2_student --out {out}\n")


def test_every_rounds_commands_are_built_before_anything_runs_and_a_refusal_names_round_stage_and_flag(tmp_path):
    """A typo or a refused value after `--`, in --generate-args or --dump-args, or a path they name that is missing, fails the
    run before round 0's generate, naming the round, the stage, the flag and where it came from; the paths
    the rounds write themselves (the work directory's) are not required to exist yet."""
    from xtcache.app.rounds import check_commands, run_rounds
    from xtcache.errors import ConfigError

    for d in ("S", "T"):
        (tmp_path / d).mkdir()
    (tmp_path / "p.jsonl").write_text("")
    base = {"student": str(tmp_path / "S"), "teacher": str(tmp_path / "T"), "prompts": [str(tmp_path / "p.jsonl")]}
    check_commands(_cfg(tmp_path, **base, train_args=["--lr", "1e-4"], dump_args="--top-k 8"))  # all well
    refused = [
        ({"train_args": ["--lr", "-1"]}, "round 0 train-student would be refused: --lr -1.0: must be positive "
                                          "(from xtcache rounds' own options or the flags after --); nothing has run"),
        ({"corpus_cache": str(tmp_path / "corpus")}, "round 0 train-student would be refused: --corpus-cache "
                                                     f"{tmp_path / 'corpus'}: no such directory"),
        ({"train_args": ["--lrr", "1e-4"]}, "round 0 train-student would be refused: No such option: --lrr"),
        ({"dump_args": "--top-k 0"}, "round 0 teacher-dump would be refused: --top-k 0: must be at least 1 "
                                     "(from --dump-args)"),
        ({"train_args": ["--deepspeed", str(tmp_path / "ds.json")]},
         f"round 0 train-student would be refused: --deepspeed {tmp_path / 'ds.json'}: no such file"),
        ({"max_new_tokens": 0}, "round 0 generate would be refused: --max-new-tokens 0"),
        ({"generate_args": "--top-p 1.5"}, "round 0 generate would be refused: --top-p 1.5: must be in (0, 1] (from "
                                           "xtcache rounds' own options or --generate-args)"),
    ]
    for kw, says in refused:
        cfg = _cfg(tmp_path, **{**base, **kw})
        with pytest.raises(ConfigError) as err:
            run_rounds(cfg)
        assert str(err.value).startswith(says), str(err.value)
        assert not (tmp_path / "w").exists()  # nothing ran, nothing was recorded


def test_a_plan_too_small_for_one_optimizer_step_is_refused_before_round_0_and_one_just_big_enough_is_not(
        chat, tmp_path, monkeypatch):
    """Issue 38: rollouts that cannot fill one optimizer step of train-student (--micro-batch-size x ranks x
    --grad-accum windows of --seq-len) fail the run before round 0's generate, naming the flags. Each rollout makes
    at most one window here: only its generated turn trains (--train-on last-assistant), and the turn fits in a
    window less its context share; a corpus cache mixed in does not lower what the rollouts must fill. A plan that
    might fill a step (enough rollouts, or ones that may make several windows each) is not refused."""
    from xtcache.app import rounds
    from xtcache.errors import ConfigError

    setup, prompts = chat
    one = tmp_path / "prompt.jsonl"
    one.write_text(prompts.read_text().splitlines(keepends=True)[0])
    corpus = tmp_path / "corpus"
    corpus.mkdir()

    def plan(samples: int, *train_args: str, **kw) -> rounds.RoundsConfig:
        return rounds.RoundsConfig(**{"student": str(setup.student_model), "teacher": str(setup.teacher_model),
                                      "prompts": [str(one)], "workdir": str(tmp_path / "w"), "engine": "hf",
                                      "samples_per_prompt": samples, "max_new_tokens": 8,
                                      "train_args": ["--seq-len", "64", *train_args], **kw})

    monkeypatch.setattr(rounds, "cuda_device_count", lambda: 0)  # --nproc-per-node 2 on this CPU machine
    refused = [
        (plan(1, "--micro-batch-size", "2"), "1 prompt(s) x --samples-per-prompt 1 give at most 1 rollouts, at most "
                                             "one window of --seq-len 64 each (--max-new-tokens 8), and train-student "
                                             "needs 2 windows for one optimizer step (--micro-batch-size 2 x "
                                             "--nproc-per-node 1 x --grad-accum 1)"),
        (plan(2, "--micro-batch-size", "1", "--grad-accum", "3"), "needs 3 windows"),
        (plan(1, "--micro-batch-size", "1", nproc_per_node=2), "(--micro-batch-size 1 x --nproc-per-node 2 x"),
        (plan(1, "--micro-batch-size", "2", corpus_cache=str(corpus)), "needs 2 windows"),
    ]
    for cfg, says in refused:
        with pytest.raises(ConfigError) as err:
            rounds.run_rounds(cfg)
        assert says in str(err.value) and str(err.value).endswith("nothing has run"), str(err.value)
        assert "--samples-per-prompt" in str(err.value) and "--micro-batch-size" in str(err.value)
        assert not (tmp_path / "w").exists()  # no stage ran, nothing was recorded
    for cfg in (plan(2, "--micro-batch-size", "2"),  # just big enough: 2 rollouts, one window each
                plan(1, "--micro-batch-size", "2", "--seq-len", "16"),  # the turn may span two windows of 16
                plan(1, "--micro-batch-size", "2", train_on="all")):  # the prompt is longer than a window: unbounded
        rounds.check_commands(cfg)


def test_a_plain_text_corpus_cache_without_token_roles_is_refused_before_round_0_under_train_on_by_role(
        toy_setup, two_doc_store, chat, tmp_path):
    """--train-on last-assistant (rounds' default) with a --corpus-cache of plain text, whose parts keep no token
    roles (a teacher-dump of a text corpus), fails the run before round 0's generate, naming both flags, as
    train-student's loader would after round 0's teacher-dump (`stage2_student.loader.check_token_roles`); a
    conversation corpus cache, or --train-on all, is not refused."""
    from tests.commands import xtcache
    from xtcache.app.rounds import RoundsConfig, check_commands, run_rounds
    from xtcache.errors import ConfigError

    def plan(setup, prompts: Path, corpus, **kw) -> RoundsConfig:
        return RoundsConfig(student=str(setup.student_model), teacher=str(setup.teacher_model), prompts=[str(prompts)],
                            workdir=str(tmp_path / "w"), engine="hf", max_new_tokens=8, corpus_cache=str(corpus),
                            train_args=["--seq-len", "64", "--micro-batch-size", "1"], **kw)

    text = tmp_path / "text.jsonl"
    text.write_text("".join(toy_setup.train_jsonl.read_text().splitlines(keepends=True)[:2]))
    with pytest.raises(ConfigError) as err:
        run_rounds(plan(toy_setup, text, two_doc_store))
    says = str(err.value)
    assert says.startswith(f"round 0 train-student would be refused: --train-on last-assistant: --corpus-cache "
                           f"{two_doc_store} holds plain text whose part ") and "keeps no token roles" in says, says
    assert says.endswith("; nothing has run") and "\n" not in says
    assert not (tmp_path / "w").exists()  # no stage ran, nothing was recorded
    check_commands(plan(toy_setup, text, two_doc_store, train_on="all"))

    setup, prompts = chat
    conversations = tmp_path / "conversations"
    dump = xtcache("teacher-dump", "--teacher", setup.teacher_model, "--student-tokenizer", setup.student_tokenizer,
                   "--data", setup.train_jsonl, "--out", conversations, "--engine", "hf", "--top-k", "8")
    assert dump.returncode == 0, dump.stderr[-3000:]
    check_commands(plan(setup, prompts, conversations))


def test_a_run_failed_in_train_student_reruns_after_the_fix(killed_run):
    """The failure's advice holds: a train-student stage that fails at run time (the killed run's --deepspeed
    file, not JSON at first) fails the run with train-student's one-line error and the advice; the reruns with
    the file fixed keep round 0's finished generate and teacher-dump and train."""
    workdir, _, failed = killed_run
    ds = workdir.parent / "ds.json"
    assert failed.returncode == 2 and f"--deepspeed {ds}: not JSON" in failed.stderr, failed.stderr[-3000:]
    assert "fix the cause and rerun xtcache rounds" in failed.stderr
    round0 = [c.split()[1] for c in (workdir / "commands.sh").read_text().splitlines()
              if f"--out {workdir}/round-000/" in c]
    # failed; rerun with the file fixed and killed at its first checkpoint; resumed by the next rerun
    assert round0 == ["generate", "teacher-dump", "train-student", "train-student", "train-student"], round0
    assert (workdir / "round-000" / "done" / "train-student.json").exists()


def test_a_stage_reads_no_launcher_job_index_or_process_group_from_the_driver_environment():
    from stage1_teacher.shard_plan import launcher_index
    from xtcache.app.rounds import stage_env

    launched = {**os.environ, **LAUNCHED, "JOB_COMPLETION_INDEX": "3", "LOCAL_RANK": "1"}
    assert launcher_index(None, None, launched)[:2] == (1, 2)  # what teacher-dump and generate read from it
    env = stage_env(launched)
    assert launcher_index(None, None, env)[:2] == (0, 1)
    assert not {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "JOB_COMPLETION_INDEX"} & set(env)
    assert env["PYTHONUNBUFFERED"] == "1" and env["PATH"] == os.environ["PATH"]
