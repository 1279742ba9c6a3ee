"""Teacher capture throughput, side by side in one run: where does `xtcache teacher-dump` stand?

On one teacher and one corpus (the same windows for every path) it measures positions/s of

  (a) vLLM forward only           generate(max_tokens=1), no log-probs: the engine's ceiling
  (b) vLLM prompt log-probs       prompt_logprobs=k with vLLM's default flags (Logprob objects, detokenized)
  (c) transformers forward+top-k  batched HF forward, log_softmax, topk(k)
  (d) xtcache teacher-dump        end to end: corpus -> tokenize/align -> teacher -> targets -> store
  (e) xtcache teacher-dump --engine hf, end to end (the same pipeline on the transformers engine)

and prints a table with the ratios (d)/(a) and (d)/(b) (targets: >= 0.5 and >= 4). Engine start
times are excluded from every rate and printed separately; (d) is timed from its first batch to
its last committed part, so tokenization, alignment, lm_head/top-k and the compressed writes are
inside it. (a) computes logits for the last position of each window only, while every capture
path needs them for every position: the lm_head's share of the forward decides how close (d) can
get. The toy teacher's head costs 1.3x its transformer body (real teachers: 0.08 for 7-8B,
0.18 for 1.5B, 0.38 for 0.5B), so the run measures two vLLM-servable toy teachers side by side:
"toy" (the tests' teacher, 2 layers) and "proportioned" (6 layers, head share 0.11), or the
teacher given with --teacher.

    .venv/bin/python bench/teacher_dump.py [--docs 256] [--top-k 64] [--max-seq-len 512] [--shapes toy,proportioned]
        [--teacher real] [--write-docs]      # also writes the table into docs/benchmarks.md (xtcache.app.docblock)
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from xtcache.app.docblock import require_blocks, tee_stdout, write_block  # noqa: E402

# --write-docs: block -> file
DOC_BLOCKS = {"teacher-dump": "docs/benchmarks.md", "teacher-dump-real": "docs/benchmarks.md"}


def corpus_windows(teacher: str, texts: list[str], max_len: int) -> list[np.ndarray]:
    from xtcache.tokenizer import load_tokenizer

    tok = load_tokenizer(teacher, "teacher tokenizer")
    out = []
    for enc in tok.backend_tokenizer.encode_batch(texts, add_special_tokens=True):
        ids = np.asarray(enc.ids, dtype=np.int64)
        out.extend(ids[i:i + max_len] for i in range(0, len(ids), max_len) if len(ids[i:i + max_len]) > 1)
    return out


def bench_vllm_generate(teacher: str, windows, k: int, max_len: int, dtype: str) -> dict:
    from vllm import LLM, SamplingParams

    from stage1_teacher.capture.vllm_engine import VllmOptions

    opts = VllmOptions(model=teacher, dtype=dtype, max_model_len=max_len + 1,
                       max_num_batched_tokens=max(8192, max_len + 1))
    t0 = time.perf_counter()
    llm = LLM(**opts.llm_kwargs(), max_logprobs=k)
    start = time.perf_counter() - t0
    prompts = [{"prompt_token_ids": w.tolist()} for w in windows]
    n = sum(len(w) for w in windows)
    llm.generate(prompts[:8], SamplingParams(max_tokens=1), use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=1), use_tqdm=False)
    fwd = time.perf_counter() - t0
    t0 = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=k), use_tqdm=False)
    plp = time.perf_counter() - t0
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass
    del llm
    return {"start": start, "a": n / fwd, "b": n / plp, "a_s": fwd, "b_s": plp}


def bench_hf(teacher: str, windows, k: int, dtype: str) -> dict:
    import torch

    from stage1_teacher.capture.hf_engine import HfEngine

    eng = HfEngine(teacher, dtype=dtype, batch_tokens=16384)
    n = sum(len(w) for w in windows)
    t0 = time.perf_counter()
    for i in range(0, len(windows), 32):
        for z in eng.run(windows[i:i + 32]):
            torch.topk(torch.log_softmax(z, -1), k, dim=-1)
    return {"c": n / (time.perf_counter() - t0)}


def bench_dump(teacher: str, student: str, corpus: str, k: int, max_len: int, dtype: str, out: str,
               engine: str = "vllm", mode: str = "topk", num_samples: int = 64) -> dict:
    from stage1_teacher.config import build_config
    from stage1_teacher.dump import run_teacher_dump

    cfg = build_config({"teacher": teacher, "student_tokenizer": [student], "data": [corpus], "out": out,
                        "engine": engine, "dtype": dtype, "mode": mode, "top_k": k, "num_samples": num_samples,
                        "max_seq_len": max_len, "docs_per_part": 64})
    s = run_teacher_dump(cfg, progress=False)
    return {"d": s.positions / s.capture_s, "summary": s}


def measure(teacher: str, student: str, texts: list[str], args) -> dict:
    """All five paths on one teacher, back to back."""
    from stage1_teacher.capture.head import read_config
    from xtcache.testing.toy_teacher import head_share

    with tempfile.TemporaryDirectory() as tmp:
        corpus = f"{tmp}/corpus.jsonl"
        Path(corpus).write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
        windows = corpus_windows(teacher, texts, args.max_seq_len)
        n = sum(len(w) for w in windows)
        try:
            share = head_share(read_config(teacher))
        except KeyError:  # a config without the usual fields (MoE, multimodal): not reported
            share = float("nan")
        print(f"teacher {teacher} (lm_head / body multiply-adds {share:.2f})\ncorpus  {len(texts)} documents, "
              f"{len(windows)} windows, {n} positions, k={args.top_k}, dtype {args.dtype}", flush=True)
        ab = bench_vllm_generate(teacher, windows, args.top_k, args.max_seq_len, args.dtype)
        c = bench_hf(teacher, windows, args.top_k, args.dtype)
        d = bench_dump(teacher, student, corpus, args.top_k, args.max_seq_len, args.dtype, f"{tmp}/store")
        e = bench_dump(teacher, student, corpus, args.top_k, args.max_seq_len, args.dtype, f"{tmp}/store_hf", "hf")
    s = d["summary"]
    print(f"  engine start: {ab['start']:.1f} s for (a)/(b); {s.engine_start_s:.1f} s for (d) "
          "(reference + fast engine, first-batch check)")
    print(f"  (d) {s.capture_path}; {s.bytes_written / max(1, s.positions):.1f} B/position; time split "
          f"teacher {s.teacher_s:.1f} s, targets {s.post_s:.1f} s, encode+write {s.write_s:.1f} s, "
          f"teacher waited {s.teacher_wait_s:.2f} s on the writer and {s.input_wait_s:.2f} s on input", flush=True)
    return {"share": share, "positions": n, "a": ab["a"], "b": ab["b"], "c": c["c"], "d": d["d"], "e": e["d"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--docs", type=int, default=256)
    p.add_argument("--top-k", type=int, default=64)
    p.add_argument("--max-seq-len", type=int, default=512)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--shapes", default="toy,proportioned",
                   help="toy teacher shapes to measure, comma-separated (xtcache.testing.toy_teacher.SHAPES)")
    p.add_argument("--teacher", default=None,
                   help="'real' (SmolLM2-135M-Instruct with the Llama-3 student tokenizer over documentation text, "
                        "xtcache.testing.real), or a teacher directory, instead of the toy shapes")
    p.add_argument("--student-tokenizer", default=None)
    p.add_argument("--write-docs", action="store_true",
                   help="also write the table into docs/benchmarks.md (block teacher-dump, or teacher-dump-real "
                        "with --teacher real)")
    args = p.parse_args()
    block = "teacher-dump-real" if args.teacher == "real" else "teacher-dump"
    if args.write_docs:
        require_blocks(REPO, {block: DOC_BLOCKS[block]})
    logging.basicConfig(level=logging.WARNING)

    from xtcache.testing import toy
    from xtcache.testing.suite import TEST_CACHE, TEST_SPEC  # the tests' toy setup, built once
    from xtcache.testing.toy_teacher import build_vllm_teacher

    setup = toy.build_toy_setup(TEST_CACHE, TEST_SPEC)
    student = args.student_tokenizer or str(setup.student_tokenizer)
    texts = [json.loads(line)["text"] for line in open(setup.train_jsonl)][:args.docs]
    if args.teacher == "real":  # a trained teacher, a real student vocabulary, real documentation text
        from xtcache.testing.real import build_real_models

        models = build_real_models()
        student = args.student_tokenizer or str(models.llama3_tokenizer)
        texts = [json.loads(line)["text"] for line in open(models.train_jsonl)][:args.docs]
        teachers = {"real (SmolLM2-135M)": str(models.teacher)}
    elif args.teacher:
        teachers = {Path(args.teacher).name: args.teacher}
    else:
        teachers = {shape: str(build_vllm_teacher(setup.root, shape=shape, steps=120 if shape == "toy" else 40))
                    for shape in args.shapes.split(",")}
    results = {name: measure(path, student, texts, args) for name, path in teachers.items()}

    with tee_stdout() as printed:
        print_table(results)
    if args.write_docs:
        write_block(REPO / DOC_BLOCKS[block], block, printed.text())


def print_table(results: dict[str, dict]) -> None:
    names = list(results)
    print()
    print("| path | " + " | ".join(f"{n} teacher, positions/s" for n in names) + " |")
    print("| --- |" + " ---: |" * len(names))
    print("| lm_head / body multiply-adds | " + " | ".join(f"{results[n]['share']:.2f}" for n in names) + " |")
    for key, label in (("a", "(a) vLLM forward only"), ("b", "(b) vLLM prompt log-probs, default flags"),
                       ("c", "(c) transformers forward + top-k"), ("d", "(d) xtcache teacher-dump, end to end"),
                       ("e", "(e) xtcache teacher-dump --engine hf, end to end")):
        print(f"| {label} | " + " | ".join(f"{results[n][key]:,.0f}" for n in names) + " |")
    for num, den, target in (("d", "a", ">= 0.5"), ("d", "b", ">= 4"), ("d", "c", "")):
        print(f"| ({num})/({den}){' target ' + target if target else ''} | "
              + " | ".join(f"{results[n][num] / results[n][den]:.2f}" for n in names) + " |")


if __name__ == "__main__":
    main()
