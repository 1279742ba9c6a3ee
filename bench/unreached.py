"""Benchmark: how much of a teacher's next-token probability sits on teacher ids no student row reaches.

P-KL compares, at a chunk's first position, the student's next-token distribution read through the
projection map W (each student token as the first teacher token of its text) with the teacher's row there.
A teacher token whose text the student splits is no student token's first teacher piece: no row of W points
at it (`xtcache.projection.unreached_teacher_ids`), and its probability has no student counterpart
(docs/losses.md, "Cross tokenizer: projected KL"). For each pair this runs the teacher (transformers, fp32,
full vocabulary) over held-out text and reports, per position, the teacher's probability on those ids and the
share of the realized teacher tokens that are among them:

- toy text: the toy student (1,536 ids) and teacher (2,048 ids) of `xtcache.testing` on the toy held-out docs;
- toy chat: the chat pair of `bench/quality.py --section on-policy-converged` (its chat teacher pre-trained
  150 steps, hidden 64) on its held-out conversations rendered in the teacher's template, counting the positions
  that predict a token of an assistant message's text (what train-student trains there; not the template's own
  tokens, which no student row is meant to reach);
- real: SmolLM2-135M-Instruct against the Llama-3 and Qwen3 vocabularies (`xtcache.testing.real`) on the
  real tier's held-out documents.

    python bench/unreached.py [--docs 8] [--max-tokens 1024] [--workdir DIR] [--write-docs]

`--write-docs` writes the table into docs/losses.md's `unreached` block (xtcache.app.docblock).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
DOC_BLOCKS = {"unreached": "docs/losses.md"}  # --write-docs: block -> file


def measure(name: str, student_dir, teacher_dir, texts: list[str], max_tokens: int, spans=None) -> dict:
    """The pair's unreached teacher ids and the teacher's probability on them over `texts` (one core); with
    `spans` (per text, character ranges), only at the positions that predict a token starting in one of them."""
    from transformers import AutoModelForCausalLM

    from xtcache.projection import build_projection, unreached_teacher_ids
    from xtcache.tokenizer import load_tokenizer

    s_tok, t_tok = load_tokenizer(student_dir), load_tokenizer(teacher_dir)
    unreached = unreached_teacher_ids(build_projection(s_tok, t_tok))
    model = AutoModelForCausalLM.from_pretrained(teacher_dir, torch_dtype=torch.float32).eval()
    mask = torch.zeros(model.config.vocab_size, dtype=torch.bool)  # lm_head columns past the tokenizer: reached by none
    mask[torch.from_numpy(unreached)] = True
    mass, realized, positions = 0.0, 0, 0
    for d, text in enumerate(texts):
        enc = t_tok(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = enc["input_ids"][:max_tokens]
        if len(ids) < 2:
            continue
        keep = torch.ones(len(ids) - 1, dtype=torch.bool)  # row j - 1 predicts token j
        if spans is not None:
            starts = [a for a, _ in enc["offset_mapping"][1:len(ids)]]
            keep = torch.tensor([any(lo <= a < hi for lo, hi in spans[d]) for a in starts], dtype=torch.bool)
        with torch.no_grad():
            probs = torch.softmax(model(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)  # [n - 1, V]
        mass += float(probs[keep][:, mask].sum())
        realized += int(mask[torch.tensor(ids[1:])][keep].sum())
        positions += int(keep.sum())
    return {"pair": name, "student_vocab": len(s_tok), "teacher_vocab": len(t_tok), "unreached": int(unreached.size),
            "mass": mass / max(positions, 1), "realized": realized / max(positions, 1), "positions": positions,
            "texts": len(texts)}


def _jsonl(path: Path, key: str, n: int) -> list:
    return [json.loads(line)[key] for line in path.read_text().splitlines()[:n]]


def assistant_spans(tokenizer, convs: list[dict]) -> tuple[list[str], list[list[tuple[int, int]]]]:
    """The conversations rendered in `tokenizer`'s template, and per rendering the character ranges of its
    assistant messages' texts."""
    from xtcache.chat.render import render, renderings
    from xtcache.chat.spans import message_texts

    texts = [render(tokenizer, c, where="a held-out conversation") for c in convs]
    out = []
    for conv, r in zip(convs, renderings(tokenizer, texts, convs, side="teacher tokenizer")):
        loc = r.located
        out.append([(loc.at[k], loc.at[k] + loc.width[k]) for k, (m, _, _) in enumerate(message_texts(conv))
                    if conv["messages"][m]["role"] == "assistant" and loc.at[k] >= 0])
    return texts, out


