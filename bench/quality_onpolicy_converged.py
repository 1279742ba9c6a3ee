"""The converged section of the quality bench (issue 38): on-policy rounds against continued off-policy KD,
from a converged off-policy student, at equal optimizer steps and (about) equal teacher-scored tokens.

    python bench/quality.py --section on-policy-converged     # both kinds, 3 seeds: about 75 min on 2 CPU cores
    python bench/quality.py --section on-policy-converged --rows 2    # continued KD and ROWS[2] only
    python bench/quality.py --section on-policy-converged --from-report R.json --add-rows --workdir W
        # R's runs (trained in W) kept: graded again where the sample count changed, only the rows R lacks trained

Two setups, each cross-tokenizer, each stage an `xtcache` subprocess as a user runs it:
- chat: the ChatML-style Qwen2 teacher of `xtcache.testing.chat.build_chat_setup` pre-trained on 560
  conversations, a fresh Llama-3-style student with its own tokenizer; prompts are conversations cut after
  their last user message, and every student trains and is measured on the last assistant turn;
- text: the tests' toy teacher and student (`xtcache.testing.suite`: Python sources, two BPE tokenizers);
  prompts are text prefixes (a document's first lines), the off-policy rows are prefix + the document's next
  lines (`prefix_chars`), and only the completion trains (`--train-on last-assistant`).
With `--teacher real` (REAL_TEACHER) both kinds run on the real tier: the SmolLM2-135M-Instruct teacher, a fresh
student on the Llama-3 vocabulary, text prefixes of its documentation corpus and conversations about it
(`xtcache.testing.real.doc_conversations`).

Per seed: off-policy KD (`--loss auto`, the defaults) for `converge_steps` on the converge cache to the end
of its cosine schedule: the converged student. From it, each row trains `steps` more optimizer steps, a
fresh optimizer at a constant `lr` after 2 warmup steps:

| row | what it trains on |
| --- | --- |
| continued off-policy KD | the teacher's top-k cache of unseen training turns (text: prefix + next lines), `--loss auto` |
| continued off-policy KD, the rounds' objective | the same cache, forward P-KL + 0.1 CE (chat) |
| on-policy rounds, forward P-KL + 0.1 CE | `xtcache rounds --loss forward`, 2 rounds of steps/2: its own samples for P training prompts, scored by the teacher |
| others | `xtcache rounds` with the row's flags |

The continuation rows are sized so that their trained teacher tokens are about those of the rounds'
rollouts (the table gives both); the chat-only rows vary one setting of the rounds each (ROWS), the mixed
ones training half their micro-batches on the continuation conversations (half the cache under the rounds'
objective, or with `--corpus-loss ce` CE alone on the whole cache's text). Measures: `xtcache policy-eval` on
held-out prompts (conversations 32 x 36 samples, text 32 x 12; its default cap,
twice the teacher's mean sample length; the same seed for every row, so each row's samples are drawn
with the same generators): reverse KL per sequence and teacher NLL per byte of the student's own
samples, and the held-out KL (train-student's `--eval-cache`: the teacher's full distribution on
held-out turns or completions). A row beats continued off-policy KD on a measure when it is better on
every seed and the mean paired difference exceeds its standard deviation; the held-out KL is within the
spread when |mean difference| <= the two rows' standard deviations added (and said to be lower or higher
beyond it otherwise). The rounds' defaults are also compared with continued KD on their own objective
(SAME_OBJECTIVE).
"""

from __future__ import annotations

import json
import logging
import shutil
import statistics
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from bench.quality_onpolicy import dump_caches, mean_pm, run_xtcache, trained_positions
from xtcache.app.docblock import run_record

log = logging.getLogger("bench.quality.on-policy-converged")
KINDS = ("chat", "text")


@dataclass(frozen=True)
class ConvergedSettings:
    converge_steps: int = 150  # off-policy KD to the end of its cosine schedule
    converge_lr: float = 3e-3
    steps: int = 16  # each row after the converged student (rounds: 2 x steps / 2)
    lr: float = 1e-4  # constant after 2 warmup steps (train-student's default peak rate)
    prompts: int = 24  # training prompts of the rounds, sampled in both rounds
    samples_per_prompt: int = 2
    max_new_tokens: int = 64
    eval_prompts: int = 32
    # 1,152 samples per student (about 20 s on 2 CPU cores, 10 s once the teacher's own are drawn): at 384 one
    # student's NLL/byte moved by up to 0.05 between draw seeds, more than most rows' leads
    chat_eval_samples: int = 36
    text_eval_samples: int = 12  # 384 (text samples run to about 420 tokens: about 4 min a student)
    top_k: int = 16
    seeds: int = 3
    chat_train: int = 560  # conversations: prompts, converge, continue
    chat_continue: int = 78  # continuation conversations (about the rounds' rollout tokens)
    text_continue: int = 100  # continuation prefix + completion rows (about 60 student tokens each)
    chat_teacher_hidden: int = 64  # the chat teacher (2 layers, the student's size at 64)
    chat_teacher_steps: int = 150  # its pre-training steps on the chat corpus
    same_tokenizer: bool = False  # a student of the teacher's tokenizer (and chat template): no projection
    real_teacher: bool = False  # text kind: SmolLM2-135M-Instruct and a student on the Llama-3 vocabulary
    # policy-eval's cap of each kind; 0: twice the teacher's mean length (its own samples, up to 512)
    chat_eval_max_new_tokens: int = 0
    text_eval_max_new_tokens: int = 0


