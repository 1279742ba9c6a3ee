"""`xtcache generate`: rollouts that teacher-dump reads as a corpus, reproducible with --engine hf,
resumable after SIGKILL, split across jobs without overlap, keyed by the policy that wrote them.

The student is the chat toy setup's Llama (a Llama-3-style template), untrained: what it writes is
noise, which is all these tests need.

One `xtcache generate` process, forked from a warm process that imported torch and transformers once
(`tests.commands.WarmProcs`), writes the reference rollouts (module fixture); the other runs call the
same entry point in the test process (`tests.commands.xtcache`), so a reproducibility check compares two
processes. The SIGKILL test kills a real process (a new interpreter), and an empty prompt file is
refused by a process of its own (forked from the warm one).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.commands import WarmProcs, xtcache
from xtcache.testing.suite import REPO

MAX_NEW = "12"
GENERATE_MODULES = ("torch", "transformers", "xtcache.app.cli", "stage1_teacher.cli", "stage1_teacher.onpolicy.generate",
                    "stage1_teacher.onpolicy.samplers")


@pytest.fixture(scope="module")
def procs():
    """`xtcache generate` processes forked from one warm process, in this process's environment."""
    with WarmProcs(env=dict(os.environ), modules=GENERATE_MODULES) as server:
        yield server


@pytest.fixture(scope="module")
def chat(toy_setup, procs, tmp_path_factory):
    """(chat setup, conversation prompts .jsonl, text prompts .jsonl); held-out prompts in heldout.jsonl.
    The warm process server (`procs`) imports meanwhile."""
    from xtcache.testing.chat import build_chat_setup, write_prompts

    root = tmp_path_factory.mktemp("gen")
    setup = build_chat_setup(toy_setup, root / "chat", num_train=6, num_heldout=3, teacher_steps=0)
    for src, name in ((setup.train_jsonl, "prompts.jsonl"), (setup.heldout_jsonl, "heldout.jsonl")):
        write_prompts(src, root / name)
    conv = root / "prompts.jsonl"
    text = root / "prefixes.jsonl"
    text.write_text("".join(json.dumps({"text": f"The cache stores {w} and"}) + "\n" for w in ("ids", "log-probs", "x")))
    return setup, conv, text


def _generate(setup, data, out, *extra, check=True, procs: WarmProcs | None = None) -> subprocess.CompletedProcess:
    """`xtcache generate` in this process, or in a process of its own forked from `procs`."""
    args = ["generate", "--student", str(setup.student_model), "--data", str(data), "--out", str(out), "--engine", "hf",
            "--samples-per-prompt", "2", "--max-new-tokens", MAX_NEW, "--prompts-per-part", "2", *extra]
    proc = procs.cli(*args) if procs is not None else xtcache(*args)
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def whole(chat, procs, tmp_path_factory) -> Path:
    """The conversation prompts' rollouts, written by one uninterrupted `xtcache generate` process (seed 0)."""
    setup, conv, _ = chat
    out = tmp_path_factory.mktemp("whole") / "r"
    _generate(setup, conv, out, procs=procs)
    return out


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for p in sorted((out / "parts").glob("*.jsonl")) for line in p.read_text().splitlines()]


def _parts(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((out / "parts").glob("*.jsonl"))}