def pairs(args) -> list[tuple[str, Path, Path, list[str], list | None]]:
    """(name, student tokenizer, teacher model, held-out texts, their counted spans or None) of each pair."""
    from bench.quality_onpolicy_converged import ConvergedSettings
    from xtcache.testing import toy
    from xtcache.testing.chat import build_chat_setup
    from xtcache.testing.real import build_real_models
    from xtcache.testing.suite import TEST_CACHE, TEST_SPEC
    from xtcache.tokenizer import load_tokenizer

    base = toy.build_toy_setup(TEST_CACHE, TEST_SPEC)
    s = ConvergedSettings()
    chat = build_chat_setup(base, Path(args.workdir) / "chat", num_train=s.chat_train, num_heldout=s.eval_prompts,
                            teacher_steps=s.chat_teacher_steps, teacher_hidden=s.chat_teacher_hidden)
    convs = [json.loads(line) for line in chat.heldout_jsonl.read_text().splitlines()[:args.docs]]
    chats, spans = assistant_spans(load_tokenizer(chat.teacher_tokenizer), convs)
    real = build_real_models()
    real_docs = _jsonl(real.heldout_jsonl, "text", args.docs)
    return [("toy text (student 1,536 ids, teacher 2,048)", base.student_tokenizer, base.teacher_model,
             _jsonl(base.heldout_jsonl, "text", args.docs), None),
            ("toy chat (the on-policy section's chat pair; assistant text)", chat.student_tokenizer,
             chat.teacher_model, chats, spans),
            ("real: Llama-3 student, SmolLM2-135M-Instruct teacher", real.llama3_tokenizer, real.teacher, real_docs,
             None),
            ("real: Qwen3 student, SmolLM2-135M-Instruct teacher", real.qwen3_tokenizer, real.teacher, real_docs,
             None)]


def table(rows: list[dict]) -> list[str]:
    out = ["| pair | student ids | teacher ids | teacher ids no student row reaches | teacher probability on them "
           "per position | realized teacher tokens among them | positions |",
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        out.append(f"| {r['pair']} | {r['student_vocab']:,} | {r['teacher_vocab']:,} | {r['unreached']:,} "
                   f"({r['unreached'] / r['teacher_vocab']:.1%}) | {r['mass']:.3f} | {r['realized']:.3f} | "
                   f"{r['positions']:,} ({r['texts']} texts) |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=8, help="held-out documents (conversations) per pair")
    ap.add_argument("--max-tokens", type=int, default=1024, help="teacher tokens read per document")
    ap.add_argument("--workdir", default="/tmp/xtcache-bench-unreached", help="where the chat pair is built once")
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args()
    if args.write_docs:
        from xtcache.app.docblock import require_blocks

        require_blocks(REPO, DOC_BLOCKS)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    rows = [measure(name, s, t, texts, args.max_tokens, spans) for name, s, t, texts, spans in pairs(args)]
    lines = table(rows)
    print("\n".join(lines))
    print(f"wall {time.perf_counter() - t0:.0f} s")
    if args.write_docs:
        from xtcache.app.docblock import write_block

        write_block(REPO / DOC_BLOCKS["unreached"], "unreached", "\n".join(lines))


if __name__ == "__main__":
    main()