# `--section on-policy-converged-stronger`: a chat teacher twice the student's width, pre-trained longer
STRONGER_CHAT_TEACHER = {"chat_teacher_hidden": 128, "chat_teacher_steps": 400}
# `--section on-policy-converged-same`: students of the teacher's tokenizer (and the chat student its chat template)
SAME_TOKENIZER = {"same_tokenizer": True}
# `--section on-policy-converged --teacher real`: the real tier (xtcache.testing.real), the trained
# SmolLM2-135M-Instruct teacher (49,152 ids) and a fresh 2-layer Llama on the Llama-3 vocabulary (128,256 ids), on
# text prefixes of its documentation corpus and on conversations about it (real.doc_conversations); a student step
# there costs about 3x the toy's and a teacher forward about 20x, so fewer steps to convergence (80) and fewer
# graded samples (16 held-out prompts x 12: 192). Text prefixes: a fixed cap of 96 tokens (continuing
# documentation, the teacher rarely stops: its own samples would run to the 512 of the probe, and each student's to
# twice that); conversations: twice the teacher's mean answer length
REAL_TEACHER = {"real_teacher": True, "converge_steps": 80, "eval_prompts": 16, "chat_eval_samples": 12,
                "text_eval_max_new_tokens": 96}
QUICK = ConvergedSettings(converge_steps=20, steps=4, prompts=6, eval_prompts=6, chat_eval_samples=1,
                          text_eval_samples=1, seeds=1, chat_train=120, chat_continue=12, text_continue=12)
EVAL_SETTINGS = ("eval_prompts", "chat_eval_samples", "text_eval_samples", "eval_samples", "chat_eval_max_new_tokens",
                 "text_eval_max_new_tokens", "eval_max_new_tokens")  # measure, not train (the last: both kinds' cap)

