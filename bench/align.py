"""Benchmark: chunk alignment speed against tokenization of the same text, side by side.

For each tokenizer pair (byte-level BPE student vs byte-level BPE teacher, SentencePiece-style
student vs the same teacher) and the same documents, it times in one run:

- tokenize: both fast tokenizers encode the batch (`encode_batch`) and their ids and character
  offsets are read out into numpy arrays (what any aligner needs as input);
- align (batch): `xtcache.align.chunks` on the whole batch in one vectorized walk, with the byte check
  of every token against the text;
- align (per doc): a loop of `align_offsets`, one call per document, for comparison;

and prints a table with the ratio align / tokenize (target: at most 10%). Timings are the best of
`--repeat` interleaved runs.

A conversation row (`--chats` conversations with tool calls and thinking, `xtcache.testing.chat`)
renders each one in a Llama-3-style template (student) and a ChatML-style one (teacher); its
"align" is what `xtcache.chat.layout` adds to tokenizing: locating the messages in both renderings,
mapping the tokens, the chunk walk and the misalignment check. Its time per token is compared with
the plain-text byte-BPE row (target: at most 2x); the rendering (jinja) is timed on its own.

    python bench/align.py [--docs 400] [--doc-chars 2000] [--chats 400] [--repeat 7] [--teacher real] [--write-docs]

`--write-docs` writes the plain-text rows into docs/benchmarks.md's `align` block and the conversation rows
into docs/conversations.md's `align-chat` block (xtcache.app.docblock), stamped with this command.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from xtcache.align.chunks import align_flat, align_offsets, alignment_stats
from xtcache.align.tokenizer import encode_flat, tokenizer_info
from xtcache.testing import toy

REPO = Path(__file__).resolve().parents[1]
DOC_BLOCKS = {"align": "docs/benchmarks.md", "align-chat": "docs/conversations.md",
              "align-real": "docs/benchmarks.md"}  # --write-docs: block -> file


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def bench_pair(name: str, s_tok, t_tok, docs: list[str], repeat: int) -> dict:
    """Tokenize, batch-align and per-document-align the same documents, interleaved `repeat`
    times (so load changes on a shared machine hit all three alike); keeps each one's best time."""
    s_info, t_info = tokenizer_info(s_tok), tokenizer_info(t_tok)

    def tokenize():
        return (encode_flat(s_tok, docs, add_special_tokens=True, side="student"),
                encode_flat(t_tok, docs, add_special_tokens=True, side="teacher"))

    _, (s_flat, t_flat) = timed(tokenize)  # warm-up
    split = lambda flat, k: np.split(flat[k], np.cumsum(flat[2])[:-1])  # noqa: E731
    s_split, s_offs, t_split, t_offs = split(s_flat, 0), split(s_flat, 1), split(t_flat, 0), split(t_flat, 1)

    def batch():
        return align_flat(docs, (*s_flat, None), (*t_flat, None), s_info, t_info)

    def per_doc():
        return [align_offsets(d, a, ao, b, bo, student_info=s_info, teacher_info=t_info)
                for d, a, ao, b, bo in zip(docs, s_split, s_offs, t_split, t_offs)]

    best = {"tokenize": float("inf"), "batch": float("inf"), "loop": float("inf")}
    for _ in range(repeat):
        for key, fn in (("tokenize", tokenize), ("batch", batch), ("loop", per_doc)):
            dt, out = timed(fn)
            best[key] = min(best[key], dt)
            if key == "batch":
                aligns = out
            elif key == "loop":
                loop_aligns = out
    assert all(x == y for x, y in zip(aligns, loop_aligns)), "batch and per-document alignments differ"
    tokens = int(s_flat[0].shape[0] + t_flat[0].shape[0])
    return {"pair": name, "tokens": tokens, "tokenize_s": best["tokenize"], "batch_s": best["batch"],
            "loop_s": best["loop"], "stats": alignment_stats(aligns)}


