"""Where on-policy chat answers get shorter: the teacher's end-of-turn probability along answers written by the
teacher itself and by the students of `bench/quality.py --section on-policy-converged` (its chat work directory).

    python bench/onpolicy_end_hazard.py --workdir WORK/on-policy-converged/chat --write-docs  # 2 min on 2 CPU cores

Each model answers the section's held-out prompts (4 samples each, temperature 1, draw seed 1, at most 103
student tokens: policy-eval's sampler). The teacher (transformers, float32) reads every answer after the
prompt in its own template and gives, at each answer token after the first, its probability of ending the turn
there instead (`eos_token`, the template's end-of-turn marker). The table: per model, the mean of that
probability per answer, then over answers, and over each answer's second half; answers' mean characters. Then
the ends expected per 100 characters of answer (the sum of those probabilities over the answer's tokens, per
character: comparable across tokenizers), once by the teacher and once by the model itself, which reads its own
answers in its own template and gives its own end-of-turn probability the same way: a model whose own figure is
above the teacher's ends its answers sooner than the teacher would end them. Last, of the answers that ended
(the model sampled its end-of-turn marker), the teacher's negative log-probability of ending where they end: the
stop decision's share of policy-eval's teacher NLL. And the teacher's NLL per byte over the first 60 characters
of every answer that long (the tokens that end within them): answers compared over the same stretch, whatever
their lengths.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

DOC_BLOCKS = {"onpolicy-end-hazard": "docs/on-policy.md"}  # --write-docs: block -> file
HEAD_CHARS = 60  # the answers' first characters, where answers of every length are compared byte for byte
HEAD = ["| model | seed | answers | mean characters | teacher P(end), mean over answers | second halves | "
        "ends per 100 characters: teacher | the model itself | answers that ended | teacher NLL of their end (nats) | "
        f"answers of {HEAD_CHARS}+ characters | teacher NLL/byte of their first {HEAD_CHARS} |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]


class AnswerScore(NamedTuple):
    text: str
    inner: object  # the teacher's P(end of turn) in place of each answer token after the first
    last: float  # its P(end of turn) right after the answer
    head_nll: float | None  # its NLL of the answer's tokens within the first HEAD_CHARS characters (None: shorter)
    head_bytes: int | None  # the UTF-8 bytes of those tokens' text


def end_probabilities(teacher, tokenizer, prompt: dict, answers: list[str], device="cpu") -> list[AnswerScore]:
    """Each answer of at least two teacher tokens, read by the teacher after the prompt in its own template."""
    import torch

    from xtcache.chat.render import render

    end = tokenizer.eos_token_id
    prefix = tokenizer(render(tokenizer, prompt, add_generation_prompt=True), add_special_tokens=False)["input_ids"]
    out = []
    for text in answers:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = enc["input_ids"]
        if len(ids) < 2:
            continue
        with torch.inference_mode():
            logits = teacher(input_ids=torch.tensor([prefix + ids], device=device)).logits[0].double()
        logp = torch.log_softmax(logits, dim=-1).cpu()
        p_end = logp[:, end].exp().numpy()
        head_nll = head_bytes = None
        if len(text) >= HEAD_CHARS:
            head = [j for j, (_, stop) in enumerate(enc["offset_mapping"]) if stop <= HEAD_CHARS]
            head_nll = -sum(float(logp[len(prefix) - 1 + j, ids[j]]) for j in head)  # row i predicts token i + 1
            head_bytes = len(text[:enc["offset_mapping"][head[-1]][1]].encode()) if head else None
        out.append(AnswerScore(text, p_end[len(prefix):len(prefix) + len(ids) - 1],
                               float(p_end[len(prefix) + len(ids) - 1]), head_nll if head_bytes else None, head_bytes))
    return out


def hazard_models(work: Path, seeds: list[int], row: int | None = None) -> list[tuple[str, object, Path]]:
    """(name, seed, model directory) of the teacher and, per seed, the section's converged student and its
    continued off-policy KD and on-policy rows (`row`: an index of the section's ROWS, by default the rounds'
    defaults, forward P-KL + 0.1 CE); SystemExit naming a run that is not there or a row that is no on-policy one."""
    from bench.quality_onpolicy_converged import ROWS, finished_run

    off = next(i for i, (_, how, _, _) in enumerate(ROWS) if how == "off")
    if row is None:
        on = next(i for i, (_, how, flags, _) in enumerate(ROWS) if how == "on" and flags == ["--loss", "forward"])
        on_name = "on-policy rounds (rounds' defaults)"
    elif 0 <= row < len(ROWS) and ROWS[row][1] == "on":
        on, on_name = row, ROWS[row][0]
    else:
        raise SystemExit(f"--row {row}: not an on-policy row of the section (ROWS in bench/quality_onpolicy_converged.py)")
    models = [("teacher", "-", work / "chat" / "teacher")]
    for seed in seeds:
        for name, run in (("converged student", work / f"converged-s{seed}"),
                          ("continued off-policy KD", work / "runs" / f"row{off}-seed{seed}"),
                          (on_name, work / "runs" / f"row{on}-seed{seed}")):
            student = finished_run(run)[1]
            if student is None or not student.is_dir():
                raise SystemExit(f"{run}: no finished run there; run bench/quality.py --section on-policy-converged "
                                 "first")
            models.append((name, seed, student))
    return models


class Answers(NamedTuple):
    name: str
    seed: object
    tokenizer: object  # the model's own
    model: object  # the model (the teacher's row: the scorer's model)
    prompts: list
    completions: list  # per prompt, the sampler's completions
    texts: list  # per prompt, their texts


def section_answers(work: Path, seeds: list[int], *, samples: int, cap: int, row: int | None = None):
    """(the live teacher as policy-eval loads it, `Answers`) per model of `hazard_models` (the teacher first): its
    answers to the section's held-out prompts, `samples` a prompt at temperature 1, draw seed 1, at most `cap`
    student tokens (policy-eval's sampler)."""
    import torch
    from transformers import AutoModelForCausalLM

    from stage1_teacher.onpolicy.policy_eval import TeacherScorer, read_prompts, sample_student
    from xtcache.tokenizer import load_tokenizer

    models = hazard_models(work, seeds, row)
    scorer = TeacherScorer(str(models[0][2]))
    try:
        for name, seed, path in models:
            tok = load_tokenizer(str(path), "model tokenizer")
            prompts = read_prompts(str(work / "prompts-heldout.jsonl"), tok)
            completions, texts = sample_student(str(path), tok, prompts, samples_per_prompt=samples,
                                                max_new_tokens=cap, seed=1)
            model = scorer.model if name == "teacher" else AutoModelForCausalLM.from_pretrained(
                str(path), torch_dtype=torch.float32).eval()
            yield scorer, Answers(name, seed, tok, model, prompts, completions, texts)
    finally:
        scorer.close()


def section_parser(doc: str) -> argparse.ArgumentParser:
    """The flags of the benches that read the section's chat work directory."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--workdir", required=True, help="the chat work directory of the on-policy-converged section")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--row", type=int, help="the on-policy row of the section (an index of its ROWS; default: the "
                   "rounds' defaults, forward P-KL + 0.1 CE)")
    return p


def hazard_rows(work: Path, seeds: list[int], samples: int = 4, cap: int = 103, row: int | None = None) -> list[str]:
    """The table's rows (markdown), each printed as it is measured."""
    import numpy as np

    table = []
    for scorer, (name, seed, tok, model, prompts, completions, texts) in section_answers(work, seeds, samples=samples,
                                                                                          cap=cap, row=row):
        per, second, chars, teacher_rate, own_rate, end_nll, head = [], [], [], [], [], [], []
        for prompt, comps, answers in zip(prompts, completions, texts):
            stopped = {text: c.stop_reason == "stop" for c, text in zip(comps, answers)}
            scored = end_probabilities(scorer.model, scorer.tokenizer, prompt.conversation, answers, scorer.device)
            # the model itself reading its answers: for the teacher's own row, that reading
            own = {a.text: a.inner for a in (scored if name == "teacher" else
                                             end_probabilities(model, tok, prompt.conversation, answers))}
            for a in scored:
                if a.text not in own:  # one student token: no end probability after its first
                    continue
                per.append(a.inner.mean())
                second.append(a.inner[len(a.inner) // 2:].mean())
                chars.append(len(a.text))
                teacher_rate.append(100 * a.inner.sum() / len(a.text))
                own_rate.append(100 * own[a.text].sum() / len(a.text))
                if stopped[a.text]:
                    end_nll.append(-np.log(max(a.last, 1e-30)))
                if a.head_nll is not None:
                    head.append((a.head_nll, a.head_bytes))
        head_nll, head_bytes = (sum(x) for x in zip(*head)) if head else (float("nan"), 1)
        table.append(f"| {name} | {seed} | {len(per)} | {np.mean(chars):.1f} | {np.mean(per):.4f} | "
                     f"{np.mean(second):.4f} | {np.mean(teacher_rate):.3f} | {np.mean(own_rate):.3f} | "
                     f"{len(end_nll)} | {np.mean(end_nll):.2f} | {len(head)} | {head_nll / head_bytes:.3f} |")
        print(table[-1], flush=True)
    return table


def main() -> None:
    p = section_parser(__doc__)
    p.add_argument("--write-docs", action="store_true", help="replace docs/on-policy.md's onpolicy-end-hazard block")
    args = p.parse_args()
    from xtcache.app.docblock import require_blocks, write_block

    if args.write_docs:
        require_blocks(REPO, DOC_BLOCKS)
    print("\n".join(HEAD))
    rows = hazard_rows(Path(args.workdir), [int(s) for s in args.seeds.split(",")], row=args.row)
    if args.write_docs:
        write_block(REPO / DOC_BLOCKS["onpolicy-end-hazard"], "onpolicy-end-hazard", "\n".join([*HEAD, *rows]))


if __name__ == "__main__":
    main()