# name, kind, `xtcache rounds` flags (on-policy rows; each row's flags after `--` go to train-student; its
# --rounds, --steps-per-round and --samples-per-prompt replace the section's), the kinds it runs on. Rows are
# appended, never reordered: a row's runs live in runs/row{index}-seed{seed} of the work directory.
ROWS = [
    ("continued off-policy KD (train-student defaults)", "off", [], KINDS),
    ("on-policy rounds, reverse P-KL, no CE", "on", ["--loss", "reverse", "--", "--ce-weight", "0.0"], KINDS),
    # the forward KL + 0.1 CE, rounds' only default until it came to pick the reverse KL without CE for one tokenizer
    # on conversations (row 1 there), pinned
    ("on-policy rounds, forward P-KL + 0.1 CE (rounds' default across tokenizers until 2026-12-01)", "on", ["--loss", "forward"], KINDS),
    # train-student's cross-tokenizer defaults of the time, pinned since the defaults moved to the half-and-half mix;
    # the "(defaults)" rows below pin rounds' forward KL + 0.1 CE, its only default when they ran
    ("on-policy rounds, `--loss auto` (0.25 forward + 0.75 reverse P-KL, CE 0.5)", "on",
     ["--loss", "auto", "--", "--pkl-divergence", "forward-reverse", "--pkl-reverse-weight", "0.75", "--ce-weight", "0.5"],
     KINDS),
    ("on-policy rounds (defaults), full-vocabulary teacher caches", "on",
     ["--loss", "forward", "--dump-args", "--mode full"], ("chat",)),
    ("on-policy rounds (defaults), 4 rounds of 4 steps, 1 sample a prompt", "on",
     ["--loss", "forward", "--rounds", "4", "--steps-per-round", "4", "--samples-per-prompt", "1"], KINDS),
    # GKD's lambda: half the micro-batches from half the continuation cache, half the rollouts (1 sample a prompt)
    ("on-policy rounds (defaults), 1 sample a prompt, mixed 1:1 with half the continuation cache", "on",
     ["--loss", "forward", "--samples-per-prompt", "1", "--corpus-cache", "{continue_half_cache}", "--",
      "--corpus-loss", "kd"],
     ("chat",)),
    # as many rollouts from twice the prompts: the rounds' 24 and the first 24 continuation conversations' prompts
    ("on-policy rounds (defaults), 48 prompts x 1 sample", "on",
     ["--loss", "forward", "--prompts", "{wide_prompts}", "--samples-per-prompt", "1"], ("chat",)),
    ("on-policy rounds, generalized JSD (beta 0.5) + 0.1 CE", "on", ["--loss", "pkl", "--", "--pkl-divergence", "jsd"],
     KINDS),
    # rollouts drawn at temperature 0.7 (policy-eval still samples at 1): text the teacher finds likelier to go on
    ("on-policy rounds (defaults), rollouts at temperature 0.7", "on", ["--loss", "forward", "--temperature", "0.7"],
     ("chat",)),
    # the rounds' caches at the corpus caches' k (the other rows: teacher-dump's default, top-64)
    ("on-policy rounds (defaults), top-16 rollout caches", "on", ["--loss", "forward", "--dump-args", "--top-k 16"],
     KINDS),
    # the sampled reverse KL of each chunk's text (policy gradient, train-student's ratio cap 2): the student's own
    # probability of the tokens it sampled, not its distribution projected onto the teacher's pieces
    ("on-policy rounds, `--loss rkl-pg` + 0.1 CE", "on", ["--loss", "rkl-pg"], KINDS),
    # the off-policy arm on the rounds' own objective: what the corpus adds at the same loss (row 0: train-student's
    # defaults, whose CE weight across tokenizers is 0.5)
    ("continued off-policy KD, the rounds' objective (forward P-KL + 0.1 CE)", "off",
     ["--loss", "pkl", "--pkl-divergence", "forward", "--ce-weight", "0.1"], ("chat",)),
    # half the micro-batches CE alone on the continuation conversations' text (no teacher values read: only the
    # rollouts count as teacher-scored), half the rounds' defaults on the rollouts
    ("on-policy rounds (defaults), mixed 1:1 with CE on the continuation text (`--corpus-loss ce`)", "on",
     ["--loss", "forward", "--corpus-cache", "{continue_cache}"], KINDS),
    # the same mix with the generalized JSD (beta 0.5) + 0.1 CE on the rollouts (row 8's objective)
    ("on-policy rounds, generalized JSD (beta 0.5) + 0.1 CE, mixed 1:1 with CE on the continuation text "
     "(`--corpus-loss ce`)", "on",
     ["--loss", "jsd", "--corpus-cache", "{continue_cache}"], ("chat",)),
    # the same JSD on the rollouts, half the micro-batches KD (the run's objective) on the cache the converged student
    # was distilled from: its teacher values were paid for before the row starts, so no new teacher tokens beside
    # the rollouts (the teacher-scored tokens count the rollouts alone). Conversations only: the text kind's converge
    # cache holds whole documents, without the roles that --train-on last-assistant trains by (train-student refuses it)
    ("on-policy rounds, generalized JSD (beta 0.5) + 0.1 CE, mixed 1:1 with KD on the converge cache "
     "(`--corpus-loss kd`)", "on",
     ["--loss", "jsd", "--corpus-cache", "{converge_cache}", "--", "--corpus-loss", "kd"], ("chat",)),
    # row 8 from the first 7/8 of the kind's prompts: on the real teacher's text prefixes, whose samples run to the
    # cap, the rounds' 21 prompts' rollouts are 12% more teacher-scored tokens than continued KD's cache, 18's 4% fewer
    ("on-policy rounds, generalized JSD (beta 0.5) + 0.1 CE, 7/8 of the prompts", "on",
     ["--loss", "jsd", "--prompts", "{fewer_prompts}"], ("text",)),
    # row 15 with a quarter of the micro-batches from the rollouts, three quarters KD on the converge cache
    ("on-policy rounds, generalized JSD (beta 0.5) + 0.1 CE, mixed 1:3 with KD on the converge cache "
     "(`--corpus-loss kd`, `--rollout-fraction 0.25`)", "on",
     ["--loss", "jsd", "--corpus-cache", "{converge_cache}", "--", "--corpus-loss", "kd", "--rollout-fraction", "0.25"],
     ("chat",)),
    # row 15 at train-student's cross-tokenizer CE weight (0.5, continued KD's) on both halves
    ("on-policy rounds, generalized JSD (beta 0.5) + 0.5 CE, mixed 1:1 with KD on the converge cache "
     "(`--corpus-loss kd`)", "on",
     ["--loss", "jsd", "--corpus-cache", "{converge_cache}", "--", "--corpus-loss", "kd", "--ce-weight", "0.5"],
     ("chat",)),
    # rows 17 and 15 with the converge cache's micro-batches on train-student's off-policy defaults (the objective
    # the students converged on and continued KD trains), the rollouts' on the JSD + 0.1 CE
    ("on-policy rounds, generalized JSD (beta 0.5) + 0.1 CE, mixed 1:3 with train-student's defaults on the converge "
     "cache (`--corpus-loss auto`, `--rollout-fraction 0.25`)", "on",
     ["--loss", "jsd", "--corpus-cache", "{converge_cache}", "--", "--corpus-loss", "auto", "--rollout-fraction",
      "0.25"], ("chat",)),
    ("on-policy rounds, generalized JSD (beta 0.5) + 0.1 CE, mixed 1:1 with train-student's defaults on the converge "
     "cache (`--corpus-loss auto`)", "on",
     ["--loss", "jsd", "--corpus-cache", "{converge_cache}", "--", "--corpus-loss", "auto"], ("chat",)),
    # the batch of an optimizer step, at the same rollouts and steps (so the same teacher-scored tokens): row 8 with
    # 2 windows a step (each rollout read about half as often) and with 8 (--grad-accum 2: twice as often)
    ("on-policy rounds, generalized JSD (beta 0.5) + 0.1 CE, 2 windows a step", "on",
     ["--loss", "jsd", "--", "--micro-batch-size", "2"], KINDS),
    ("on-policy rounds, generalized JSD (beta 0.5) + 0.1 CE, 8 windows a step (`--grad-accum 2`)", "on",
     ["--loss", "jsd", "--", "--grad-accum", "2"], KINDS),
]
# on-policy rows also compared with the continued off-policy row of their own objective
SAME_OBJECTIVE = {ROWS[2][0]: ROWS[12][0]}
MEASURES = (("reverse_kl_per_sequence", "reverse KL/sequence"), ("teacher_nll_per_byte", "teacher NLL/byte"))


def _setup(kind: str, work: Path, s: ConvergedSettings):
    from xtcache.testing import toy
    from xtcache.testing.chat import build_chat_setup
    from xtcache.testing.suite import TEST_CACHE, TEST_SPEC

    if s.real_teacher:
        return _real_setup(kind, work, s)

    base = toy.build_toy_setup(TEST_CACHE, TEST_SPEC)
    setup = base if kind == "text" else build_chat_setup(
        base, work / "chat", num_train=s.chat_train, num_heldout=s.eval_prompts, teacher_steps=s.chat_teacher_steps,
        teacher_hidden=s.chat_teacher_hidden)
    if not s.same_tokenizer:
        return setup
    # the kind's fresh student (2-layer Llama of hidden size 64, its seed) on the teacher's tokenizer
    student = work / "student-same"

    def build() -> str:
        toy.build_tiny_model("llama", setup.teacher_tokenizer, student, hidden=64, layers=2, intermediate=192, seed=1)
        return "llama, hidden 64, 2 layers, seed 1, the teacher's tokenizer"

    toy.build_once(student, build)
    return replace(setup, student_model=student, student_tokenizer=setup.teacher_tokenizer)


