"""Generation throughput: `xtcache generate --engine vllm` end to end against plain vLLM `LLM.generate`
of the same prompts, side by side in one run (and `--engine hf` for reference).

Both vLLM rows run on one engine, the one `generate`'s VllmSampler starts, `--reps` times each,
alternating (plain, xtcache, plain, ...) after one warm-up call, so that the load of a shared
machine falls on both rows alike; the table gives medians, the line below it every run's ratio,
and "vs plain vLLM" is the median of those ratios. "plain vLLM" is `LLM.generate` of all the
token-id prompts at once with the same `SamplingParams` that xtcache sends (checked: n,
temperature, top-p, max tokens, `logprobs=0`: the sampled token's log-prob, in flat lists,
`detokenize=False`), writing nothing. "xtcache generate" is the whole command's generation loop
(`run_generate`): reading the prompts, rendering them in the student's chat template, sampling
part after part (`--prompts-per-part`, the command's default unless given), decoding each
completion's text, writing the parts and the index. The engine's start and
stop are fixed costs of a command, measured once and printed apart, not in the rates (vLLM's CPU
build takes 5 s to stop: its worker process does not exit on its own and is killed at the end of
vLLM's grace period). Generated tokens per second; the ratio is xtcache / plain.

    python bench/generate.py [--prompts 128] [--samples 2] [--max-new-tokens 128] [--prompts-per-part N] [--reps 5] [--hf-prompts 8] [--write-docs]

`--write-docs` writes the table into docs/on-policy.md's `generate` block (xtcache.app.docblock).
"""

from __future__ import annotations

import argparse
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
    from xtcache.testing.chat import chat_corpus, write_prompts

    return write_prompts(chat_corpus(n, seed=7, max_turns=2), out)


def sampling_values(args) -> dict:
    return dict(dtype="float32", samples_per_prompt=args.samples, max_new_tokens=args.max_new_tokens,
                **({"prompts_per_part": args.prompts_per_part} if args.prompts_per_part else {}))


def plain_params(args):
    """What plain vLLM is asked for: the sampled tokens and their log-probs, nothing else."""
    from vllm import SamplingParams

    return SamplingParams(n=args.samples, temperature=1.0, top_p=1.0, max_tokens=args.max_new_tokens, logprobs=0,
                          flat_logprobs=True, detokenize=False)


