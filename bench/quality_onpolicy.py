"""The on-policy section of the quality bench (issue 26 item 5): on-policy rounds against off-policy KD.

    python bench/quality.py --section on-policy     # about 28 min on 2 idle CPU cores (bench/quality.py writes the docs block)

The cross-tokenizer chat setup of tests/test_rounds.py (`xtcache.testing.chat.build_chat_setup`: a
ChatML-style Qwen2 teacher pre-trained on conversations, a fresh Llama-3-style student with its own
tokenizer), each stage an `xtcache` subprocess as a user runs it, every student trained on the last
assistant turn (`--train-on last-assistant`) for the same number of steps with the same flags:

| row | what the student trains on |
| --- | --- |
| CE only | the last assistant turns of the first C training conversations (`--loss ce`) |
| off-policy KD | the same turns, the teacher's top-k cache of them (`--loss auto`: P-KL, + 0.1 CE) |
| on-policy, auto | `xtcache rounds`, 2 rounds: its own answers to P prompts cut from the training conversations, scored by the teacher (`--loss auto`: P-KL on its own tokens, no CE) |
| on-policy, rkl-pg | the same rounds with `--loss rkl-pg --is-cap 0` (the per-chunk reverse-KL policy gradient) |
| off-policy KD then on-policy | off-policy KD on half the turns (C/2, 16 steps: one pass), then `xtcache rounds --student` its export: 2 rounds of 7 steps on P/2 prompts (auto; rkl-pg; auto with `--corpus-cache` the KD half, `--rollout-fraction 0.5`; the projected reverse KL, `--pkl-divergence reverse`, alone and with the corpus mix; the forward-reverse mean) |

The off-policy-then-on-policy rows are added to an earlier report by `--add-rows` (bench/quality.py).
C = P x samples x rounds, so the off-policy rows read as many assistant turns as the on-policy rows
generate; the teacher-scored tokens of both (the trained positions) are reported. Measures: the
held-out KL (train-student's `--eval-cache`: chunk-level P-KL against a full-vocabulary store of
held-out conversations, on their last assistant turns) and `xtcache policy-eval` (the live teacher's
reverse KL per token and its NLL per token on the student's own samples for held-out prompts).
"""

from __future__ import annotations

import json
import logging
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from xtcache.app.docblock import run_record

log = logging.getLogger("bench.quality.on-policy")
ROUNDS = 2


@dataclass(frozen=True)
class OnPolicySettings:
    prompts: int = 32  # training prompts, sampled in every round
    samples_per_prompt: int = 2
    max_new_tokens: int = 48
    steps_per_round: int = 15
    seq_len: int = 256
    micro_batch_size: int = 4
    lr: float = 3e-3
    top_k: int = 16
    eval_prompts: int = 12
    eval_samples: int = 2
    seeds: int = 3
    num_train: int = 240
    num_heldout: int = 24
    teacher_steps: int = 150


def run_xtcache(*args: str, log_file: Path) -> None:
    cmd = [sys.executable, "-m", "xtcache.app.cli", *args]
    log.info("$ xtcache %s", " ".join(args[:1]))
    with open(log_file, "a") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise SystemExit(f"xtcache {args[0]} failed (exit {proc.returncode}): see {log_file}")


def _prompts(conversations: Path, out: Path, rows: range) -> Path:
    """Conversations `rows` of a chat JSONL, each cut after its last user message."""
    from xtcache.testing.chat import write_prompts

    return write_prompts(conversations, out, rows)


def trained_positions(store: Path) -> int:
    """The store's student tokens with the last-assistant role bit (what --train-on last-assistant trains: a
    conversation's last assistant turn, a text rollout's completion), summed over the parts of every alignment
    group (one group here: the student's); a text store's parts carry no role counts, so its role arrays are read."""
    import numpy as np

    from schemas.roles import LAST_ASSISTANT
    from xtcache.store import CacheReader

    reader = CacheReader(str(store))
    if reader.manifest.conversation:
        return sum(int((part.conversation or {}).get("role_last_assistant", 0))
                   for fp in reader.alignment_groups() for part in reader.alignment_parts(fp).values())
    return sum(int(np.count_nonzero(reader.read_alignment(fp, sid).student_role & LAST_ASSISTANT))
               for fp in reader.alignment_groups() for sid in reader.alignment_parts(fp))