def _real_setup(kind: str, work: Path, s: ConvergedSettings):
    """The real tier's setup: the SmolLM2 teacher and the kind's fresh student (a 2-layer Llama of hidden size 64,
    seed 1) on the Llama-3 vocabulary with its Llama-3-style template, built once; text: the documentation corpus
    (train and held-out topics); chat: conversations about it (`real.doc_conversations`), `chat_train` of the train
    topics' and twice `eval_prompts` of the held-out topics' (a fixed shuffle)."""
    import random

    from xtcache.testing import real, toy
    from xtcache.testing.chat import write_chat_jsonl

    models = real.build_real_models()
    student = work / "student-real"

    def build() -> str:
        toy.build_tiny_model("llama", models.llama3_tokenizer, student, hidden=64, layers=2, intermediate=192, seed=1)
        return "llama, hidden 64, 2 layers, seed 1, the Llama-3 vocabulary"

    toy.build_once(student, build)
    train, heldout = models.train_jsonl, models.heldout_jsonl
    if kind == "chat":
        picked = []
        for held, n in ((False, s.chat_train), (True, 2 * s.eval_prompts)):
            rows = real.doc_conversations(heldout=held)
            random.Random(0).shuffle(rows)
            picked.append(write_chat_jsonl(work / f"real-chat-{'heldout' if held else 'train'}.jsonl", rows[:n]))
        train, heldout = picked
    return toy.ToySetup(root=models.root, train_jsonl=train, heldout_jsonl=heldout,
                        teacher_tokenizer=models.teacher, student_tokenizer=models.llama3_tokenizer,
                        teacher_model=models.teacher, student_model=student)


def projection_flags(p: dict) -> list[str]:
    """train-student's (and rounds') `--projection` of a kind, none for a student of the teacher's tokenizer."""
    return [] if p["projection"] is None else ["--projection", str(p["projection"])]


def _line_end(text: str, at: int) -> int:
    """The end of the line that reaches character `at`."""
    nl = text.find("\n", at)
    return len(text) if nl < 0 else nl + 1


def text_rows(docs: list[str], *, prefix: int = 240, completion: int = 180) -> list[dict]:
    """Prefix + completion rows cut from documents at characters 0, 400 and 800: the prefix runs to the end of
    the line that reaches `prefix` characters, the completion the lines after it up to `completion` more
    (`prefix_chars` marks the prompt: only the completion trains). A piece too short for either is skipped."""
    rows = []
    for d in docs:
        for o in (0, 400, 800):
            a = _line_end(d, o + prefix)
            b = _line_end(d, a + completion)
            if b - a >= completion // 2 and a - o >= prefix // 2:
                rows.append({"text": d[o:b], "prefix_chars": a - o})
    return rows


def wide_prompt_rows(rows: int, prompts: int, cont: int) -> list[int]:
    """The chat rows whose prompts a wide row samples: the rounds' `prompts` (the first rows) and as many of the
    continuation conversations (the last `cont`): none of the rows the students converged on."""
    return [*range(prompts), *range(rows - cont, rows - cont + min(prompts, cont))]