def plain_generate(llm, reqs, params) -> dict:
    """Plain `LLM.generate` of the token-id prompts; nothing decoded, nothing written."""
    t0 = time.perf_counter()
    outs = llm.generate(reqs, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    if any(len(o.logprobs or []) != len(o.token_ids) for out in outs for o in out.outputs):
        raise RuntimeError("plain vLLM returned fewer log-probs than sampled tokens")
    return {"tokens": sum(len(o.token_ids) for out in outs for o in out.outputs), "seconds": seconds}


def xtcache_generate(values: dict, sampler=None) -> dict:
    """`run_generate` of one job. With `sampler`, the job samples with that (already started) sampler
    and leaves it open; without, it starts and closes its own, timed apart."""
    import stage1_teacher.onpolicy.generate as g
    from stage1_teacher.onpolicy.generate_config import build_generate_config

    fixed = {"start": 0.0, "stop": 0.0}
    make = g._sampler

    def timed_sampler(cfg, tok):
        t0 = time.perf_counter()
        s = make(cfg, tok)
        fixed["start"] = time.perf_counter() - t0
        close = s.close

        def timed_close():
            t1 = time.perf_counter()
            close()
            fixed["stop"] = time.perf_counter() - t1

        s.close = timed_close
        return s

    if sampler is not None:
        sampler.close = lambda: None  # the bench closes it
    g._sampler = timed_sampler if sampler is None else (lambda cfg, tok: sampler)
    t0 = time.perf_counter()
    try:
        summary = g.run_generate(build_generate_config(values))
    finally:
        g._sampler = make
    seconds = time.perf_counter() - t0 - fixed["start"] - fixed["stop"]
    return {"tokens": summary.generated_tokens, "seconds": seconds, **fixed}


def side_by_side(student: str, prompts: Path, tmp: Path, args) -> tuple[list[dict], dict]:
    """`--reps` alternating runs of plain `LLM.generate` and `xtcache generate` on one engine (the
    one xtcache's VllmSampler starts), after one warm-up call; and the engine's start and stop."""
    from vllm.inputs import TokensPrompt

    import stage1_teacher.onpolicy.generate as g
    from stage1_teacher.corpus import iter_corpus
    from stage1_teacher.onpolicy.generate_config import build_generate_config
    from stage1_teacher.onpolicy.rollouts import prompt_of
    from xtcache.tokenizer import load_tokenizer

    values = dict(student=student, data=[str(prompts)], engine="vllm", **sampling_values(args))
    cfg = build_generate_config({**values, "out": str(tmp / "unused")})
    tok = load_tokenizer(student)
    prompts_ = [prompt_of(d, tok) for d in iter_corpus([str(prompts)], messages_field="messages")]
    reqs = [TokensPrompt(prompt_token_ids=p.token_ids) for p in prompts_]
    t0 = time.perf_counter()
    sampler = g._sampler(cfg, tok)
    fixed = {"start": time.perf_counter() - t0}
    close = sampler.close
    params = plain_params(args)
    ours = sampler.requests(prompts_[:1], cfg.sampling)[1][0]
    if repr(ours) != repr(params):
        raise RuntimeError(f"the plain row asks for other outputs than xtcache: {params} vs {ours}")
    try:
        plain_generate(sampler.llm, reqs[:8], params)  # warm-up: neither row pays the first call
        runs = []
        for rep in range(args.reps):
            plain = plain_generate(sampler.llm, reqs, params)
            ours = xtcache_generate({**values, "out": str(tmp / f"vllm{rep}")}, sampler)
            runs.append({"plain": plain, "xtcache": ours})
            print(f"rep {rep}: plain {plain['tokens'] / plain['seconds']:,.0f} tok/s, xtcache "
                  f"{ours['tokens'] / ours['seconds']:,.0f} tok/s", flush=True)
    finally:
        t0 = time.perf_counter()
        close()
        fixed["stop"] = time.perf_counter() - t0
    return runs, fixed


def table(runs: list[dict], hf: dict | None, args) -> list[str]:
    """Medians over the reps; "vs plain vLLM" is the median of each run's ratio to the plain run
    beside it (a load that comes and goes between two runs moves one ratio, not the median)."""
    from statistics import median

    def rate(r):
        return r["tokens"] / r["seconds"]

    base = median(rate(r["plain"]) for r in runs)
    lines = ["| run | prompts x samples | generated tokens | seconds | tokens/s | vs plain vLLM |",
             "| --- | --- | --- | --- | --- | --- |"]
    for key, name in (("plain", "plain vLLM LLM.generate"), ("xtcache", "xtcache generate --engine vllm")):
        rows = [r[key] for r in runs]
        ratio = median(rate(r[key]) / rate(r["plain"]) for r in runs)  # each run against its neighbour
        lines.append(f"| {name} | {args.prompts} x {args.samples} | {round(median(r['tokens'] for r in rows)):,} | "
                     f"{median(r['seconds'] for r in rows):.2f} | {median(map(rate, rows)):,.0f} | {ratio:.2f}x |")
    if hf is not None:
        lines.append(f"| xtcache generate --engine hf | {args.hf_prompts} x {args.samples} | {hf['tokens']:,} | "
                     f"{hf['seconds']:.2f} | {rate(hf):,.0f} | {rate(hf) / base:.2f}x |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--prompts-per-part", type=int, default=None,
                    help="xtcache generate --prompts-per-part (default: the command's default)")
    ap.add_argument("--reps", type=int, default=5, help="alternating runs of the two vLLM rows")
    ap.add_argument("--hf-prompts", type=int, default=8, help="prompts of the --engine hf row (0: no hf row)")
    ap.add_argument("--write-docs", action="store_true", help="also write the table into docs/on-policy.md")
    args = ap.parse_args()
    if args.write_docs:
        from xtcache.app.docblock import require_blocks

        require_blocks(REPO, DOC_BLOCKS)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from stage1_teacher.onpolicy.generate_config import RolloutOutConfig
    from xtcache.testing import toy
    from xtcache.testing.chat import build_chat_setup
    from xtcache.testing.suite import TEST_CACHE, TEST_SPEC

    base = toy.build_toy_setup(TEST_CACHE, TEST_SPEC)
    setup = build_chat_setup(base, TEST_CACHE / "bench-generate-chat", num_train=8, num_heldout=2, teacher_steps=0)
    student = str(setup.student_model)
    with tempfile.TemporaryDirectory() as tmp:
        prompts = prompt_file(setup, args.prompts, Path(tmp) / "prompts.jsonl")
        runs, fixed = side_by_side(student, prompts, Path(tmp), args)
        hf = None
        if args.hf_prompts:
            few = prompt_file(setup, args.hf_prompts, Path(tmp) / "few.jsonl")
            hf = xtcache_generate(dict(student=student, data=[str(few)], out=str(Path(tmp) / "hf"), engine="hf",
                                       **sampling_values(args)))
    per_part = args.prompts_per_part or RolloutOutConfig(out="").prompts_per_part
    ratios = sorted(r["xtcache"]["tokens"] / r["xtcache"]["seconds"] / (r["plain"]["tokens"] / r["plain"]["seconds"])
                    for r in runs)
    head = (f"toy Llama student (hidden 64, 2 layers), Llama-3-style template, float32, T=1, top-p 1, "
            f"{args.max_new_tokens} new tokens at most, log-probs of the sampled tokens returned, "
            f"--prompts-per-part {per_part}; median of {args.reps} alternating runs on one engine:")
    foot = (f"xtcache / plain per run: {', '.join(f'{x:.2f}' for x in ratios)}. vLLM engine start "
            f"{fixed['start']:.1f} s and stop {fixed['stop']:.1f} s, once per command, not in the rates "
            "(on the CPU build the stop waits out vLLM's 5 s grace period for its worker process).")
    lines = [head, "", *table(runs, hf, args), "", foot]
    print("\n".join(lines))
    if args.write_docs:
        from xtcache.app.docblock import write_block

        write_block(REPO / "docs" / "on-policy.md", "generate", "\n".join(lines))


if __name__ == "__main__":
    main()
