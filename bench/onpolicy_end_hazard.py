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
stop decision's share of policy-eval's teacher NLL.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

DOC_BLOCKS = {"onpolicy-end-hazard": "docs/on-policy.md"}  # --write-docs: block -> file
HEAD = ["| model | seed | answers | mean characters | teacher P(end), mean over answers | second halves | "
        "ends per 100 characters: teacher | the model itself | answers that ended | teacher NLL of their end (nats) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]


def end_probabilities(teacher, tokenizer, prompt: dict, answers: list[str], device="cpu") -> list:
    """(answer, the teacher's P(end of turn) in place of each of its tokens after the first, its P(end of turn)
    right after the answer) per answer of at least two teacher tokens."""
    import torch

    from xtcache.chat.render import render

    end = tokenizer.eos_token_id
    prefix = tokenizer(render(tokenizer, prompt, add_generation_prompt=True), add_special_tokens=False)["input_ids"]
    out = []
    for text in answers:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) < 2:
            continue
        with torch.inference_mode():
            logits = teacher(input_ids=torch.tensor([prefix + ids], device=device)).logits[0].double()
        p_end = torch.softmax(logits, dim=-1)[:, end].cpu().numpy()
        # row j predicts token j + 1: rows of answer tokens 2..n, then the row after the answer
        out.append((text, p_end[len(prefix):len(prefix) + len(ids) - 1], float(p_end[len(prefix) + len(ids) - 1])))
    return out


def hazard_models(work: Path, seeds: list[int]) -> list[tuple[str, object, Path]]:
    """(name, seed, model directory) of the teacher and, per seed, the section's converged student and its
    continued off-policy KD and rounds' defaults rows; SystemExit naming a run that is not there."""
    from bench.quality_onpolicy_converged import ROWS, finished_run

    off = next(i for i, (_, how, _, _) in enumerate(ROWS) if how == "off")
    on = next(i for i, (_, how, flags, _) in enumerate(ROWS) if how == "on" and not flags)  # rounds' defaults
    models = [("teacher", "-", work / "chat" / "teacher")]
    for seed in seeds:
        for name, run in (("converged student", work / f"converged-s{seed}"),
                          ("continued off-policy KD", work / "runs" / f"row{off}-seed{seed}"),
                          ("on-policy rounds (rounds' defaults)", work / "runs" / f"row{on}-seed{seed}")):
            student = finished_run(run)[1]
            if student is None or not student.is_dir():
                raise SystemExit(f"{run}: no finished run there; run bench/quality.py --section on-policy-converged "
                                 "first")
            models.append((name, seed, student))
    return models


def hazard_rows(work: Path, seeds: list[int], samples: int = 4, cap: int = 103) -> list[str]:
    """The table's rows (markdown), each printed as it is measured."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from stage1_teacher.onpolicy.policy_eval import TeacherScorer, read_prompts, sample_student
    from xtcache.tokenizer import load_tokenizer

    prompts_path = str(work / "prompts-heldout.jsonl")
    models = hazard_models(work, seeds)
    scorer = TeacherScorer(str(models[0][2]))  # the live teacher as policy-eval loads it
    table = []
    try:
        for name, seed, path in models:
            tok = load_tokenizer(str(path), "model tokenizer")
            prompts = read_prompts(prompts_path, tok)
            completions, texts = sample_student(str(path), tok, prompts, samples_per_prompt=samples,
                                                max_new_tokens=cap, seed=1)
            model = scorer.model if name == "teacher" else AutoModelForCausalLM.from_pretrained(
                str(path), torch_dtype=torch.float32).eval()
            per, second, chars, teacher_rate, own_rate, end_nll = [], [], [], [], [], []
            for prompt, comps, answers in zip(prompts, completions, texts):
                stopped = {text: c.stop_reason == "stop" for c, text in zip(comps, answers)}
                own = {text: p for text, p, _ in end_probabilities(model, tok, prompt.conversation, answers)}
                for text, p, last in end_probabilities(scorer.model, scorer.tokenizer, prompt.conversation, answers,
                                                       scorer.device):
                    if text not in own:  # one student token: no end probability after its first
                        continue
                    per.append(p.mean())
                    second.append(p[len(p) // 2:].mean())
                    chars.append(len(text))
                    teacher_rate.append(100 * p.sum() / len(text))
                    own_rate.append(100 * own[text].sum() / len(text))
                    if stopped[text]:
                        end_nll.append(-np.log(max(last, 1e-30)))
            table.append(f"| {name} | {seed} | {len(per)} | {np.mean(chars):.1f} | {np.mean(per):.4f} | "
                         f"{np.mean(second):.4f} | {np.mean(teacher_rate):.3f} | {np.mean(own_rate):.3f} | "
                         f"{len(end_nll)} | {np.mean(end_nll):.2f} |")
            print(table[-1], flush=True)
    finally:
        scorer.close()
    return table


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", required=True, help="the chat work directory of the on-policy-converged section")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--write-docs", action="store_true", help="replace docs/on-policy.md's onpolicy-end-hazard block")
    args = p.parse_args()
    from xtcache.app.docblock import require_blocks, write_block

    if args.write_docs:
        require_blocks(REPO, DOC_BLOCKS)
    print("\n".join(HEAD))
    rows = hazard_rows(Path(args.workdir), [int(s) for s in args.seeds.split(",")])
    if args.write_docs:
        write_block(REPO / DOC_BLOCKS["onpolicy-end-hazard"], "onpolicy-end-hazard", "\n".join([*HEAD, *rows]))


if __name__ == "__main__":
    main()
