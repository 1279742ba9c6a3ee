"""Generation throughput: `xtcache generate --engine vllm` end to end against plain vLLM `LLM.generate`
of the same prompts, side by side in one run (and `--engine hf` for reference).

Both vLLM rows start their own engine (the engine start is reported apart, not in the rate);
"plain vLLM" is `LLM.generate` of the same token-id prompts with the same sampling settings and
`logprobs=0`, writing nothing; "xtcache generate" is the whole command's generation loop: reading
the prompts, rendering them in the student's chat template, sampling, decoding, writing the parts
and the index. Generated tokens per second over the generation time; the ratio is xtcache / plain.

    python bench/generate.py [--prompts 128] [--samples 2] [--max-new-tokens 128] [--hf-prompts 8] [--write-docs]

`--write-docs` writes the table into docs/on-policy.md's `generate` block (xtcache.docblock).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

DOC_BLOCKS = {"generate": "docs/on-policy.md"}  # --write-docs: block -> file


def prompt_file(setup, n: int, out: Path) -> Path:
    """`n` conversation prompts (the chat corpus cut after its last user message)."""
    from xtcache.testing.chat import chat_corpus

    rows = []
    for row in chat_corpus(n, seed=7, max_turns=2):
        last_user = max(i for i, m in enumerate(row["messages"]) if m["role"] == "user")
        rows.append({**row, "messages": row["messages"][:last_user + 1]})
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def plain_vllm(student: str, prompts: Path, args) -> dict:
    """Plain `LLM.generate` of the same token-id prompts and sampling settings."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from stage1_teacher.capture_vllm import VllmOptions
    from stage1_teacher.corpus import iter_corpus
    from stage1_teacher.rollouts import prompt_of
    from xtcache.tokenizer import load_tokenizer

    tok = load_tokenizer(student)
    docs = list(iter_corpus([str(prompts)], messages_field="messages"))
    ids = [prompt_of(d, tok).token_ids for d in docs]
    t0 = time.perf_counter()
    llm = LLM(**VllmOptions(model=student, dtype="float32", seed=0).llm_kwargs(), logprobs_mode="processed_logprobs")
    start = time.perf_counter() - t0
    params = SamplingParams(n=args.samples, temperature=1.0, top_p=1.0, max_tokens=args.max_new_tokens, logprobs=0)
    t0 = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=x) for x in ids], params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for out in outs for o in out.outputs)
    llm.llm_engine.engine_core.shutdown()
    return {"row": "plain vLLM LLM.generate", "tokens": tokens, "seconds": seconds, "start": start}


def xtcache_generate(student: str, prompts: Path, out: Path, args, engine: str) -> dict:
    """`run_generate` of one job; the engine start is timed apart (the sampler is built lazily)."""
    import stage1_teacher.generate as g
    from stage1_teacher.generate_config import build_generate_config

    built = {}
    make = g._sampler

    def timed_sampler(cfg, tok):
        t0 = time.perf_counter()
        s = make(cfg, tok)
        built["start"] = time.perf_counter() - t0
        return s

    g._sampler = timed_sampler
    cfg = build_generate_config(dict(student=student, data=[str(prompts)], out=str(out), engine=engine,
                                     dtype="float32", samples_per_prompt=args.samples,
                                     max_new_tokens=args.max_new_tokens, prompts_per_part=10**6))
    t0 = time.perf_counter()
    summary = g.run_generate(cfg)
    g._sampler = make
    seconds = time.perf_counter() - t0 - built["start"]
    return {"row": f"xtcache generate --engine {engine}", "tokens": summary.generated_tokens, "seconds": seconds,
            "start": built["start"]}


def table(rows: list[dict], plain: dict) -> list[str]:
    lines = ["| run | prompts x samples | generated tokens | seconds | tokens/s | vs plain vLLM | engine start |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    base = plain["tokens"] / plain["seconds"]
    for r in rows:
        rate = r["tokens"] / r["seconds"]
        lines.append(f"| {r['row']} | {r['prompts']} x {r['samples']} | {r['tokens']:,} | {r['seconds']:.2f} | "
                     f"{rate:,.0f} | {rate / base:.2f}x | {r['start']:.1f} s |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--hf-prompts", type=int, default=8, help="prompts of the --engine hf row (0: no hf row)")
    ap.add_argument("--write-docs", action="store_true", help="also write the table into docs/on-policy.md")
    args = ap.parse_args()
    if args.write_docs:
        from xtcache.docblock import require_blocks

        require_blocks(REPO, DOC_BLOCKS)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from xtcache.testing import toy
    from xtcache.testing.chat import build_chat_setup
    from xtcache.testing.suite import TEST_CACHE, TEST_SPEC

    base = toy.build_toy_setup(TEST_CACHE, TEST_SPEC)
    setup = build_chat_setup(base, TEST_CACHE / "bench-generate-chat", num_train=8, num_heldout=2, teacher_steps=0)
    student = str(setup.student_model)
    with tempfile.TemporaryDirectory() as tmp:
        prompts = prompt_file(setup, args.prompts, Path(tmp) / "prompts.jsonl")
        plain = {**plain_vllm(student, prompts, args), "prompts": args.prompts, "samples": args.samples}
        rows = [plain, {**xtcache_generate(student, prompts, Path(tmp) / "vllm", args, "vllm"),
                        "prompts": args.prompts, "samples": args.samples}]
        if args.hf_prompts:
            few = prompt_file(setup, args.hf_prompts, Path(tmp) / "few.jsonl")
            rows.append({**xtcache_generate(student, few, Path(tmp) / "hf", args, "hf"),
                         "prompts": args.hf_prompts, "samples": args.samples})
    head = (f"toy Llama student (hidden 64, 2 layers), Llama-3-style template, float32, T=1, top-p 1, "
            f"{args.max_new_tokens} new tokens at most, log-probs of the sampled tokens returned:")
    lines = [head, "", *table(rows, plain)]
    print("\n".join(lines))
    if args.write_docs:
        from xtcache.docblock import write_block

        write_block(REPO / "docs" / "on-policy.md", "generate", "\n".join(lines))


if __name__ == "__main__":
    main()
