"""Several teachers, one student, end to end: two stage-1 caches written by different teachers with
different tokenizers train one student on 2 ranks, with per-teacher metrics, and a run resumed from
its checkpoint continues with identical losses. Every run (every rank) is its own process, forked from
one process that imported DeepSpeed once (`tests.commands`).

Teacher A is the toy Qwen2 teacher (cross-tokenizer to the student, P-KL); teacher B a tiny Llama
on the student's own tokenizer (same-tokenizer, KL), both cached by `xtcache teacher-dump --engine
hf` over the same 64 documents (same document ids).

    pytest -q tests/test_train_multi.py
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.commands import xtcache


def dump(out: Path, teacher: Path, toy_setup, n_docs: int) -> str:
    """`xtcache teacher-dump --engine hf` of `teacher` over the first n_docs documents, as train.jsonl.

    Run in this process (the command's own code, minus a second torch and transformers import): these
    tests are about training on the caches, not about the dump's process."""
    out.mkdir(parents=True)
    data = out / "train.jsonl"  # the same base name as the other cache's corpus: the same document ids
    data.write_text("".join(toy_setup.train_jsonl.read_text().splitlines(keepends=True)[:n_docs]))
    proc = xtcache("teacher-dump", "--teacher", teacher, "--student-tokenizer", toy_setup.student_tokenizer,
                   "--data", data, "--out", out / "cache", "--mode", "topk", "--top-k", "16", "--engine", "hf",
                   "--docs-per-part", "16")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return str(out / "cache")


@pytest.fixture(scope="module")
def cache_a(toy_setup, tmp_path_factory) -> str:
    """Teacher A (the toy teacher) over the first 64 documents: one stage 1 run for both tests."""
    return dump(tmp_path_factory.mktemp("teacher_a") / "a", toy_setup.teacher_model, toy_setup, 64)


@pytest.fixture(scope="module")
def two_caches(toy_setup, tmp_path_factory, cache_a):
    from xtcache.testing.toy import build_tiny_model

    root = tmp_path_factory.mktemp("two")
    same = root / "teacher_b"
    build_tiny_model("llama", toy_setup.student_tokenizer, same, hidden=48, layers=1, intermediate=96, seed=5)
    return cache_a, dump(root / "b", same, toy_setup, 64)


def flags(toy_setup, caches, **extra) -> list[str]:
    base = [("cache", caches[0]), ("cache", caches[1]), ("student", str(toy_setup.student_model)),
            ("seq-len", "48"), ("micro-batch-size", "2"), ("max-steps", "6"), ("lr", "3e-3"), ("warmup-steps", "1"),
            ("ce-weight", "0.1"), ("eval-fraction", "0.15"), ("eval-batches", "2"), ("zero-stage", "2"),
            ("teacher-weights", "0.7,0.3"), ("teacher-combine", "dynamic")]
    base += [(k.replace("_", "-"), str(v)) for k, v in extra.items()]
    return [x for k, v in base for x in (f"--{k}", v)]


@pytest.mark.slow
def test_two_teachers_of_different_tokenizers_train_on_two_ranks_and_resume_exactly(procs, tmp_path, toy_setup,
                                                                                     two_caches):
    run = flags(toy_setup, two_caches, save_every=3)
    full = procs.run(tmp_path / "full", *run, nproc=2)
    assert [r["step"] for r in full["train"]] == [1, 2, 3, 4, 5, 6]
    assert full["summary"]["kd_loss"] == "pkl+kl" and full["summary"]["world_size"] == 2
    for row in full["train"]:
        assert row["teacher0_kd"] > 0 and row["teacher1_kd"] > 0
        assert row["teacher0_weight_share"] + row["teacher1_weight_share"] == pytest.approx(1.0)
        assert 0 <= row["teacher0_top1_agree"] <= 1 and 0 <= row["teacher1_top1_agree"] <= 1
    last = full["eval"][-1]
    assert last["teacher0_kl"] > 0 and last["teacher1_kl"] > 0 and last["mixture_kl"] is None
    teachers = full["summary"]["teachers"]
    assert [t["kd_loss"] for t in teachers[:2]] == ["pkl", "kl"]
    assert [t["weight"] for t in teachers[:2]] == pytest.approx([0.7, 0.3])
    assert teachers[0]["final_eval_kl"] == last["teacher0_kl"]
    # stopped after step 3 and resumed from its checkpoint: the same steps 4-6
    part = tmp_path / "part" / "checkpoints"
    part.mkdir(parents=True)
    shutil.copytree(tmp_path / "full" / "checkpoints" / "step3", part / "step3")
    (part / "latest").write_text("step3")
    resumed = procs.run(tmp_path / "part", *run, "--resume", "latest", nproc=2)
    assert [r["step"] for r in resumed["train"]] == [4, 5, 6]
    for key in ("loss", "kd", "ce", "tokens", "chunks", "teacher0_kd", "teacher1_kd", "teacher0_weight_share"):
        assert [r[key] for r in resumed["train"]] == [r[key] for r in full["train"][3:]], key


@pytest.fixture(scope="module")
def two_teachers_one_tokenizer(toy_setup, tmp_path_factory, cache_a):
    """Caches of two differently trained teachers of one tokenizer: the toy teacher and a smaller Qwen2
    trained on other documents (so their mixture is a distribution the student can be measured against)."""
    import json

    from xtcache.testing.toy import build_tiny_model, train_tiny_lm

    root = tmp_path_factory.mktemp("pair")
    other = root / "teacher_a2"
    build_tiny_model("qwen2", toy_setup.teacher_tokenizer, other, hidden=64, layers=1, intermediate=192, seed=9)
    texts = [json.loads(x)["text"] for x in toy_setup.train_jsonl.read_text().splitlines()]
    train_tiny_lm(other, texts[len(texts) // 2:], steps=120, seq_len=128, batch_size=8, seed=9, log_every=0)
    return cache_a, dump(root / "a2", other, toy_setup, 64)


def heldout_kls(model_dir: Path, toy_setup, caches, fraction: float) -> dict:
    """Held-out KL (P-KL at T=1, per chunk) of a student to each teacher and to their equal mixture."""
    import torch
    from transformers import AutoModelForCausalLM

    from stage2_student.config import LoaderConfig
    from stage2_student.join import teacher_view
    from stage2_student.loader import CacheDataset, CacheLoader
    from stage2_student.losses import ProjectionOperator
    from stage2_student.mix import mix_views
    from stage2_student.objective import Objective
    from xtcache.projection import build_projection
    from xtcache.tokenizer import load_tokenizer

    teacher_tok = load_tokenizer(toy_setup.teacher_tokenizer)
    pm = build_projection(load_tokenizer(toy_setup.student_tokenizer), teacher_tok)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    w = pm.to_torch_sparse(len(teacher_tok)).coalesce()
    w = torch.sparse_coo_tensor(w.indices(), w.values(), (model.config.vocab_size, w.shape[1]),
                                check_invariants=True).coalesce()
    measure = Objective("pkl", ce_weight=0.0, projection=ProjectionOperator(w), with_ce=False)
    ds = CacheDataset(list(caches), str(toy_setup.student_tokenizer), LoaderConfig(seq_len=64, micro_batch_size=4), split="eval",
                      holdout_fraction=fraction)
    sums = {"teacher A": [0.0, 0], "teacher A2": [0.0, 0], "mixture": [0.0, 0]}
    with torch.no_grad():
        for batch in CacheLoader(ds):
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                           position_ids=batch["position_ids"]).logits
            views = [teacher_view(batch, 0), teacher_view(batch, 1)]
            for name, view in (("teacher A", views[0]), ("teacher A2", views[1]),
                               ("mixture", mix_views(views, [0.5, 0.5]))):
                prep = measure.prepare(view, vocab=logits.shape[-1])
                sums[name][0] += measure.sums(logits, prep)[0].item()
                sums[name][1] += prep.chunks
    return {k: s / n for k, (s, n) in sums.items()}


@pytest.mark.slow
def test_heldout_kl_to_each_teacher_and_their_mixture(procs, tmp_path, toy_setup, two_teachers_one_tokenizer):
    """Students of teacher A, of teacher A2, and of both (sum and mean-probs), on the same held-out documents.

    Prints the table it measures (the README and docs/losses.md quote a run of it); asserts that each
    single-teacher student is the closer one to its own teacher and that every trained student is far
    closer to each teacher and to the mixture than the untrained one. Whether a two-teacher student is
    closer to the mixture than both single-teacher students is reported, not asserted: in the recorded
    run `sum` was (by 0.3%) and `mean-probs` was not, margins within the noise of a 40-step run."""
    a, a2 = two_teachers_one_tokenizer
    fraction = 0.2
    common = ["--student", str(toy_setup.student_model), "--seq-len", "64", "--micro-batch-size", "4",
              "--max-steps", "40", "--lr", "3e-3", "--warmup-steps", "2", "--zero-stage", "2",
              "--eval-fraction", str(fraction), "--eval-batches", "1", "--ce-weight", "0.1",
              "--pkl-divergence", "forward"]  # the forward P-KL the quoted table was measured with
    runs = {"student of A": ["--cache", a], "student of A2": ["--cache", a2],
            "A + A2, sum": ["--cache", a, "--cache", a2, "--teacher-combine", "sum"],
            "A + A2, mean-probs": ["--cache", a, "--cache", a2, "--teacher-combine", "mean-probs"]}
    table = {}
    for name, cache_flags in runs.items():
        out = tmp_path / name.replace(" ", "_").replace(",", "").replace("+", "and")
        procs.run(out, *cache_flags, *common)
        table[name] = heldout_kls(out / "hf", toy_setup, (a, a2), fraction)
    table["untrained student"] = heldout_kls(Path(toy_setup.student_model), toy_setup, (a, a2), fraction)
    lines = ["| student | KL to teacher A | KL to teacher A2 | KL to the mixture |", "| --- | --- | --- | --- |"]
    lines += [f"| {n} | {r['teacher A']:.4f} | {r['teacher A2']:.4f} | {r['mixture']:.4f} |" for n, r in table.items()]
    print("\nheld-out P-KL per chunk (40 steps, equal weights)\n" + "\n".join(lines))
    (tmp_path / "kl_table.md").write_text("\n".join(lines) + "\n")
    sa, sa2 = table["student of A"], table["student of A2"]
    assert sa["teacher A"] < sa2["teacher A"] and sa2["teacher A2"] < sa["teacher A2"]
    untrained = table["untrained student"]
    for name, row in table.items():
        if name != "untrained student":
            assert all(row[k] < 0.5 * untrained[k] for k in row), name