def test_rollouts_are_a_conversation_corpus_for_teacher_dump(chat, whole, tmp_path):
    from xtcache.tokenizer import load_tokenizer

    setup, conv, _ = chat
    rows = _rows(whole)
    prompts = [json.loads(line) for line in conv.read_text().splitlines()]
    assert len(rows) == 2 * len(prompts)
    tok = load_tokenizer(setup.student_model)
    manifest = json.loads((whole / "manifest.json").read_text())
    for i, row in enumerate(rows):
        prompt = prompts[i // 2]
        assert row["messages"][:-1] == prompt["messages"] and row["messages"][-1]["role"] == "assistant"
        assert row["sample"] == i % 2 and row["policy"] == manifest["policy"]
        assert row["stop_reason"] in ("stop", "length")
        assert len(row["sampled_ids"]) == len(row["sampled_logprobs"]) <= int(MAX_NEW)
        assert all(lp <= 0 for lp in row["sampled_logprobs"])
        rendered = tok.apply_chat_template(prompt["messages"], tools=prompt.get("tools"), tokenize=False,
                                           add_generation_prompt=True)
        assert row["prompt_token_ids"] == tok(rendered, add_special_tokens=False)["input_ids"]
        body = row["sampled_ids"][:-1] if row["stop_reason"] == "stop" else row["sampled_ids"]
        assert row["messages"][-1]["content"] == tok.decode(body, skip_special_tokens=True)
    assert rows[0]["prompt_id"] != rows[2]["prompt_id"] and rows[0]["prompt_id"] == rows[1]["prompt_id"]
    dump = xtcache("teacher-dump", "--teacher", setup.teacher_model, "--student-tokenizer", setup.student_tokenizer,
                   "--data", whole / "parts" / "*.jsonl", "--out", tmp_path / "store", "--engine", "hf", "--top-k", "8")
    assert dump.returncode == 0, dump.stderr[-3000:]
    assert f"documents           {len(rows)} in" in dump.stdout and "skipped documents   none" in dump.stdout
    store = json.loads((tmp_path / "store" / "manifest.json").read_text())
    assert store["settings"]["conversation"]["messages_field"] == "messages"


def test_text_prefixes(chat, tmp_path):
    setup, _, text = chat
    _generate(setup, text, tmp_path / "r")
    rows = _rows(tmp_path / "r")
    prefixes = [json.loads(line)["text"] for line in text.read_text().splitlines()]
    assert len(rows) == 6
    for i, row in enumerate(rows):
        assert row["prefix_chars"] == len(prefixes[i // 2]) and row["text"].startswith(prefixes[i // 2])
        assert "messages" not in row


def test_same_seed_same_rollouts_other_seed_other(chat, whole, tmp_path):
    setup, conv, _ = chat
    _generate(setup, conv, tmp_path / "b")  # in this process: another interpreter than the fixture's
    _generate(setup, conv, tmp_path / "c", "--seed", "1")
    assert _parts(whole) == _parts(tmp_path / "b")
    ids = lambda out: [r["sampled_ids"] for r in _rows(out)]  # noqa: E731
    assert sum(x != y for x, y in zip(ids(whole), ids(tmp_path / "c"))) >= len(ids(whole)) // 2



def test_the_prompt_files_base_name_seeds_the_draws(chat, whole, procs, tmp_path):
    """A prompt id is `file:row:text hash`: the same prompts copied under another base name draw other samples at the
    same seed, and under the same base name in another directory the same ones (docs/on-policy.md)."""
    setup, conv, _ = chat
    (tmp_path / "elsewhere").mkdir()
    same_name, other_name = tmp_path / "elsewhere" / conv.name, tmp_path / "renamed.jsonl"
    for copy in (same_name, other_name):
        copy.write_bytes(conv.read_bytes())
    _generate(setup, same_name, tmp_path / "same", procs=procs)
    _generate(setup, other_name, tmp_path / "other", procs=procs)
    ids = lambda out: [r["sampled_ids"] for r in _rows(out)]  # noqa: E731
    assert ids(tmp_path / "same") == ids(whole)
    assert sum(x != y for x, y in zip(ids(whole), ids(tmp_path / "other"))) >= len(ids(whole)) // 2

KILLER = r"""
import os, signal, sys
import stage1_teacher.onpolicy.generate as g
from stage1_teacher.onpolicy.generate_config import build_generate_config
real, calls = g.write_part, [0]
def write_part(loc, rel, rows):
    sha = real(loc, rel, rows)
    calls[0] += 1
    if calls[0] == 2:  # the second part is on disk, not yet in the index
        os.kill(os.getpid(), signal.SIGKILL)
    return sha
g.write_part = write_part
g.run_generate(build_generate_config(dict(student=sys.argv[1], data=[sys.argv[2]], out=sys.argv[3], engine="hf",
               samples_per_prompt=2, max_new_tokens=int(sys.argv[4]), prompts_per_part=2)))
"""


def test_sigkill_then_resume_equals_uninterrupted(chat, whole, tmp_path):
    setup, conv, _ = chat
    killed = subprocess.run([sys.executable, "-c", KILLER, str(setup.student_model), str(conv), str(tmp_path / "k"),
                             MAX_NEW], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    index = json.loads((tmp_path / "k" / "index" / "w00000.json").read_text())
    assert [p["part"] for p in index["parts"]] == [0]
    again = _generate(setup, conv, tmp_path / "k", check=False)
    assert again.returncode != 0 and "--resume" in again.stderr
    resumed = _generate(setup, conv, tmp_path / "k", "--resume")
    assert "2 written, 1 kept" in resumed.stdout
    assert _parts(tmp_path / "k") == _parts(whole)


def test_two_jobs_split_one_prompt_file_by_rows(chat, tmp_path):
    """One JSONL file feeds both jobs: job j samples rows j, j + 2, ... and the two give the rollouts of one job."""
    setup, conv, _ = chat
    held = conv.with_name("heldout.jsonl")
    for j in (0, 1):
        _generate(setup, held, tmp_path / "r", "--num-shards", "2", "--shard-index", str(j))
    whole_out = tmp_path / "whole"
    _generate(setup, held, whole_out)
    order = list(dict.fromkeys(r["prompt_id"] for r in _rows(whole_out)))  # the file's prompts, in row order
    assert len(order) == len(held.read_text().splitlines()) == 3
    for j in (0, 1):
        mine = [json.loads(line) for p in sorted((tmp_path / "r" / "parts").glob(f"w0000{j}-*.jsonl"))
                for line in p.read_text().splitlines()]
        assert list(dict.fromkeys(r["prompt_id"] for r in mine)) == order[j::2], j
    rows = _rows(tmp_path / "r")
    key = lambda r: (r["prompt_id"], r["sample"])  # noqa: E731
    assert len({key(r) for r in rows}) == len(rows) == len(_rows(whole_out))
    assert sorted(map(key, rows)) == sorted(map(key, _rows(whole_out)))
    assert sorted(r["sampled_ids"] for r in rows) == sorted(r["sampled_ids"] for r in _rows(whole_out))
    # a rollouts directory of jobs split another way (before the split was recorded) is not resumed into
    manifest = tmp_path / "r" / "manifest.json"
    old = {k: v for k, v in json.loads(manifest.read_text()).items() if k != "split"}
    manifest.write_text(json.dumps(old))
    again = _generate(setup, held, tmp_path / "r", "--num-shards", "2", "--shard-index", "0", "--resume", check=False)
    assert again.returncode != 0 and "another split" in again.stderr, again.stderr[-2000:]


def test_policy_fingerprint_follows_checkpoint_and_settings(chat, tmp_path):
    import shutil
    from dataclasses import replace

    from stage1_teacher.onpolicy.generate_config import SamplingConfig
    from stage1_teacher.onpolicy.rollouts import policy_fingerprint
    from xtcache.tokenizer import load_tokenizer

    setup, _, _ = chat
    tok = load_tokenizer(setup.student_model)
    base = SamplingConfig()
    fp = policy_fingerprint(str(setup.student_model), tok, base)["policy"]
    assert policy_fingerprint(str(setup.student_model), tok, base)["policy"] == fp
    for change in (dict(samples_per_prompt=2), dict(temperature=0.7), dict(top_p=0.9), dict(max_new_tokens=7),
                   dict(seed=3)):
        assert policy_fingerprint(str(setup.student_model), tok, replace(base, **change))["policy"] != fp, change
    other = tmp_path / "student"
    shutil.copytree(setup.student_model, other)
    assert policy_fingerprint(str(other), tok, base)["policy"] == fp  # same bytes, same policy
    from safetensors.torch import load_file, save_file

    weights = next(other.glob("*.safetensors"))
    state = load_file(str(weights))
    name = sorted(state)[0]
    state[name] = state[name] + 1e-3
    save_file(state, str(weights), metadata={"format": "pt"})
    assert policy_fingerprint(str(other), tok, base)["policy"] != fp


def test_processed_logprobs_top_p_keeps_the_nucleus():
    import torch

    from stage1_teacher.onpolicy.samplers import processed_logprobs

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    lp = processed_logprobs(logits, 1.0, 0.75)
    assert torch.isinf(lp[0, 2:]).all() and torch.allclose(lp[0, :2].exp(), torch.tensor([0.625, 0.375]))
    lp = processed_logprobs(logits, 2.0, 1.0)
    assert torch.allclose(lp.exp().sum(), torch.tensor(1.0)) and lp[0, 0] < torch.log(torch.tensor(0.5))


@pytest.mark.parametrize("rows, message, process", [
    ([{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}],
     "row 0: the last message is the 'assistant'", False),
    ([{"messages": [{"role": "user", "content": "hi"}]}, {"other": 1}], "row 1: missing messages field", False),
    ([], "the file is empty", True),  # a process of its own: its exit status, before the student is loaded
])
def test_bad_prompts_are_refused_in_one_line(chat, request, tmp_path, rows, message, process):
    setup, _, _ = chat
    data = tmp_path / "bad.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = _generate(setup, data, tmp_path / "r", check=False,
                     procs=request.getfixturevalue("procs") if process else None)
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: --data ") and "bad.jsonl" in last and message in last, last


def test_an_out_among_other_files_is_refused_and_left_as_it_was(chat, tmp_path):
    setup, conv, _ = chat
    out = tmp_path / "home"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    proc = _generate(setup, conv, out, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: --out {out} holds no rollouts but other entries (notes.txt); give a new or empty directory for the "
        "rollouts"), proc.stderr[-2000:]
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"] and (out / "notes.txt").read_text() == "mine"


def test_an_empty_prompt_file_is_refused_before_the_student_is_read(tmp_path):
    data = tmp_path / "empty.jsonl"
    data.write_text("")
    (tmp_path / "no-student").mkdir()  # a directory without a model: the prompts are refused before it is read
    proc = xtcache("generate", "--student", tmp_path / "no-student", "--data", data, "--out", tmp_path / "r",
                   "--engine", "hf")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].endswith(
        "empty.jsonl: the file is empty; give prompt files with at least one row"), proc.stderr[-2000:]


class _FakeEngine:
    """Stands in for `vllm.LLM` in VllmSampler.stream: requests queue up in `enqueue`; each `step`
    finishes the two newest unfinished requests (so requests finish out of submission order) and
    records how many parts were queued when the caller last received a part."""

    def __init__(self):
        from types import SimpleNamespace

        self.request_counter = SimpleNamespace(counter=0)
        self.unfinished: list[tuple[str, list[int], int]] = []  # (request id, prompt ids, n)
        self.enqueued_prompts: list[int] = []  # first prompt id of each enqueue call
        self.llm_engine = self

    def enqueue(self, reqs, params, use_tqdm=False):
        self.enqueued_prompts.append(reqs[0]["prompt_token_ids"][0])
        for r, p in zip(reqs, params):
            self.unfinished.append((str(self.request_counter.counter), r["prompt_token_ids"], p.n))
            self.request_counter.counter += 1

    def has_unfinished_requests(self) -> bool:
        return bool(self.unfinished)

    def step(self):
        from types import SimpleNamespace

        done, self.unfinished = self.unfinished[-2:], self.unfinished[:-2]
        return [SimpleNamespace(request_id=rid, finished=True, outputs=[
            SimpleNamespace(token_ids=[ids[0], s], logprobs=[{ids[0]: SimpleNamespace(logprob=-1.0)},
                                                             {s: SimpleNamespace(logprob=-2.0)}], finish_reason="stop")
            for s in range(n)]) for rid, ids, n in reversed(done)]


def test_vllm_stream_keeps_the_next_part_queued_and_yields_parts_in_order():
    """The engine is handed the next part before the current one is returned (it never runs dry at a
    part's end or while the part is written), and each part's completions are its own prompts', in
    order, however the engine orders the finished requests."""
    from stage1_teacher.onpolicy.generate_config import SamplingConfig
    from stage1_teacher.onpolicy.rollouts import Prompt
    from stage1_teacher.onpolicy.samplers import VllmSampler

    sampler = VllmSampler.__new__(VllmSampler)
    sampler.llm, sampler.seeded, sampler.reproducible = _FakeEngine(), False, False
    parts = [(k, [Prompt(f"d{10 * k + i}", "", [10 * k + i, 7]) for i in range(3)]) for k in range(4)]
    sampling = SamplingConfig(samples_per_prompt=2, max_new_tokens=2)
    got = []
    for part, prompts, completions in sampler.stream(iter(parts), sampling):
        queued_parts = len(sampler.llm.enqueued_prompts)
        assert queued_parts == min(part + 2, len(parts)), (part, queued_parts)  # this part and the next one
        got.append(part)
        for prompt, samples in zip(prompts, completions, strict=True):
            assert [c.ids for c in samples] == [[prompt.token_ids[0], 0], [prompt.token_ids[0], 1]]
            assert all(c.logprobs == [-1.0, -2.0] and c.stop_reason == "stop" for c in samples)
    assert got == [0, 1, 2, 3] and sampler.llm.enqueued_prompts == [0, 10, 20, 30]


@pytest.mark.slow
def test_vllm_generate_on_cpu_structure(chat, tmp_path):
    setup, conv, _ = chat
    proc = subprocess.run(
        [sys.executable, "-m", "xtcache.app.cli", "generate", "--student", str(setup.student_model), "--data", str(conv),
         "--out", str(tmp_path / "r"), "--engine", "vllm", "--samples-per-prompt", "2", "--max-new-tokens", MAX_NEW,
         "--dtype", "float32", "--prompts-per-part", "2"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(_parts(tmp_path / "r")) == [f"w00000-p{p:05d}.jsonl" for p in range(3)]
    rows = _rows(tmp_path / "r")
    prompts = [json.loads(line) for line in conv.read_text().splitlines()]
    assert len(rows) == 12
    for i, row in enumerate(rows):  # three parts streamed through one engine: each row under its own prompt
        assert row["messages"][:-1] == prompts[i // 2]["messages"] and row["sample"] == i % 2
        assert row["stop_reason"] in ("stop", "length") and row["messages"][-1]["role"] == "assistant"
        assert 0 < len(row["sampled_ids"]) == len(row["sampled_logprobs"]) <= int(MAX_NEW)
        assert all(lp <= 0 for lp in row["sampled_logprobs"])
    assert "reproducible        no" in proc.stdout or "reproducible        yes" in proc.stdout


def test_text_rollouts_store_the_prompt_and_the_completion_apart_and_train_the_completion_only(chat, tmp_path):
    """generate on text prefixes -> teacher-dump -> the loader with --train-on last-assistant: every student
    token of the completion has the generated turn's role and every prompt token the user's (a token that
    straddles the two starts in the prompt); a completion whose ids are the sampled ones keeps their sampling
    log-probs; the loader trains exactly the completion's tokens."""
    import numpy as np

    from schemas.roles import LAST_ASSISTANT, ROLE_USER
    from stage2_student.config import LoaderConfig
    from stage2_student.loader import CacheDataset
    from xtcache.fingerprint import tokenizer_fingerprint
    from xtcache.store import CacheReader
    from xtcache.tokenizer import load_tokenizer

    setup, _, text = chat
    _generate(setup, text, tmp_path / "r")
    rows = {r["text"]: r for r in _rows(tmp_path / "r")}
    dump = xtcache("teacher-dump", "--teacher", setup.teacher_model, "--student-tokenizer", setup.student_tokenizer,
                   "--data", tmp_path / "r" / "parts" / "*.jsonl", "--out", tmp_path / "store", "--engine", "hf",
                   "--top-k", "8")
    assert dump.returncode == 0, dump.stderr[-3000:]
    tok = load_tokenizer(str(setup.student_tokenizer))
    reader = CacheReader(str(tmp_path / "store"))
    fp = tokenizer_fingerprint(tok)
    completion_tokens = with_logprobs = docs = 0
    for sid in reader.alignment_parts(fp):
        texts, al = reader.read_shard(sid).texts, reader.read_alignment(fp, sid)
        for d, doc_text in enumerate(texts):
            rec, row = al.record(d), rows[doc_text]
            roles, ids = rec.student_role, rec.student_ids.tolist()
            turn = np.flatnonzero(roles & LAST_ASSISTANT)
            assert (roles[:len(roles) - len(turn)] == ROLE_USER).all()  # the prompt first, then the completion
            completion = doc_text[row["prefix_chars"]:]
            spelled = tok.decode(ids[len(ids) - len(turn):])
            assert completion.endswith(spelled) and len(completion) - len(spelled) <= 8  # a straddling token at most
            assert tok.decode(ids[:len(ids) - len(turn)]).endswith(doc_text[:row["prefix_chars"]][-4:])
            body = row["sampled_ids"][:-1] if row["stop_reason"] == "stop" else row["sampled_ids"]
            lps = rec.sampled_logprobs
            if ids[len(ids) - len(turn):] == body:
                assert np.allclose(lps[turn], row["sampled_logprobs"][:len(body)], atol=1e-6)
                with_logprobs += 1
            else:  # re-tokenized (noise with replacement characters, or a token merged across the prefix's end)
                assert np.isnan(lps[turn]).all()
            assert np.isnan(lps[:len(ids) - len(turn)]).all()
            completion_tokens += len(turn)
            docs += 1
    assert docs == len(rows) == 6 and completion_tokens > 0 and with_logprobs >= 1
    ds = CacheDataset(str(tmp_path / "store"), str(setup.student_tokenizer),
                      LoaderConfig(seq_len=512, micro_batch_size=1, train_on="last-assistant"),
                      split="all", epochs=1, shuffle=False)
    trained = sum(int((b["labels"] != -100).sum()) for b in ds)
    assert trained == completion_tokens  # every completion token, predicted from the one before it; no prompt token