def prepare(kind: str, work: Path, s: ConvergedSettings, log_file: Path) -> dict:
    """One kind's prompts, caches (converge, continue, held-out full) and projection (seed-independent)."""
    from xtcache.testing.chat import write_chat_jsonl, write_prompts

    work.mkdir(parents=True, exist_ok=True)
    setup = _setup(kind, work, s)
    projection = None if s.same_tokenizer else work / "projection.safetensors"
    p = {"setup": setup, "kind": kind, "projection": projection, "eval_cache": work / "cache-heldout",
         "converge_cache": work / "cache-converge", "continue_cache": work / "cache-continue",
         "continue_half_cache": work / "cache-continue-half"}
    if kind == "chat":
        rows = [json.loads(x) for x in setup.train_jsonl.read_text().splitlines()]
        n, c = s.prompts, s.chat_continue
        p["train_prompts"] = write_prompts(rows, work / "prompts-train.jsonl", range(n))
        p["eval_prompts"] = write_prompts(setup.heldout_jsonl, work / "prompts-heldout.jsonl", range(s.eval_prompts))
        converge = write_chat_jsonl(work / "converge.jsonl", rows[n:len(rows) - c])
        cont_rows = rows[len(rows) - c:]
        cont = write_chat_jsonl(work / "continue.jsonl", cont_rows)
        p["wide_prompts"] = write_prompts(rows, work / "prompts-train-wide.jsonl", wide_prompt_rows(len(rows), n, c))
        heldout = setup.heldout_jsonl
    else:
        docs = [json.loads(x)["text"] for x in setup.train_jsonl.read_text().splitlines()]
        held = text_rows([json.loads(x)["text"] for x in setup.heldout_jsonl.read_text().splitlines()])
        first = -(-s.prompts // 3)  # documents whose prefixes are the prompts (3 a document)
        p["train_prompts"] = write_chat_jsonl(work / "prompts-train.jsonl", [
            {"text": r["text"][:r["prefix_chars"]]} for r in text_rows(docs[:first])][:s.prompts])
        p["eval_prompts"] = write_chat_jsonl(work / "prompts-heldout.jsonl", [
            {"text": r["text"][:r["prefix_chars"]]} for r in held[:s.eval_prompts]])
        cont_rows = text_rows(docs[len(docs) - 40:])[:s.text_continue]
        converge = write_chat_jsonl(work / "converge.jsonl", [{"text": d} for d in docs[first:len(docs) - 40]])
        cont = write_chat_jsonl(work / "continue.jsonl", cont_rows)
        heldout = write_chat_jsonl(work / "heldout.jsonl", held[:s.eval_prompts])
    prompts = [json.loads(x) for x in Path(p["train_prompts"]).read_text().splitlines()]
    p["fewer_prompts"] = write_chat_jsonl(work / "prompts-train-fewer.jsonl", prompts[:len(prompts) * 7 // 8])
    topk = ["--mode", "topk", "--top-k", str(s.top_k)]
    dumps = [(converge, p["converge_cache"], topk), (cont, p["continue_cache"], topk),
             (heldout, p["eval_cache"], ["--mode", "full"])]
    if any("{continue_half_cache}" in flags for _, _, flags, on in ROWS if kind in on):  # a mixed row's corpus
        half = write_chat_jsonl(work / "continue-half.jsonl", cont_rows[:len(cont_rows) // 2])
        dumps.append((half, p["continue_half_cache"], topk))
    dump_caches(setup, dumps, p["projection"], log_file)
    p["continue_positions"] = trained_positions(p["continue_cache"])
    return p


def _flags(lr: float, warmup: int, min_lr_ratio: float) -> list[str]:
    return ["--seq-len", "256", "--micro-batch-size", "4", "--lr", str(lr), "--warmup-steps", str(warmup),
            "--min-lr-ratio", str(min_lr_ratio), "--zero-stage", "0", "--eval-every", "1000"]


def converge(p: dict, out: Path, s: ConvergedSettings, seed: int, log_file: Path) -> dict:
    """Off-policy KD to the end of its schedule (reused when its summary exists); its summary."""
    if not (out / "summary.json").exists():
        shutil.rmtree(out, ignore_errors=True)
        train_on = "last-assistant" if p["kind"] == "chat" else "all"  # text: whole documents
        run_xtcache("train-student", "--cache", str(p["converge_cache"]), "--eval-cache", str(p["eval_cache"]),
                    "--student", str(p["setup"].student_model), "--out", str(out), *projection_flags(p),
                    "--max-steps", str(s.converge_steps), "--train-on", train_on, "--seed", str(seed), "--loss", "auto",
                    *_flags(s.converge_lr, 5, 0.1), log_file=log_file)
    return json.loads((out / "summary.json").read_text())


def off_policy(p: dict, start: Path, out: Path, s: ConvergedSettings, seed: int, flags: list[str],
               log_file: Path) -> dict:
    """train-student on the continuation cache from the converged student: its defaults (`--loss auto`), or the
    row's loss flags."""
    shutil.rmtree(out, ignore_errors=True)
    run_xtcache("train-student", "--cache", str(p["continue_cache"]), "--eval-cache", str(p["eval_cache"]), "--student",
                str(start), "--out", str(out), *projection_flags(p), "--max-steps", str(s.steps),
                "--train-on", "last-assistant", "--seed", str(seed), *(flags or ["--loss", "auto"]),
                *_flags(s.lr, 2, 1.0), log_file=log_file)
    summary = json.loads((out / "summary.json").read_text())
    return {"hf": out / "hf", "heldout_kl": summary.get("final_eval_kl"), "start_kl": summary.get("initial_eval_kl"),
            "teacher_positions": p["continue_positions"]}


def split_row_flags(flags: list[str]) -> tuple[list[str], list[str]]:
    """A row's flags: (its `xtcache rounds` flags, train-student's flags after `--`)."""
    return (flags[:flags.index("--")], flags[flags.index("--") + 1:]) if "--" in flags else (flags, [])


def filled(p: dict, arg: str) -> str:
    """A row's argument, a value in braces standing for the path of that key of `p` (a kind's file)."""
    return str(p[arg[1:-1]]) if arg.startswith("{") else arg


def rounds_plan(p: dict, s: ConvergedSettings, own: list[str]) -> list[str]:
    """`xtcache rounds` flags of a row: the section's rounds, steps a round and samples a prompt, each replaced
    by the row's own value where it gives one (a value in braces: the path of that key of `p`), then the row's
    other flags ((flag, value) pairs)."""
    plan = {"--prompts": str(p["train_prompts"]), "--rounds": "2", "--steps-per-round": str(s.steps // 2),
            "--samples-per-prompt": str(s.samples_per_prompt)}
    rest = []
    for flag, value in zip(own[::2], own[1::2], strict=True):
        value = filled(p, value)
        if flag in plan:
            plan[flag] = value
        else:
            rest += [flag, value]
    return [x for kv in plan.items() for x in kv] + rest


def on_policy(p: dict, start: Path, out: Path, s: ConvergedSettings, seed: int, flags: list[str],
              log_file: Path) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    own, train = split_row_flags(flags)
    # its corpus (rounds' --corpus-cache: a cache of the section's, named by its key in braces) counts when its teacher
    # values train (rounds mixes it with --corpus-loss ce unless the train-student flags say kd or auto)
    corpus = filled(p, own[own.index("--corpus-cache") + 1]) if "--corpus-cache" in own else None
    mixed = corpus is not None and "ce" != (train[train.index("--corpus-loss") + 1] if "--corpus-loss" in train else "ce")
    train = [filled(p, a) for a in train]
    run_xtcache("rounds", "--student", str(start), "--teacher", str(p["setup"].teacher_model),
                "--workdir", str(out), "--engine", "hf", *rounds_plan(p, s, own),
                "--max-new-tokens", str(s.max_new_tokens), "--seed", str(seed), "--train-on", "last-assistant",
                *projection_flags(p), "--eval-cache", str(p["eval_cache"]), "--",
                *_flags(s.lr, 2, 1.0), *train, log_file=log_file)
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    positions = sum(trained_positions(out / f"round-{m['round']:03d}" / "cache") for m in metrics)
    if mixed and Path(corpus) != Path(p["converge_cache"]):  # the corpus cache counted whole: at most what the rounds read
        positions += trained_positions(Path(corpus))  # of it (--corpus-loss ce: none; the converge cache: scored before)
    return {"hf": Path(metrics[-1]["hf_dir"]), "heldout_kl": metrics[-1].get("final_eval_kl"),
            "teacher_positions": positions, "staleness": [m.get("stale_mean_abs_log_ratio") for m in metrics],
            "retokenized": [m.get("retokenized_turns") for m in metrics]}


def eval_samples(kind: str, s: ConvergedSettings) -> int:
    return s.chat_eval_samples if kind == "chat" else s.text_eval_samples


def eval_cap(kind: str, s: dict) -> int:
    """policy-eval's cap of a kind (0: twice the teacher's mean length) from a report's settings; reports written
    before the kinds had caps of their own give one cap for both (`eval_max_new_tokens`)."""
    return s.get("eval_max_new_tokens") or s.get(f"{kind}_eval_max_new_tokens", 0)


def measure(p: dict, student: Path, s: ConvergedSettings) -> dict:
    from stage1_teacher.onpolicy.policy_eval import policy_eval

    report, _ = policy_eval(str(student), str(p["setup"].teacher_model), str(p["eval_prompts"]),
                            samples_per_prompt=eval_samples(p["kind"], s), max_new_tokens=eval_cap(p["kind"], asdict(s)),
                            seed=0)
    return {k: report[k] for k in ("reverse_kl_per_sequence", "reverse_kl_per_token", "teacher_nll_per_byte",
                                   "teacher_nll_per_token", "mean_student_tokens", "stopped_fraction",
                                   "teacher_mean_student_tokens", "max_new_tokens", "samples",
                                   "teacher_nll_per_byte_se", "teacher_self_nll_per_byte")}


def finished_run(run: Path) -> tuple[float | None, Path | None]:
    """(the held-out KL a finished run recorded last, its student; None where not recorded): train-student's
    summary and export, or the last round of `xtcache rounds` (its metrics.jsonl)."""
    if (run / "summary.json").exists():
        return json.loads((run / "summary.json").read_text()).get("final_eval_kl"), run / "hf"
    metrics = run / "metrics.jsonl"
    rounds = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()] if metrics.exists() else []
    if not rounds:
        return None, None
    last = rounds[-1]
    return last.get("final_eval_kl"), Path(last["hf_dir"]) if "hf_dir" in last else None


def _remeasure(p: dict, row: dict, run: Path, kl_key: str, s: ConvergedSettings) -> dict:
    """An earlier report's row measured again from its student in the work directory: refused unless that run
    is the row's (the held-out KL it recorded is the report's)."""
    kl, student = finished_run(run)
    if kl is None or student is None or row.get(kl_key) is None or abs(kl - row[kl_key]) > 1e-9:
        raise SystemExit(f"{run}: not the run of the report's row (held-out KL {kl} against {row.get(kl_key)}): "
                         "give the --workdir of the report's run")
    return {**row, **measure(p, student, s)}


# settings added after reports were written, with the values those reports were trained with
LATER_SETTINGS = {"chat_teacher_hidden": 64, "chat_teacher_steps": 150, "same_tokenizer": False, "real_teacher": False}


def _train_settings(settings: dict) -> dict:
    return {k: v for k, v in {**LATER_SETTINGS, **settings}.items() if k not in EVAL_SETTINGS}


def run_converged(work: Path, s: ConvergedSettings, kinds=KINDS, *, base: dict | None = None,
                  save: Path | None = None, only: set[int] | None = None) -> dict:
    """Every kind, seed and row; the report (per-seed values), written to `save` after every run. With `base` (an
    earlier report of the same training settings, its runs in `work`): its rows are kept, measured again where
    their sample count is not this run's, and only the rows it lacks train. `only`: the indices of the ROWS that
    run (continued off-policy KD, row 0, always: the rows are compared with it); a base report's rows are kept."""
    if only is not None and not only <= set(range(len(ROWS))):
        raise SystemExit(f"--rows {','.join(map(str, sorted(only)))}: the rows are 0 to {len(ROWS) - 1}")
    if base and _train_settings(base["settings"]) != _train_settings(asdict(s)):
        raise SystemExit("--add-rows: the report was trained with other settings than these")
    report = {"settings": asdict(s), "kinds": {}, "wall_s": (base or {}).get("wall_s", 0.0),
              "measured": [*(base or {}).get("measured", []), run_record()]}  # the runs that made the report
    if base:  # the wall time of each run that made the report: the first, then each --add-rows
        report["runs_s"] = [*(base.get("runs_s") or [base.get("wall_s", 0.0)]), 0.0]
    earlier = {kind: {name: {r["seed"]: r for r in runs} for name, runs in rows.items()}
               for kind, rows in (base or {}).get("kinds", {}).items()}
    for kind in kinds:
        kw = work / kind
        log_file = kw / "commands.log"
        kw.mkdir(parents=True, exist_ok=True)
        t = time.perf_counter()
        p = prepare(kind, kw, s, log_file)
        # the rounds' prompts as written (text: the prefixes of the first documents, fewer where pieces are too short)
        report.setdefault("train_prompts", {})[kind] = len(Path(p["train_prompts"]).read_text().splitlines())
        n = eval_samples(kind, s) * s.eval_prompts
        had = earlier.get(kind, {})
        chosen = [i for i, (name, _, _, on) in enumerate(ROWS)
                  if kind in on and (only is None or i == 0 or i in only or name in had)]
        rows = report["kinds"][kind] = {"converged student": [], **{ROWS[i][0]: [] for i in chosen}}
        for seed in range(s.seeds):
            conv = converge(p, kw / f"converged-s{seed}", s, seed, log_file)
            start = kw / f"converged-s{seed}" / "hf"
            old = had.get("converged student", {}).get(seed)
            if old is None:
                rows["converged student"].append({"seed": seed, "converge_kl": conv.get("final_eval_kl"),
                                                  **measure(p, start, s)})
            else:
                rows["converged student"].append(old if old["samples"] == n else _remeasure(
                    p, old, kw / f"converged-s{seed}", "converge_kl", s))
            for i, (name, how, flags, _) in enumerate(ROWS):
                if i not in chosen:
                    continue
                out = kw / "runs" / f"row{i}-seed{seed}"
                old = had.get(name, {}).get(seed)
                if old is not None:
                    rows[name].append(old if old["samples"] == n else _remeasure(p, old, out, "heldout_kl", s))
                else:
                    log.info("%s seed %d: %s", kind, seed, name)
                    r = off_policy(p, start, out, s, seed, flags, log_file) if how == "off" else \
                        on_policy(p, start, out, s, seed, flags, log_file)
                    rows[name].append({"seed": seed, **{k: v for k, v in r.items() if k != "hf"},
                                       **measure(p, r["hf"], s)})
                    if "start_kl" in r:  # the converged student on the rows' measure (text converged on documents)
                        rows["converged student"][-1]["heldout_kl"] = r["start_kl"]
                dt, t = time.perf_counter() - t, time.perf_counter()
                report["wall_s"] += dt
                if base:
                    report["runs_s"][-1] += dt
                if save:
                    save.write_text(json.dumps(report, indent=2, default=str))
    return report


def verdicts(rows: dict) -> list[str]:
    """Each on-policy row against continued off-policy KD (train-student's defaults), then against the continued
    row of its own objective where the table has one (SAME_OBJECTIVE), paired by seed."""
    off = {name for name, how, _, _ in ROWS if how == "off"}
    pairs = [(name, ROWS[0][0]) for name in rows if name not in off and name != "converged student"]
    pairs += [(name, SAME_OBJECTIVE[name]) for name in rows if SAME_OBJECTIVE.get(name) in rows]
    return [_verdict(name, rows[name], base, rows[base]) for name, base in pairs if len(rows[name]) >= 2]


def _verdict(name: str, runs: list[dict], base_name: str, base_runs: list[dict]) -> str:
    """One row against another, paired by seed: each measure's mean difference and its verdict."""
    base = {r["seed"]: r for r in base_runs}
    parts, won = [], []
    for key, label in MEASURES:
        d = [r[key] - base[r["seed"]][key] for r in runs]
        mean, sd = statistics.fmean(d), statistics.stdev(d)
        better = sum(x < 0 for x in d)
        parts.append(f"{label} {mean:+.3f} (sd {sd:.3f}, lower on {better}/{len(d)} seeds)")
        if better == len(d) and -mean > sd:
            won.append(label)
    for key, label, fmt in (("reverse_kl_per_token", "(beside them) reverse KL/token", ".3f"),
                            ("mean_student_tokens", "sample length", ".1f")):
        d = [r[key] - base[r["seed"]][key] for r in runs]
        parts.append(f"{label} {statistics.fmean(d):+{fmt}} (sd {statistics.stdev(d):{fmt}})")
    a = [r["heldout_kl"] for r in runs]
    b = [r["heldout_kl"] for r in base_runs]
    gap = statistics.fmean(a) - statistics.fmean(b)
    spread = statistics.stdev(a) + statistics.stdev(b)
    kl = "within the spread" if abs(gap) <= spread else "lower beyond the spread" if gap < 0 else \
        "higher beyond the spread"
    parts.append(f"held-out KL {gap:+.4f} ({kl}: the spread is {spread:.4f})")
    verdict = (f"beats it on {' and '.join(won)}" if won else "beats it on neither") + f", held-out KL {kl}"
    return f"- {name} vs {base_name}, paired by seed: " + "; ".join(parts) + f": **{verdict}**"


def complete_seeds(report: dict) -> dict:
    """The report with each kind's rows cut to the seeds every row of the kind finished (a stopped run's JSON)."""
    kinds = {}
    for kind, rows in report["kinds"].items():
        done = set.intersection(*({r["seed"] for r in runs} for runs in rows.values()))
        kinds[kind] = {name: [r for r in runs if r["seed"] in done] for name, runs in rows.items()}
    return {**report, "kinds": kinds}


def _prompt_counts(report: dict, s: dict) -> str:
    """The rounds' training prompts of each kind as the run wrote them ('24 training prompts', or 'training prompts
    (chat 24, text 21)' where they differ); reports from before they were recorded: the settings' count, which
    every kind had then."""
    counts = {kind: (report.get("train_prompts") or {}).get(kind, s["prompts"]) for kind in report["kinds"]}
    if len(set(counts.values())) <= 1:
        return f"{next(iter(counts.values()), s['prompts'])} training prompts"
    return "training prompts (" + ", ".join(f"{kind} {n}" for kind, n in counts.items()) + ")"


def markdown(report: dict) -> str:
    report = complete_seeds(report)
    s = {**LATER_SETTINGS, **report["settings"]}
    pair = ("One tokenizer: the student reads the teacher's tokenizer (and the chat student its chat template; no "
            "projection; policy-eval's teacher scores the sampled ids)" if s["same_tokenizer"] else "Cross-tokenizer")
    lines = [f"From a converged off-policy student ({s['converge_steps']} steps of `--loss auto` at lr "
             f"{s['converge_lr']}, cosine to 0.1), each row {s['steps']} more optimizer steps at a constant lr {s['lr']} "
             f"(a fresh optimizer, 2 warmup steps), micro-batch 4 x 256; on-policy: `xtcache rounds --engine hf`, 2 rounds "
             f"of {s['steps'] // 2} steps on {_prompt_counts(report, s)} x {s['samples_per_prompt']} samples of up to "
             f"{s['max_new_tokens']} tokens. Seeds: " + ", ".join(
                 f"{kind} {len(rows[ROWS[0][0]])}" for kind, rows in report["kinds"].items()) +
             f" of {s['seeds']} (mean ± sd; the seed sets the converged student, the rounds' samples and the data "
             f"order). {pair}; the corpus caches top-{s['top_k']}, the rounds' caches of their rollouts "
             "teacher-dump's default top-64 unless a row says otherwise, the held-out cache full-vocabulary." + (
                 " The teacher: SmolLM2-135M-Instruct (the real tier, 49,152 ids), the student a fresh 2-layer Llama "
                 "of hidden size 64 on the Llama-3 vocabulary (128,256 ids) and its Llama-3-style template; text "
                 "prefixes of the Python language reference, conversations about it (the user asks for a topic "
                 "explained, then 'Go on.'; the assistant's turns its paragraphs); held-out prompts from topics "
                 "never trained on." if s["real_teacher"] else "") + (
                 f" The chat teacher: a 2-layer Qwen2 of hidden size {s['chat_teacher_hidden']} pre-trained for "
                 f"{s['chat_teacher_steps']} steps on the chat corpus (the student: a 2-layer Llama of hidden size "
                 "64)." if "chat" in report["kinds"] and not s["real_teacher"] else ""), ""]
    for kind, rows in report["kinds"].items():
        lines += [f"**{kind}** ({'conversations, last assistant turn' if kind == 'chat' else 'text prefixes, completion'})",
                  "", "| row | teacher-scored tokens trained | held-out KL | reverse KL/sequence | teacher NLL/byte | "
                  "reverse KL/token | student NLL/token | sample length (tokens) | stopped |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for name, runs in rows.items():
            kl = [r.get("heldout_kl") for r in runs]
            lines.append(f"| {name} | {mean_pm([r.get('teacher_positions') for r in runs], '.0f')} | {mean_pm(kl, '.4f')} | "
                         + " | ".join(mean_pm([r[k] for r in runs]) for k in ("reverse_kl_per_sequence",
                                                                              "teacher_nll_per_byte", "reverse_kl_per_token"))
                         + f" | {mean_pm([r['teacher_nll_per_token'] - r['reverse_kl_per_token'] for r in runs])}"
                         + f" | {mean_pm([r['mean_student_tokens'] for r in runs], '.1f')} | "
                           f"{mean_pm([r['stopped_fraction'] for r in runs], '.2f')} |")
        first = rows["converged student"][0]
        se = [r.get("teacher_nll_per_byte_se") for r in rows["converged student"]]
        se = f"; the teacher NLL/byte of one student has a standard error of about {statistics.fmean(se):.3f}" \
            if all(x is not None for x in se) else ""
        own = first.get("teacher_self_nll_per_byte")  # measured since policy-eval reports it
        own = "" if own is None else f"; the teacher's NLL/byte of its own samples: {own:.3f}"
        lines += ["", f"policy-eval: {first['samples']} samples ({s['eval_prompts']} held-out prompts x "
                  f"{first['samples'] // s['eval_prompts']}{se}), "
                  f"cap {first['max_new_tokens']} tokens ("
                  + ("fixed: the teacher's own samples under it average " if eval_cap(kind, s) else
                     "twice the teacher's mean length, ")
                  + f"{first['teacher_mean_student_tokens']:.1f} student tokens{own}). Student NLL/token: the student's own "
                  "NLL of its samples per token (teacher NLL/token - reverse KL/token: its sampling entropy, "
                  "estimated). Teacher-scored tokens: the trained "
                  "(last-assistant) student tokens of the caches a row trained on after convergence (on-policy: every "
                  "round's rollouts; a row mixed with the corpus cache's KD: that cache counted whole, at most what it read; "
                  "with `--corpus-loss ce` the rollouts alone, the corpus's teacher values unread; mixed with KD on the "
                  "converge cache, scored before the rows start, the rollouts alone).", "",
                  *verdicts(rows), ""]
    runs = report.get("runs_s") or []
    lines.append(f"Wall time {report.get('wall_s', 0) / 60:.1f} min" + (
        f" in all: the first run {runs[0] / 60:.1f} min, then `--add-rows` runs of "
        + ", ".join(f"{x / 60:.1f}" for x in runs[1:]) + " min." if len(runs) > 1 else "."))
    return "\n".join(lines)
