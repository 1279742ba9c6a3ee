"""Where the teacher's NLL per byte of on-policy chat answers sits, by the shape of the chunk that holds each piece
of text: the teacher and the students of `bench/quality.py --section on-policy-converged` (its chat work directory).

    python bench/onpolicy_chunk_shapes.py --workdir WORK/on-policy-converged/chat --write-docs  # 9 min on 2 CPU cores
    python bench/onpolicy_chunk_shapes.py --workdir WORK/on-policy-converged-same/chat \
        --student-tokenizer WORK/on-policy-converged-same/chat/converged-s0/hf --row 1 \
        --block onpolicy-chunk-shapes-same --write-docs  # its rounds' default there: the reverse KL without CE

Each model answers the section's held-out prompts (12 samples each, temperature 1, draw seed 1, at most 100 student
tokens: policy-eval's sampler and cap). Each answer's text is tokenized twice, in the teacher's template and in the
student's, and cut into chunks at the character offsets where both tokenizations have a token boundary (the
chunks xtcache aligns; here of the canonical tokenizations of the answer text). A chunk is 1:1 (one student token,
one teacher token: the same text, which the first-piece map projects exactly), split by the student (several
student tokens, one teacher token: the teacher token no student row reaches, docs/losses.md), split by the
teacher (one student token, several teacher tokens) or split by both. The teacher (transformers, float32) reads
every answer after the prompt in its own template; its NLL of each chunk's teacher tokens, summed per shape and
divided by all the answers' bytes, splits policy-eval's teacher NLL per byte (without the end-of-turn marker) into
the shares of the four shapes, which add up to the total. Then the model's own NLL per token of its answer tokens
(the model reading its answers in its own template), at the 1:1 chunks and elsewhere: where it samples with more
or less entropy. Last, at the 1:1 chunks (the same token on both sides, read after the same text), the entropy of
the teacher's next-token distribution and of the model's own, in nats: which of the two is the surer there.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# --write-docs: block -> file; the second for the students of the one-tokenizer section (--block)
DOC_BLOCKS = {"onpolicy-chunk-shapes": "docs/on-policy.md", "onpolicy-chunk-shapes-same": "docs/on-policy.md"}
SHAPES = ("1:1", "split by the student", "split by the teacher", "split by both")
HEAD = ["| model | seed | answers | bytes | bytes in 1:1 chunks | teacher NLL/byte | of it: 1:1 | split by the student "
        "| split by the teacher | split by both | own NLL/token: 1:1 | elsewhere | entropy at 1:1: teacher | model |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]


def answer_tokens(tokenizer, convs: list[dict]) -> list[tuple[list[int], list[tuple[int, int]], list[int]] | None]:
    """Per conversation (its last message the answer): (the ids of its rendering in `tokenizer`'s template, the
    character spans of the answer's tokens relative to the answer's start, those tokens' indices in the ids), or None
    where the template does not write the answer whole or no token boundary falls on its ends."""
    from stage1_teacher.onpolicy.policy_eval import last_turn_tokens
    from xtcache.chat.render import render, renderings

    rs = renderings(tokenizer, [render(tokenizer, c, where="an answer") for c in convs], convs, side="tokenizer")
    out = []
    for conv, r in zip(convs, rs):
        located = last_turn_tokens(conv, r)
        if located is None:
            out.append(None)
            continue
        a, b, cover = located
        if not cover or r.offsets[cover[0], 0] != a or r.offsets[cover[-1], 1] != b:
            out.append(None)
            continue
        out.append((r.ids.tolist(), [(int(r.offsets[j, 0]) - a, int(r.offsets[j, 1]) - a) for j in cover], cover))
    return out


def token_scores(model, ids: list[int], device="cpu"):
    """(-log p(ids[j] | ids[:j]), the entropy of p(. | ids[:j])) for j >= 1 (index j - 1), float64 numpy."""
    import torch

    with torch.inference_mode():
        x = torch.tensor([ids], device=device)
        logp = torch.log_softmax(model(input_ids=x).logits[0, :-1].double(), dim=-1)
        nll = -logp.gather(1, x[0, 1:, None]).squeeze(1)
        return nll.cpu().numpy(), -(logp.exp() * logp).sum(dim=-1).cpu().numpy()


def shapes_of(teacher_spans, student_spans):
    """(the shape index of each teacher token's chunk, of each student token's, the chunks' end offsets, each
    chunk's shape index): chunks end where both tokenizations end a token."""
    import numpy as np

    ends = np.array(sorted({e for _, e in teacher_spans} & {e for _, e in student_spans}))
    t_chunk = np.searchsorted(ends, [e for _, e in teacher_spans])
    s_chunk = np.searchsorted(ends, [e for _, e in student_spans])
    n_t, n_s = np.bincount(t_chunk, minlength=ends.size), np.bincount(s_chunk, minlength=ends.size)
    shape = np.where(n_s == 1, np.where(n_t == 1, 0, 2), np.where(n_t == 1, 1, 3))  # SHAPES' order
    return shape[t_chunk], shape[s_chunk], ends, shape


def shape_row(name, seed, convs, teacher_side, own_side, teacher_scorer, own_model, student_tok) -> str:
    """One table row from the answers `convs` of one model."""
    import numpy as np

    student_side = own_side if own_model is not teacher_scorer.model else answer_tokens(student_tok, convs)
    nll, byte_total, byte_11, answers = np.zeros(4), 0, 0, 0
    own = {True: [0.0, 0], False: [0.0, 0]}  # at 1:1 chunks, elsewhere: (NLL, tokens)
    entropy = [0.0, 0.0, 0]  # at 1:1 chunks: teacher, model, tokens
    for conv, t, s, o in zip(convs, teacher_side, student_side, own_side):
        if t is None or s is None or o is None:
            continue
        answers += 1
        text = conv["messages"][-1]["content"]
        t_shape, s_shape, ends, shape = shapes_of(t[1], s[1])
        starts = np.concatenate([[0], ends[:-1]])
        sizes = np.array([len(text[a:b].encode()) for a, b in zip(starts.tolist(), ends.tolist())])
        byte_total += int(sizes.sum())
        byte_11 += int(sizes[shape == 0].sum())
        t_nll, t_ent = token_scores(teacher_scorer.model, t[0], teacher_scorer.device)
        np.add.at(nll, t_shape, t_nll[np.array(t[2]) - 1])
        o_shape = t_shape if own_model is teacher_scorer.model else s_shape
        o_nll, o_ent = (t_nll, t_ent) if own_model is teacher_scorer.model else token_scores(own_model, o[0])
        for sh, j in zip(o_shape.tolist(), o[2]):
            own[sh == 0][0] += float(o_nll[j - 1])
            own[sh == 0][1] += 1
        # a 1:1 chunk is one token on each side: the k-th of them in either tokenization is the same text
        t_11 = [j for sh, j in zip(t_shape.tolist(), t[2]) if sh == 0]
        o_11 = [j for sh, j in zip(o_shape.tolist(), o[2]) if sh == 0]
        entropy[0] += float(t_ent[np.array(t_11, dtype=np.int64) - 1].sum())
        entropy[1] += float(o_ent[np.array(o_11, dtype=np.int64) - 1].sum())
        entropy[2] += len(t_11)
    per = nll / max(byte_total, 1)
    return (f"| {name} | {seed} | {answers} | {byte_total} | {byte_11 / max(byte_total, 1):.3f} | {per.sum():.3f} | "
            + " | ".join(f"{x:.3f}" for x in per)
            + f" | {own[True][0] / max(own[True][1], 1):.3f} | {own[False][0] / max(own[False][1], 1):.3f}"
            + f" | {entropy[0] / max(entropy[2], 1):.3f} | {entropy[1] / max(entropy[2], 1):.3f} |")


def shape_rows(work: Path, seeds: list[int], samples: int = 12, cap: int = 100,
               student_tokenizer: Path | None = None, row: int | None = None) -> list[str]:
    """The table's rows (markdown), each printed as it is measured."""
    from bench.onpolicy_end_hazard import section_answers
    from stage1_teacher.onpolicy.policy_eval import sample_conversations
    from xtcache.tokenizer import load_tokenizer

    student_tok = load_tokenizer(str(student_tokenizer or work / "chat" / "student"), "student tokenizer")
    table = []
    for scorer, (name, seed, tok, model, prompts, _, texts) in section_answers(work, seeds, samples=samples, cap=cap,
                                                                               row=row):
        convs = sample_conversations(prompts, texts)
        teacher_side = answer_tokens(scorer.tokenizer, convs)
        own_side = teacher_side if name == "teacher" else answer_tokens(tok, convs)
        table.append(shape_row(name, seed, convs, teacher_side, own_side, scorer, model, student_tok))
        print(table[-1], flush=True)
    return table


def main() -> None:
    from bench.onpolicy_end_hazard import section_parser

    p = section_parser(__doc__)
    p.add_argument("--student-tokenizer", type=Path, help="the students' tokenizer (default: WORKDIR/chat/student; "
                   "the one-tokenizer section's students read the teacher's: give a converged student's hf directory)")
    p.add_argument("--block", choices=sorted(DOC_BLOCKS), default="onpolicy-chunk-shapes",
                   help="the block --write-docs replaces: onpolicy-chunk-shapes-same for the one-tokenizer section")
    p.add_argument("--write-docs", action="store_true", help="replace that block of docs/on-policy.md")
    args = p.parse_args()
    from xtcache.app.docblock import require_blocks, write_block

    if args.write_docs:
        require_blocks(REPO, DOC_BLOCKS)
    print("\n".join(HEAD))
    rows = shape_rows(Path(args.workdir), [int(s) for s in args.seeds.split(",")],
                      student_tokenizer=args.student_tokenizer, row=args.row)
    if args.write_docs:
        write_block(REPO / DOC_BLOCKS[args.block], args.block, "\n".join([*HEAD, *rows]))


if __name__ == "__main__":
    main()
