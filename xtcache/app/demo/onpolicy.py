"""`xtcache demo --on-policy`: on-policy rounds against continued off-policy KD, from a converged student.

    make demo-on-policy                          # sets up .venv, then runs `xtcache demo --on-policy`
    xtcache demo --on-policy --size small --engine hf

The chat demo's teacher and student (cross-tokenizer: a ChatML-style Qwen2 teacher, a Llama-3-style
student; `xtcache demo --chat`), then, each stage an `xtcache` subprocess:
1. the chat demo's caches: top-k of the training conversations, every teacher id of the held-out ones
   (the held-out reference), and the projection;
2. off-policy KD: `train-student` on the training conversations' cache for T steps (the size's student
   steps, to the end of its cosine schedule): the converged student, where on-policy distillation starts
   (after SFT or KD: a fresh student's own samples are noise to the teacher, docs/on-policy.md);
3. from it, 2 R more steps each (R = `round_steps`), a fresh optimizer at a constant lr 1e-4 after 2 warmup
   steps (`FINE_TUNE`): continued off-policy KD on the same cache, and `xtcache rounds` twice, 2 rounds of R
   steps each: with its defaults (across tokenizers the generalized JSD + 0.1 CE on the rollouts), and with the
   mix that beat continued KD across tokenizers on conversations in the converged bench (`MIX`: the same on the
   rollouts, half the micro-batches CE alone on the training cache's text, whose teacher values it does not
   read). In each round the student answers prompts cut from the training conversations (after their
   last user message), the teacher scores its answers, the student trains on them, and the next round samples
   from the trained student;
4. `xtcache policy-eval` of every student (before training, converged, continued, after each round) on
   held-out prompts: the live teacher's reverse KL per sequence and its NLL per byte, on the student's own
   samples.

Every student trains and is measured on the last assistant turn (`--train-on last-assistant`), so the
held-out KL of every row is over the same positions: the last assistant turns of the held-out
conversations. The continued run re-reads the training cache (no new teacher work); the rounds have the
teacher score their rollouts. bench/quality.py --section on-policy-converged compares the two at equal
teacher-scored tokens, with seeds.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import typer

from xtcache.app.demo.console import StageRunner
from xtcache.app.demo.setup import SIZES, DemoSize, build_setup
from xtcache.app.demo.steps import build_projection, dump_caches, engine_log, fmt, train
from xtcache.testing.chat import write_prompts as cut

log = logging.getLogger(__name__)
ROUNDS = 2
TRAIN_ON = ("--train-on", "last-assistant")


@dataclass(frozen=True)
class OnPolicySize:
    """The on-policy part of a demo size: prompts, samples and generation lengths."""

    prompts: int  # training prompts, sampled again in every round
    samples_per_prompt: int
    max_new_tokens: int
    eval_prompts: int  # held-out prompts of policy-eval
    eval_samples_per_prompt: int


ON_POLICY_SIZES = {
    "default": OnPolicySize(prompts=128, samples_per_prompt=2, max_new_tokens=64, eval_prompts=32,
                            eval_samples_per_prompt=3),  # 96 samples: policy-eval's floor
    "small": OnPolicySize(prompts=24, samples_per_prompt=2, max_new_tokens=32, eval_prompts=8,
                          eval_samples_per_prompt=2),
}


def write_prompts(conversations: Path, out: Path, limit: int) -> Path:
    """The first `limit` conversations of a chat JSONL, each cut after its last user message."""
    rows = [json.loads(line) for line in conversations.read_text(encoding="utf-8").splitlines()[:limit]]
    return cut(rows, out)


FINE_TUNE = ("--lr", "1e-4", "--warmup-steps", "2", "--min-lr-ratio", "1")  # both arms after convergence
# the second rounds arm's flags, before the corpus cache's path (rounds' own mix defaults; docs/on-policy.md)
MIX = ("--loss", "jsd", "--corpus-cache")
ARMS = (("on-policy round", "on-policy"), ("JSD + corpus CE, round", "on-policy (JSD + corpus CE)"))


def _student_flags(size: DemoSize) -> list[str]:
    """The train-student flags every round shares with the continued off-policy run."""
    return ["--seq-len", str(size.seq_len), "--micro-batch-size", str(size.micro_batch_size), *FINE_TUNE,
            "--eval-every", str(size.eval_every), "--zero-stage", "2"]


def run_rounds(run: StageRunner, setup, start: Path, prompts: Path, workdir: Path, projection: Path,
               eval_cache: Path, size: DemoSize, ps: OnPolicySize, steps: int, engine: str,
               rounds_flags: tuple[str, ...] = ()) -> list[dict]:
    """`xtcache rounds` from the student `start` (a fresh work directory every demo run), its default objective
    unless `rounds_flags` say otherwise; returns its per-round metrics."""
    if workdir.exists():
        shutil.rmtree(workdir)
    run.xtcache("rounds", "--student", str(start), "--teacher", str(setup.teacher_model),
                "--prompts", str(prompts), "--rounds", str(ROUNDS), "--workdir", str(workdir), "--engine", engine,
                "--samples-per-prompt", str(ps.samples_per_prompt), "--max-new-tokens", str(ps.max_new_tokens),
                "--steps-per-round", str(steps), "--train-on", TRAIN_ON[1], "--projection",
                str(projection), "--eval-cache", str(eval_cache), *rounds_flags, "--", *_student_flags(size))
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def policy_eval(run: StageRunner, student: Path, teacher: Path, prompts: Path, ps: OnPolicySize, out: Path) -> dict:
    """`xtcache policy-eval` of one student on the held-out prompts (its cap: twice the teacher's mean length);
    returns its report."""
    run.xtcache("policy-eval", "--student", str(student), "--teacher", str(teacher), "--prompts", str(prompts),
                "--samples-per-prompt", str(ps.eval_samples_per_prompt), "--seed", "0", "--out", str(out))
    return json.loads(out.read_text())


def round_steps(size: DemoSize) -> int:
    """Steps per round R: a tenth of the converged run's steps (at least 2); both arms train 2 R after it."""
    return max(2, size.steps(chat=True) // 10)


def run_on_policy_demo(workdir: Path, size_name: str, *, engine: str = "vllm") -> dict:
    """Run the on-policy demo; returns the numbers of its table (also WORKDIR/on-policy/demo_result.json)."""
    workdir.mkdir(parents=True, exist_ok=True)
    run = StageRunner(engine_log(workdir, "on-policy"))
    try:
        result = _run(run, workdir, size_name, engine)
    finally:
        run.close()
    return result


def _run(run: StageRunner, workdir: Path, size_name: str, engine: str) -> dict:
    t0 = time.perf_counter()
    size, ps = SIZES[size_name], ON_POLICY_SIZES[size_name]
    ds = build_setup(run, workdir, size_name, chat=True)
    setup, out = ds.setup, workdir / "on-policy"
    kd_steps, steps = size.steps(chat=True), round_steps(size)
    dump, eval_dump = dump_caches(run, ds, size, engine)
    projection = build_projection(run, ds)
    train_prompts = write_prompts(setup.train_jsonl, out / "prompts-train.jsonl", ps.prompts)
    eval_prompts = write_prompts(setup.heldout_jsonl, out / "prompts-heldout.jsonl", ps.eval_prompts)

    total = kd_steps + ROUNDS * steps
    log.info("step 4/5: off-policy KD on the training conversations' cache, %d steps; from it, %d more steps of "
             "continued off-policy KD and %d on-policy rounds of %d steps", kd_steps, ROUNDS * steps, ROUNDS, steps)
    off_dir, more_dir = out / "off-policy", out / "off-policy-continued"
    off = train(run, setup, dump["path"], eval_dump["path"], projection, off_dir, size, kd=True, extra=TRAIN_ON,
                steps=kd_steps)
    more = train(run, setup, dump["path"], eval_dump["path"], projection, more_dir, size, kd=True, extra=TRAIN_ON,
                 steps=ROUNDS * steps, student=off_dir / "hf", schedule=FINE_TUNE)
    rounds_dir, mix_dir = out / "rounds", out / "rounds-jsd-corpus-ce"
    rounds = run_rounds(run, setup, off_dir / "hf", train_prompts, rounds_dir, projection, eval_dump["path"], size,
                        ps, steps, engine)
    mixed = run_rounds(run, setup, off_dir / "hf", train_prompts, mix_dir, projection, eval_dump["path"], size, ps,
                       steps, engine, (*MIX, str(dump["path"])))

    log.info("step 5/5: policy-eval of every student on %d held-out prompts", ps.eval_prompts)
    students = [("initial student", 0, Path(setup.student_model), off.get("initial_eval_kl")),
                ("off-policy KD (converged)", kd_steps, off_dir / "hf", off.get("final_eval_kl")),
                ("continued off-policy KD", total, more_dir / "hf", more.get("final_eval_kl")),
                *[(f"{prefix} {m['round'] + 1}", kd_steps + m["step"], Path(m["hf_dir"]), m.get("final_eval_kl"))
                  for (prefix, _), metrics in zip(ARMS, (rounds, mixed)) for m in metrics]]
    rows = []
    for i, (name, step, student, kl) in enumerate(students):
        report_path = out / f"policy-eval-{i}.json"
        report = policy_eval(run, student, Path(setup.teacher_model), eval_prompts, ps, report_path)
        rows.append({"student": name, "step": step, "heldout_kl": kl, "dir": str(student),
                     **{k: report.get(k) for k in ("reverse_kl_per_sequence", "teacher_nll_per_byte",
                                                   "mean_student_tokens", "samples")}, "report": str(report_path)})
    result = {"rows": rows, "engine": "vLLM" if engine == "vllm" else "transformers", "rounds": rounds,
              "steps_per_round": steps, "kd_steps": kd_steps, "prompts": ps.prompts,
              "samples_per_prompt": ps.samples_per_prompt, "eval_prompts": ps.eval_prompts,
              "eval_samples_per_prompt": ps.eval_samples_per_prompt, "max_new_tokens": ps.max_new_tokens,
              "eval_cache_docs": eval_dump.get("documents"),
              "commands": " and ".join(str(d / "commands.sh") for d in (rounds_dir, mix_dir)),
              "metrics": [str(d / "metrics.jsonl") for d in (rounds_dir, mix_dir)], "engine_log": str(run.log_path),
              "wall_s": time.perf_counter() - t0}
    (out / "demo_result.json").write_text(json.dumps(result, indent=2, default=str))
    typer.echo(on_policy_table(result))
    return result


def on_policy_table(r: dict) -> str:
    """The demo's table: one row per student, the held-out KL on the corpus and the on-policy measures."""
    lines = [
        "",
        f"xtcache demo --on-policy: {ROUNDS} rounds of generate -> teacher-dump -> train-student beside continued "
        "off-policy KD, from a converged student, conversations, cross-tokenizer",
        f"  engine                  {r['engine']} (generate and teacher-dump)",
        f"  on-policy rounds        {r['prompts']} training prompts x {r['samples_per_prompt']} samples of up to "
        f"{r['max_new_tokens']} tokens, {r['steps_per_round']} steps each, from off-policy KD's step "
        f"{r.get('kd_steps', '-')}",
        "",
        f"  {'student':<27}{'steps':>6}{'held-out KL*':>14}{'reverse KL/seq**':>18}{'teacher NLL/byte**':>20}",
    ]
    for row in r["rows"]:
        lines.append(f"  {row['student']:<27}{row['step']:>6}{fmt(row['heldout_kl']):>14}"
                     f"{fmt(row.get('reverse_kl_per_sequence')):>18}{fmt(row.get('teacher_nll_per_byte')):>20}")
    lines += [
        "",
        "  * first-token KL to the teacher's full distribution, on the last assistant turns of "
        f"{fmt(r['eval_cache_docs'], 'd')}",
        "    held-out conversations (the demo's measure); off-policy KD: P-KL + 0.1 CE on the training conversations'",
        f"    cache; from its step {r.get('kd_steps', '-')}, every arm at lr {FINE_TUNE[1]}: the same cache again, or "
        "`xtcache rounds` (its",
        "    default across tokenizers, the generalized JSD + 0.1 CE, on the student's own answers to prompts cut from",
        "    the same conversations; JSD + corpus CE: the same, half the micro-batches CE alone on the training cache's",
        "    text)",
        "  ** xtcache policy-eval: the live teacher on the student's own samples for "
        f"{r['eval_prompts']} held-out prompts x {r['eval_samples_per_prompt']}",
        "     samples: mean log p_student(y) - log p_teacher(y) per sample, and -log p_teacher(y) per byte of its text",
        "",
    ]
    lines += _verdicts(r["rows"])
    lines += [f"  rounds: {r['commands']} (every command)", f"  wall time: {r['wall_s']:.0f} s", ""]
    return "\n".join(lines)


def _verdicts(rows: list[dict]) -> list[str]:
    """One line per rounds arm and measure comparing the arm's last round with continued off-policy KD at its
    step."""
    lines = []
    for prefix, label in ARMS:
        arm = [r for r in rows if r["student"].startswith(prefix)]
        if not arm:
            continue
        on = arm[-1]
        off = next((r for r in rows if r["step"] == on["step"] and r["student"].startswith("continued")), None)
        if off is None:
            continue
        for key, name in (("heldout_kl", "held-out KL"), ("reverse_kl_per_sequence", "reverse KL/sequence"),
                          ("teacher_nll_per_byte", "teacher NLL/byte")):
            a, b = on.get(key), off.get(key)
            if a is None or b is None:
                continue
            verdict = "lower" if a < b else "NOT lower"
            lines.append(f"  {label} at step {on['step']} is {verdict} than continued off-policy KD on {name}: "
                         f"{a:.3f} vs {b:.3f}")
    return lines + [""] if lines else []