def _common(s: OnPolicySettings, seed: int) -> list[str]:
    return ["--seq-len", str(s.seq_len), "--micro-batch-size", str(s.micro_batch_size), "--lr", str(s.lr),
            "--warmup-steps", str(min(5, round_steps(s))), "--min-lr-ratio", "1", "--zero-stage", "0", "--seed", str(seed),
            "--eval-every", "1000"]  # a constant rate after warmup (5 steps; fewer in --quick's 3-step rounds)


def prepare(work: Path, s: OnPolicySettings, log_file: Path) -> dict:
    """The chat setup, the prompts, the training and held-out caches and the projection (seed-independent)."""
    from xtcache.testing import toy
    from xtcache.testing.chat import build_chat_setup, write_chat_jsonl
    from xtcache.testing.suite import TEST_CACHE, TEST_SPEC

    base = toy.build_toy_setup(TEST_CACHE, TEST_SPEC)  # its tokenizers only (the tests' toy setup, built once)
    setup = build_chat_setup(base, work / "chat", num_train=s.num_train, num_heldout=s.num_heldout,
                             teacher_steps=s.teacher_steps, teacher_hidden=64)
    n_off = s.prompts * s.samples_per_prompt * ROUNDS  # as many assistant turns as the rounds generate
    off_rows = [json.loads(x) for x in setup.train_jsonl.read_text().splitlines()[s.prompts:s.prompts + n_off]]
    off_data = write_chat_jsonl(work / "off-policy.jsonl", off_rows)
    half_data = write_chat_jsonl(work / "off-policy-half.jsonl", off_rows[:n_off // 2])
    p = {"setup": setup, "train_prompts": _prompts(setup.train_jsonl, work / "prompts-train.jsonl", range(s.prompts)),
         "eval_prompts": _prompts(setup.heldout_jsonl, work / "prompts-heldout.jsonl", range(s.eval_prompts)),
         "half_prompts": _prompts(setup.train_jsonl, work / "prompts-train-half.jsonl", range(s.prompts // 2)),
         "off_cache": work / "cache-off", "half_cache": work / "cache-off-half", "eval_cache": work / "cache-heldout",
         "projection": work / "projection.safetensors"}
    topk = ["--mode", "topk", "--top-k", str(s.top_k)]
    dump_caches(setup, [(off_data, p["off_cache"], topk), (half_data, p["half_cache"], topk),
                        (setup.heldout_jsonl, p["eval_cache"], ["--mode", "full"])], p["projection"], log_file)
    p["off_positions"] = trained_positions(p["off_cache"])
    p["half_positions"] = trained_positions(p["half_cache"])
    p["off_turns"] = n_off
    return p


def dump_caches(setup, dumps: list[tuple[Path, Path, list[str]]], projection: Path | None, log_file: Path) -> None:
    """teacher-dump (engine hf, float32) of each (data, out, mode flags) whose store is not there yet, and the
    projection map of the setup's two tokenizers unless it exists (None: one tokenizer, no map)."""
    for data, out, mode in dumps:
        if not (out / "manifest.json").exists():
            run_xtcache("teacher-dump", "--teacher", str(setup.teacher_model), "--student-tokenizer",
                        str(setup.student_tokenizer), "--data", str(data), "--out", str(out), *mode, "--max-seq-len",
                        "512", "--engine", "hf", "--dtype", "float32", log_file=log_file)
    if projection is not None and not projection.exists():
        run_xtcache("projection", "build", "--student-tokenizer", str(setup.student_tokenizer), "--teacher-tokenizer",
                    str(setup.teacher_tokenizer), "--out", str(projection), log_file=log_file)


def _train(p: dict, out: Path, s: OnPolicySettings, seed: int, loss: list[str], log_file: Path, *,
           half: bool = False) -> dict:
    """train-student on the off-policy cache (30 steps), or with `half` on its first half (kd_half_steps)."""
    if out.exists():
        shutil.rmtree(out)
    setup = p["setup"]
    cache, steps = (p["half_cache"], kd_half_steps(s)) if half else (p["off_cache"], ROUNDS * s.steps_per_round)
    run_xtcache("train-student", "--cache", str(cache), "--eval-cache", str(p["eval_cache"]), "--student",
                str(setup.student_model), "--out", str(out), "--projection", str(p["projection"]), "--max-steps",
                str(steps), "--train-on", "last-assistant", *_common(s, seed), *loss, log_file=log_file)
    summary = json.loads((out / "summary.json").read_text())
    return {"hf": out / "hf", "heldout_kl": summary.get("final_eval_kl"),
            "teacher_positions": p["half_positions" if half else "off_positions"], "steps": steps}


def _rounds(p: dict, out: Path, s: OnPolicySettings, seed: int, loss: str, extra: list[str], log_file: Path, *,
            student: Path | None = None, prompts: Path | None = None, steps_per_round: int | None = None) -> dict:
    """`xtcache rounds` from the fresh student on the P training prompts, or from `student` on `prompts`."""
    if out.exists():
        shutil.rmtree(out)
    setup = p["setup"]
    own = []  # rounds takes the corpus cache itself (its --corpus-cache); the row's other flags go to train-student
    if "--corpus-cache" in extra:
        at = extra.index("--corpus-cache")
        own, extra = extra[at:at + 2], extra[:at] + extra[at + 2:]
    run_xtcache("rounds", "--student", str(student or setup.student_model), "--teacher", str(setup.teacher_model),
                "--prompts", str(prompts or p["train_prompts"]), "--rounds", str(ROUNDS), "--workdir", str(out),
                "--engine", "hf", "--samples-per-prompt", str(s.samples_per_prompt), "--max-new-tokens",
                str(s.max_new_tokens), "--seed", str(seed), "--steps-per-round", str(steps_per_round or s.steps_per_round),
                "--loss", loss, "--train-on",
                "last-assistant", "--projection", str(p["projection"]), "--eval-cache", str(p["eval_cache"]), *own, "--",
                *_without_seed(_common(s, seed)),
                "--kd-weight", "1.0", "--ce-weight", "0.0", *_forward_unless_chosen(loss, extra), log_file=log_file)
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    positions = sum(trained_positions(out / f"round-{m['round']:03d}" / "cache") for m in metrics)
    return {"hf": Path(metrics[-1]["hf_dir"]), "heldout_kl": metrics[-1].get("final_eval_kl"),
            "teacher_positions": positions, "generated_tokens": sum(m["generated_tokens"] for m in metrics),
            "steps": metrics[-1]["step"]}


def _forward_unless_chosen(loss: str, extra: list[str]) -> list[str]:
    """The rows' train-student flags with the forward P-KL written out where they give no divergence (the rows were
    measured when it was the default; train-student's cross-tokenizer default is now forward-reverse)."""
    if loss in ("auto", "pkl") and "--pkl-divergence" not in extra:
        return [*extra, "--pkl-divergence", "forward"]
    return extra


def _without_seed(flags: list[str]) -> list[str]:
    """train-student flags without --seed (rounds passes its own --seed to train-student)."""
    i = flags.index("--seed")
    return flags[:i] + flags[i + 2:]


def _kd_then_rounds(p: dict, out: Path, s: OnPolicySettings, seed: int, loss: str, extra: list[str],
                    log_file: Path) -> dict:
    """Off-policy KD on the half cache (kd_half_steps), then ROUNDS rounds of round_steps from its export on the
    first P/2 prompts: C/2 teacher turns + P/2 x samples x rounds rollouts, 30 steps in all."""
    kd = _train(p, out / "kd", s, seed, ROWS[1][2], log_file, half=True)
    extra = [p["half_cache"] if x == HALF_CACHE else x for x in extra]
    r = _rounds(p, out / "rounds", s, seed, loss, [str(x) for x in extra], log_file, student=kd["hf"],
                prompts=p["half_prompts"], steps_per_round=round_steps(s))
    return {**r, "teacher_positions": kd["teacher_positions"] + r["teacher_positions"],
            "rollout_positions": r["teacher_positions"], "steps": kd["steps"] + r["steps"], "kd_heldout_kl": kd["heldout_kl"]}


HALF_CACHE = "<half cache>"  # placeholder in a row's flags for the off-policy half's cache (prepare builds it)


def round_steps(s: OnPolicySettings) -> int:
    """Steps per round of the on-policy half: 7 of the default 15, so that 2 x 7 rounds follow 16 KD steps."""
    return s.steps_per_round // 2


def kd_half_steps(s: OnPolicySettings) -> int:
    """The off-policy half's steps: the other rows' total less the rounds' (16 by default: one pass over C/2 turns)."""
    return ROUNDS * (s.steps_per_round - round_steps(s))

ROWS = [  # name, kind, loss flags
    ("CE only", "train", ["--loss", "ce", "--ce-weight", "1.0"]),
    ("off-policy KD (P-KL + 0.1 CE)", "train", ["--loss", "auto", "--pkl-divergence", "forward", "--kd-weight", "1.0",
                                               "--ce-weight", "0.1"]),
    ("on-policy, 2 rounds, auto (P-KL)", "rounds", ("auto", [])),
    ("on-policy, 2 rounds, rkl-pg", "rounds", ("rkl-pg", ["--is-cap", "0"])),
    ("off-policy KD then on-policy, 2 rounds, auto", "kd-then-rounds", ("auto", [])),
    ("off-policy KD then on-policy, 2 rounds, rkl-pg", "kd-then-rounds", ("rkl-pg", ["--is-cap", "0"])),
    ("off-policy KD then on-policy, 2 rounds, auto + corpus 0.5", "kd-then-rounds",
     ("auto", ["--corpus-cache", HALF_CACHE, "--rollout-fraction", "0.5", "--corpus-loss", "kd"])),
    ("off-policy KD then on-policy, 2 rounds, P-KL reverse", "kd-then-rounds", ("pkl", ["--pkl-divergence", "reverse"])),
    ("off-policy KD then on-policy, 2 rounds, P-KL forward-reverse", "kd-then-rounds",
     ("pkl", ["--pkl-divergence", "forward-reverse", "--pkl-reverse-weight", "0.5"])),  # measured at the mean
    ("off-policy KD then on-policy, 2 rounds, P-KL reverse + corpus 0.5", "kd-then-rounds",
     ("pkl", ["--pkl-divergence", "reverse", "--corpus-cache", HALF_CACHE, "--rollout-fraction", "0.5", "--corpus-loss",
              "kd"])),
]


def run_on_policy(work: Path, s: OnPolicySettings, *, base: dict | None = None, save: Path | None = None) -> dict:
    """Every row on every seed, or with `base` (an earlier report) only the rows it lacks, row by row; returns the
    report (rows with per-seed values), written to `save` after every run (a stopped run keeps what it measured)."""
    t0 = time.perf_counter()
    work.mkdir(parents=True, exist_ok=True)
    log_file = work / "on-policy.log"
    log_file.write_text("")
    p = prepare(work, s, log_file)
    report = {"settings": s.__dict__, "rows": dict((base or {}).get("rows", {})), "off_turns": p["off_turns"],
              "wall_s": (base or {}).get("wall_s", 0.0), "measured": [*(base or {}).get("measured", []), run_record()]}
    if base:
        report["reused"] = list(base["rows"])
    for i, (name, kind, flags) in enumerate(ROWS):
        if name in report["rows"]:
            continue
        report["rows"][name] = []
        for seed in range(s.seeds):
            log.info("seed %d: %s", seed, name)
            r = _run_row(p, work / "runs" / f"row{i}-seed{seed}", s, seed, kind, flags, log_file)
            report["rows"][name].append({**r, "seed": seed})
            report["added_wall_s"] = time.perf_counter() - t0
            if save:
                save.write_text(json.dumps(report, indent=2, default=str))
    if not base:
        report["wall_s"] = time.perf_counter() - t0
    return report


def _run_row(p: dict, out: Path, s: OnPolicySettings, seed: int, kind: str, flags, log_file: Path) -> dict:
    """One row on one seed: its training, then policy-eval of the student it ends with."""
    from stage1_teacher.onpolicy.policy_eval import policy_eval

    if kind == "train":
        r = _train(p, out, s, seed, flags, log_file)
    elif kind == "rounds":
        r = _rounds(p, out, s, seed, flags[0], flags[1], log_file)
    else:
        r = _kd_then_rounds(p, out, s, seed, flags[0], flags[1], log_file)
    report, _ = policy_eval(str(r["hf"]), str(p["setup"].teacher_model), str(p["eval_prompts"]),
                            samples_per_prompt=s.eval_samples, max_new_tokens=s.max_new_tokens, seed=0,
                            teacher_samples=False)
    return {**{k: v for k, v in r.items() if k != "hf"},
            **{k: report[k] for k in ("reverse_kl_per_token", "reverse_kl_per_token_se", "teacher_nll_per_token",
                                      "teacher_nll_per_byte", "stopped_fraction", "mean_student_tokens", "unscored")}}


def mean_sd(xs: list, fmt: str = ".3f", sep: str = "+-") -> str:
    """'mean SEP sd' of the values given (None left out), the value alone for one, '-' for none."""
    xs = [x for x in xs if x is not None]
    if not xs:
        return "-"
    return f"{statistics.fmean(xs):{fmt}} {sep} {statistics.stdev(xs):{fmt}}" if len(xs) > 1 else f"{xs[0]:{fmt}}"


def mean_pm(xs: list, fmt: str = ".3f") -> str:
    """`mean_sd` as the doc blocks of the other sections write it: 'mean ± sd'."""
    return mean_sd(xs, fmt, "±")


def _spread_notes(rows: dict) -> list[str]:
    """For each measure: which row pairs differ by more than the sum of their standard deviations."""
    notes = []
    names = list(rows)
    for key, label in (("heldout_kl", "held-out KL"), ("reverse_kl_per_token", "reverse KL/token"),
                       ("teacher_nll_per_token", "teacher NLL/token"), ("teacher_nll_per_byte", "teacher NLL/byte")):
        stats = {}
        for n in names:
            xs = [r[key] for r in rows[n] if r.get(key) is not None]
            if len(xs) > 1:
                stats[n] = (statistics.fmean(xs), statistics.stdev(xs))
        within = [f"{a} vs {b}" for i, a in enumerate(names) for b in names[i + 1:]
                  if a in stats and b in stats and abs(stats[a][0] - stats[b][0]) <= stats[a][1] + stats[b][1]]
        notes.append(f"- {label}: within the spread (|mean difference| <= sd + sd): "
                     + ("; ".join(within) if within else "none"))
    return notes


def markdown(report: dict) -> str:
    s = report["settings"]
    lines = [f"Cross-tokenizer chat setup (ChatML-style Qwen2 teacher, hidden 64, {s['teacher_steps']} pre-training "
             f"steps on {s['num_train']} conversations; fresh Llama-3-style student, hidden 64, own tokenizer). Every "
             f"row: {ROUNDS * s['steps_per_round']} student steps, micro-batch {s['micro_batch_size']}, seq-len "
             f"{s['seq_len']}, lr {s['lr']}, `--train-on last-assistant`; {s['seeds']} seeds (mean +- sd). "
             f"On-policy: {ROUNDS} rounds of {s['prompts']} prompts x {s['samples_per_prompt']} samples of up to "
             f"{s['max_new_tokens']} tokens (`xtcache rounds --engine hf`); off-policy: the last assistant turns of "
             f"{report['off_turns']} other training conversations (top-{s['top_k']} cache).", "",
             "| row | teacher-scored tokens (trained) | steps | held-out KL | reverse KL/token | teacher NLL/token | "
             "teacher NLL/byte | sample length (tokens) | stopped |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, runs in report["rows"].items():
        cells = [mean_sd([r["teacher_positions"] for r in runs], ".0f"), str(runs[0]["steps"]),
                 *[mean_sd([r[k] for r in runs]) for k in ("heldout_kl", "reverse_kl_per_token",
                                                            "teacher_nll_per_token", "teacher_nll_per_byte")],
                 mean_sd([r["mean_student_tokens"] for r in runs], ".1f"),
                 mean_sd([r["stopped_fraction"] for r in runs], ".2f")]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "Held-out KL: chunk-level P-KL to the teacher's full distribution on the last assistant turns of "
              f"{s['num_heldout']} held-out conversations (train-student's `--eval-cache`). Reverse KL/token and "
              f"teacher NLL/token: `xtcache policy-eval` on {s['eval_prompts']} held-out prompts x {s['eval_samples']} "
              "samples (seed 0), per student token and per byte of the samples' text (an upper bound across tokenizers: "
              "docs above); sample length: mean student tokens per sample, stopped: the fraction that ended with the "
              "end-of-turn token. Teacher-scored "
              "tokens: student tokens of the trained turns in the caches the row trained on (on-policy: both rounds). "
              "`rkl-pg` runs with `--is-cap 0` (no ratio): it did so when a capped ratio refused a micro-batch that "
              "trained a turn whose sampled ids do not spell its text (no sampling log-prob; such a turn now trains "
              "without the ratio, the others with it).", "",
              *_kd_then_note(report), *_spread_notes(report["rows"]), "", _wall_time(report)]
    return "\n".join(lines)


def _kd_then_note(report: dict) -> list[str]:
    """The off-policy-then-on-policy rows' split of steps and teacher-scored tokens (when the report has them)."""
    runs = [r for rs in report["rows"].values() for r in rs if "rollout_positions" in r]
    if not runs:
        return []
    s = report["settings"]
    o = OnPolicySettings(**s)
    return [f"Off-policy KD then on-policy: `--loss auto` (P-KL + 0.1 CE) for {kd_half_steps(o)} steps on the last "
            f"assistant turns of the first {report['off_turns'] // 2} of the off-policy conversations (top-{s['top_k']} "
            f"cache, {runs[0]['teacher_positions'] - runs[0]['rollout_positions']} trained tokens, one pass), then "
            f"`xtcache rounds --student` its export: {ROUNDS} rounds of {round_steps(o)} steps on {s['prompts'] // 2} "
            f"prompts x {s['samples_per_prompt']} samples (a fresh optimizer and warmup): as many teacher turns plus "
            "rollouts as the off-policy row's turns. Their teacher-scored column is the KD half's tokens plus both "
            "rounds' rollout tokens. The corpus row mixes the KD half's cache into the rounds' training at "
            "`--rollout-fraction 0.5` (no new teacher-scored tokens). Held-out KL after the KD half alone: "
            f"{mean_sd([r['kd_heldout_kl'] for r in runs])}.", ""]


def _wall_time(report: dict) -> str:
    if report.get("reused"):
        return (f"Wall time {report['wall_s'] / 60:.1f} min for the rows {', '.join(report['reused'])} (an earlier "
                f"run, reused as they are); {report['added_wall_s'] / 60:.1f} min for the rows added by `--add-rows`.")
    return f"Wall time {report['wall_s'] / 60:.1f} min" + (
        f" (the run that wrote {report['rendered_from']}; this table is rendered from it)."
        if report.get("rendered_from") else ".")
