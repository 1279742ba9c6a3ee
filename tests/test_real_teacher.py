"""The real-model tier end to end: a trained teacher (SmolLM2-135M-Instruct, 49,152 ids, ChatML) and a
student on the real Llama-3 vocabulary (128,256 ids), through teacher-dump -> projection -> train-student,
for plain documentation text and for conversations in the two families' own chat templates.

The artifacts come from `xtcache.testing.real` (built once per machine from the registry's wheels, checked
by content hash). Stage 1 runs the transformers engine: vLLM's capture of the same teacher is what
`bench/teacher_dump.py --teacher real` measures; the suite's vLLM tests run the toy teacher.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.commands import xtcache
from xtcache.store import CacheReader
from xtcache.testing import real
from xtcache.testing.chat import chat_corpus, write_chat_jsonl
from xtcache.testing.toy import build_tiny_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def models() -> real.RealModels:
    return real.build_real_models()


@pytest.fixture(scope="module")
def student(models, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("student") / "llama3-tiny"
    build_tiny_model("llama", models.llama3_tokenizer, out, hidden=64, layers=2, intermediate=192, seed=1)
    return out


def _dump(models, data: Path, out: Path, *extra: str) -> None:
    proc = xtcache("teacher-dump", "--teacher", models.teacher, "--student-tokenizer", models.llama3_tokenizer,
                   "--data", data, "--out", out, "--mode", "topk", "--top-k", "64", "--engine", "hf",
                   "--dtype", "float32", *extra)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_the_real_tier_is_the_pinned_teacher_and_vocabularies(models):
    from xtcache.tokenizer import load_tokenizer

    teacher_tok, llama3, qwen3 = (load_tokenizer(p) for p in (models.teacher, models.llama3_tokenizer,
                                                                models.qwen3_tokenizer))
    assert (len(teacher_tok), len(llama3), len(qwen3)) == (49_152, 128_256, 151_669)
    # the families' own splits: Llama-3 groups digits in threes, Qwen3 splits every digit
    assert [llama3.decode([i]) for i in llama3.encode("12345", add_special_tokens=False)] == ["123", "45"]
    assert [qwen3.decode([i]) for i in qwen3.encode("12345", add_special_tokens=False)] == list("12345")
    assert llama3.encode("x")[0] == llama3.convert_tokens_to_ids("<|begin_of_text|>")
    assert "<|im_start|>" in teacher_tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)


def test_documentation_text_distils_cross_tokenizer_from_the_real_teacher(models, student, tmp_path, procs):
    docs = [json.loads(line)["text"][:1500] for line in models.heldout_jsonl.read_text().splitlines()[:4]]
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    _dump(models, data, tmp_path / "store")
    reader = CacheReader(str(tmp_path / "store"))
    assert reader.manifest.teacher_vocab_size == 49_152
    shard = reader.read_shard(reader.shards[0].shard_id, verify=True)
    nll = -float(shard.realized_logprob[shard.has_pred].mean())
    # a trained model reads English documentation at about 2.6 nats a token (100 documents: 2.60); an untrained
    # one of this vocabulary at ln 49,152 = 10.8
    assert nll < 4.0, nll
    assert float((1.0 - shard.residual[shard.has_pred]).mean()) > 0.8  # top-64 holds most of a real teacher's mass

    proj = tmp_path / "w.safetensors"
    built = xtcache("projection", "build", "--student-tokenizer", models.llama3_tokenizer, "--teacher-tokenizer",
                    models.teacher, "--out", proj)
    assert built.returncode == 0, built.stderr[-2000:]
    run = procs.run(tmp_path / "run", "--cache", str(tmp_path / "store"), "--student", str(student), "--projection",
                     str(proj), "--seq-len", "128", "--micro-batch-size", "4", "--max-steps", "8", "--lr", "3e-3",
                     "--warmup-steps", "1", "--zero-stage", "2", "--eval-cache", str(tmp_path / "store"))
    train = run["train"]
    assert train[0]["kd_name"] == "pkl" and all(np.isfinite([r["loss"] for r in train]))
    assert train[-1]["kd"] < train[0]["kd"]  # the student moves toward the real teacher's distributions
    assert run["summary"]["final_eval_top1_agree"] is not None
    # the summary names the map it trained through by its content: the file written by `projection build` above
    from xtcache.projection import ProjectionMap

    pm = ProjectionMap.load(proj)
    unreached = len(set(range(pm.teacher_vocab_size)) - set(pm.indices.ravel().tolist()))  # teacher ids W misses
    assert unreached > 0  # Llama-3 splits some SmolLM2 tokens (docs/losses.md)
    assert run["summary"]["data"]["projections"] == [{"cache": str(tmp_path / "store"), "map": str(proj),
                                                      "sha256": pm.digest(), "unreached_teacher_ids": unreached}]


def test_conversations_align_between_chatml_and_the_llama3_template(models, tmp_path):
    data = write_chat_jsonl(tmp_path / "chat.jsonl", chat_corpus(3, seed=0))
    _dump(models, data, tmp_path / "chat")
    proc = xtcache("inspect", tmp_path / "chat")
    assert proc.returncode == 0, proc.stderr[-2000:]
    group = next(line for line in proc.stdout.splitlines() if "tok-llama3" in line and "%" in line)
    exact = float(group.split("%")[0].split()[-1])
    assert exact > 80.0, group  # content text aligns exactly although the two templates differ
    conv = next(line for line in proc.stdout.splitlines() if "assistant" in line and "template" in line)
    assert conv.split()[-1] == "0", conv  # no character aligned to another text