def bench_conversations(name: str, s_tok, t_tok, convs: list[dict], repeat: int) -> dict:
    """Render, tokenize and align conversations, each model in its own template (interleaved)."""
    from xtcache.chat.layout import align_conversations
    from xtcache.chat.render import render, renderings, turn_marker_ids

    s_mark, t_mark = (np.asarray(turn_marker_ids(t), dtype=np.int64) for t in (s_tok, t_tok))

    def render_all():
        return [render(s_tok, c) for c in convs], [render(t_tok, c) for c in convs]

    _, (s_texts, t_texts) = timed(render_all)

    def tokenize():
        return (encode_flat(s_tok, s_texts, add_special_tokens=False, side="student"),
                encode_flat(t_tok, t_texts, add_special_tokens=False, side="teacher"))

    _, (s_flat, t_flat) = timed(tokenize)

    def align():  # as stage 1: one batch encoding per side, the message texts collected once
        ts = renderings(t_tok, t_texts, convs, markers=t_mark, encoded=t_flat)
        ss = renderings(s_tok, s_texts, convs, markers=s_mark, encoded=s_flat, texts_of=ts)
        return align_conversations(convs, ss, ts)

    best = {"render": float("inf"), "tokenize": float("inf"), "batch": float("inf")}
    for _ in range(repeat):
        for key, fn in (("render", render_all), ("tokenize", tokenize), ("batch", align)):
            dt, out = timed(fn)
            best[key] = min(best[key], dt)
            if key == "batch":
                aligned = out
    assert all(a.stats["misaligned_chars"] == 0 for a in aligned)
    stats = alignment_stats([a.alignment for a in aligned])
    content = sum(a.stats["content_chars"] for a in aligned)
    stats["exact_char_share"] = sum(a.stats["shared_chars"] for a in aligned) / max(1, content)
    return {"pair": name, "tokens": int(s_flat[0].shape[0] + t_flat[0].shape[0]), "tokenize_s": best["tokenize"],
            "batch_s": best["batch"], "loop_s": float("nan"), "render_s": best["render"], "stats": stats}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=400)
    ap.add_argument("--doc-chars", type=int, default=2000)
    ap.add_argument("--chats", type=int, default=400, help="conversations for the conversation rows")
    ap.add_argument("--long-turns", type=int, default=12,
                    help="most turns of the long conversations' row (the short row has 1-3 turns)")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--work", default=None, help="directory for the trained tokenizers (default: a temp dir)")
    ap.add_argument("--write-docs", action="store_true",
                    help="also write the tables into docs/benchmarks.md (align) and docs/conversations.md (align-chat)")
    ap.add_argument("--teacher", choices=("toy", "real"), default="toy",
                    help="real: SmolLM2-135M-Instruct's tokenizer (49,152 ids, ChatML) as the teacher, the Llama-3 "
                         "(128,256) and Qwen3 (151,669) vocabularies as students, on documentation text "
                         "(xtcache.testing.real); --write-docs then writes docs/benchmarks.md's align-real block")
    args = ap.parse_args()
    if args.write_docs:
        from xtcache.app.docblock import require_blocks

        require_blocks(REPO, {"align-real": DOC_BLOCKS["align-real"]} if args.teacher == "real" else
                       {k: v for k, v in DOC_BLOCKS.items() if k != "align-real"})
    if args.teacher == "real":
        return real_rows(args)
    from transformers import AutoTokenizer

    docs = toy.stdlib_corpus(args.docs, doc_chars=args.doc_chars)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work or tmp)
        train = docs[: max(50, len(docs) // 2)]
        toy.train_bpe_tokenizer(train, 2048, "teacher", work / "teacher")
        toy.train_bpe_tokenizer(train, 1536, "student", work / "student")
        toy.train_sentencepiece_style_tokenizer(train, 1536, work / "sp")
        teacher = AutoTokenizer.from_pretrained(str(work / "teacher"))
        student = AutoTokenizer.from_pretrained(str(work / "student"))
        sp = AutoTokenizer.from_pretrained(str(work / "sp"))
        rows = [bench_pair("byte-BPE -> byte-BPE", student, teacher, docs, args.repeat),
                bench_pair("SentencePiece -> byte-BPE", sp, teacher, docs, args.repeat)]
        from xtcache.testing.chat import chat_corpus, chat_tokenizer

        s_chat = chat_tokenizer(work / "student", "llama3", work / "student-llama3")
        t_chat = chat_tokenizer(work / "teacher", "chatml-thinking", work / "teacher-chatml")
        rows.append(bench_conversations("conversations, 1-3 turns: Llama-3 -> ChatML template", s_chat, t_chat,
                                        chat_corpus(args.chats), args.repeat))
        rows.append(bench_conversations(f"conversations, 1-{args.long_turns} turns: Llama-3 -> ChatML template",
                                        s_chat, t_chat, chat_corpus(args.chats, max_turns=args.long_turns),
                                        args.repeat))
    chars = sum(len(d) for d in docs)
    head = f"{len(docs)} documents, {chars:,} characters; best of {args.repeat}"
    notes = conversation_notes(rows, args.chats)
    print(f"\n{head}\n")
    print("\n".join(table(rows)))
    print()
    print("\n".join(notes))
    for r in rows:
        s = r["stats"]
        print(f"{r['pair']}: chunks {s['chunks']:,}  1:1 {s['1:1']:,}  1:n {s['1:n']:,}  n:1 {s['n:1']:,}  "
              f"n:m {s['n:m']:,}  one side empty {s['empty_student'] + s['empty_teacher']:,}")
    if args.write_docs:
        from xtcache.app.docblock import write_block

        write_block(REPO / DOC_BLOCKS["align"], "align", "\n".join([head + ":", "", *table(rows[:2])]))
        write_block(REPO / "docs" / "conversations.md", "align-chat",
                    "\n".join([head + " (plain text), " + f"{args.chats} conversations per row:", "",
                               *table(rows[:1] + rows[2:]), "", *notes]))


def real_rows(args) -> None:
    """The real tier's rows: real vocabularies on documentation text, and conversations in the real teacher's
    ChatML against the Llama-3 template on the Llama-3 vocabulary."""
    import json

    from xtcache.testing.chat import chat_corpus
    from xtcache.testing.real import build_real_models
    from xtcache.tokenizer import load_tokenizer

    models = build_real_models()
    docs = [json.loads(line)["text"] for line in models.train_jsonl.read_text().splitlines()][:args.docs]
    teacher = load_tokenizer(models.teacher)
    llama3, qwen3 = load_tokenizer(models.llama3_tokenizer), load_tokenizer(models.qwen3_tokenizer)
    rows = [bench_pair("Llama-3 (128k) -> SmolLM2 (49k)", llama3, teacher, docs, args.repeat),
            bench_pair("Qwen3 (152k) -> SmolLM2 (49k)", qwen3, teacher, docs, args.repeat),
            bench_conversations("conversations, 1-3 turns: Llama-3 template -> SmolLM2's ChatML", llama3, teacher,
                                chat_corpus(args.chats), args.repeat)]
    chars = sum(len(d) for d in docs)
    head = (f"real tokenizers: {len(docs)} documents of the Python language reference, {chars:,} characters, and "
            f"{args.chats} conversations; best of {args.repeat}")
    lines = [head + ":", "", *table(rows), "", *conversation_notes(rows, args.chats)]
    for r in rows:
        st = r["stats"]
        lines.append(f"{r['pair']}: chunks {st['chunks']:,}: 1:1 {st['1:1'] / st['chunks']:.1%}, 1:n "
                     f"{st['1:n'] / st['chunks']:.1%}, n:1 {st['n:1'] / st['chunks']:.1%}, n:m {st['n:m'] / st['chunks']:.1%}")
    print("\n".join(lines))
    if args.write_docs:
        from xtcache.app.docblock import write_block

        write_block(REPO / DOC_BLOCKS["align-real"], "align-real", "\n".join(lines))


def table(rows: list[dict]) -> list[str]:
    """The bench's markdown table of `rows`."""
    lines = ["| pair | tokens (both) | tokenize s | align batch s | align/tokenize | aligned tok/s | "
             "align per-doc s | per-doc/tokenize | exact chars |", "|" + "---|" * 9]
    for r in rows:
        lines.append(f"| {r['pair']} | {r['tokens']:,} | {r['tokenize_s']:.3f} | {r['batch_s']:.3f} | "
                     f"{r['batch_s'] / r['tokenize_s']:.1%} | {r['tokens'] / r['batch_s']:,.0f} | {r['loop_s']:.3f} | "
                     f"{r['loop_s'] / r['tokenize_s']:.1%} | {r['stats']['exact_char_share']:.1%} |")
    return lines


def conversation_notes(rows: list[dict], chats: int) -> list[str]:
    """Each conversation row's align time per token against the plain-text byte-BPE row (target <= 2x)."""
    plain = rows[0]
    lines = []
    for conv in rows[2:]:
        per_token = (conv["batch_s"] / conv["tokens"]) / (plain["batch_s"] / plain["tokens"])
        lines.append(f"{conv['pair']}: {conv['tokens'] / chats / 2:,.0f} tokens per rendering; align time per token "
                     f"{per_token:.2f}x the plain-text byte-BPE row (target <= 2x); rendering both templates "
                     f"{conv['render_s']:.3f} s ({conv['tokens'] / conv['render_s']:,.0f} tok/s)")
    lines.append("exact chars of a conversation row = message text found verbatim in both renderings (the rest: "
                 "text a template changed or dropped)")
    return lines


if __name__ == "__main__":
    main()
