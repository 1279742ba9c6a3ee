"""`xtcache policy-eval`: the on-policy measure. The student samples completions for held-out prompts,
the live teacher scores them, and the report gives the per-token reverse KL and the teacher's NLL.

1. Sampling: `stage1_teacher.onpolicy.samplers.HfSampler` (the sampler of `generate --engine hf`), temperature
   1, top-p 1, one seeded `torch.Generator` per (prompt, sample), so a rerun draws the same samples.
   A conversation prompt (last message the user's) is rendered with the student's own template and
   its generation prompt.
2. Scoring: the student's log-prob of a sample is the sum of its sampled tokens' log-probs (the stop
   token included; at T = 1 and top-p 1 the sampler's log-probs are the student's). The teacher
   (transformers, float32) reads the conversation rendered in its own template
   (`xtcache.chat.render.render`) with the completion text as the assistant turn; the turn's text is
   located by `xtcache.chat.render.renderings` (by construction, `xtcache.chat.spans`), and the teacher's
   log-prob is the sum over its tokens covering that text plus, when the student stopped, the
   teacher's tokens up to and including its end-of-turn marker (the teacher's probability of ending
   the turn there). A text prefix's completion is scored on the prefix and the completion as one text in
   the teacher's tokenization (special tokens as the tokenizer adds them): the teacher's tokens that
   cover the completion's characters, plus its end-of-sequence token when the student stopped. One run
   takes prompts of one kind. A student with the teacher's tokenizer (and, for conversations, its chat
   template) is scored on exactly what it read and sampled instead: the teacher reads the prompt ids the
   student was prompted with and then the sampled ids, and its log-prob is the sum over the sampled ids (the
   stop token included), as an online teacher scores on-policy samples; the report's `teacher_reads` says
   which ("sampled ids" or "text").
3. Report, over the N samples i with student token count n_i (the stop token included):

       r_i                    = log p_s(y_i) - log p_t(y_i)
       reverse_kl_per_token   = sum_i r_i / sum_i n_i       (ratio estimator; se by the delta method)
       reverse_kl_per_sequence = mean_i r_i                  (se: the sample standard deviation / sqrt(N))
       teacher_nll_per_token  = sum_i -log p_t(y_i) / sum_i n_i                (se by the delta method)
       teacher_nll_per_byte   = sum_i -log p_t(y_i) / sum_i bytes_i   (UTF-8 bytes of the completion text; se too)

   Beside them, from the teacher's own samples of the same prompts (its sampler, the same seed and cap
   rule): `teacher_self_nll_per_byte`, sum -log p_t(x_j) / sum bytes_j from its sampler's log-probs, its
   sampling entropy per byte: a reference for `teacher_nll_per_byte`, which across tokenizers scores the
   teacher's own tokenization of a text (special tokens sampled inside left out, the template's end marker
   read), and with `teacher_reads` "sampled ids" the ids the student sampled.

   Every standard error counts the samples as independent; the samples of one prompt are not quite, so
   they understate the noise a little. Two students compared on a few hundred samples can differ by
   sampling alone: compare seeds.

   `reverse_kl_per_token` is a Monte-Carlo estimate of KL(p_s || p_t) over whole completions divided
   by the mean student length. With one tokenizer on both sides (`teacher_reads` "sampled ids") both
   sides are probabilities of the same token sequence: r_i is an unbiased sample of the sequence-level
   reverse KL. Across tokenizers the teacher side is the probability of the teacher's own
   tokenization of the text, which is at most the teacher's probability of the text (other
   tokenizations of it also have mass), and the student side is the probability of the ids it
   sampled: it estimates an upper bound of the reverse KL to the teacher's text distribution. A sample
   whose text the teacher's template does not write whole (trimmed, escaped, empty) is not scored: counted
   in `unscored` and logged.

    xtcache policy-eval --student run/hf --teacher T --prompts heldout_prompts.jsonl --seed 0 --out report.json
        # defaults: samples per prompt for >= 96 samples; the cap twice the teacher's mean length (its own samples)
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
from dataclasses import dataclass

from stage1_teacher.corpus import Corpus, Skipped, iter_corpus
from stage1_teacher.onpolicy.generate_config import SamplingConfig
from stage1_teacher.onpolicy.rollouts import completion_text, prompt_of
from stage1_teacher.onpolicy.samplers import HfSampler
from xtcache.chat.render import chat_fingerprint, render, renderings
from xtcache.chat.spans import message_texts
from xtcache.cliconfig import command
from xtcache.devices import compute_device
from xtcache.errors import ConfigError
from xtcache.file_digest import validator
from xtcache.fingerprint import tokenizer_fingerprint
from xtcache.tokenizer import load_tokenizer

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class PolicyEvalConfig:
    student: str
    """Student model directory (Hugging Face layout with its tokenizer; train-student's export OUT/hf works)."""
    teacher: str
    """Teacher model directory (Hugging Face layout with safetensors weights and tokenizer; a chat template for conversation prompts)."""
    prompts: str
    """Held-out prompts (.jsonl/.parquet/.arrow): conversations ending with the user's message, or text prefixes (rows with a text field)."""
    samples_per_prompt: int = 0
    """Completions sampled per prompt (temperature 1, top-p 1); 0: enough for at least 96 samples in all."""
    max_new_tokens: int = 0
    """Most tokens sampled per completion; 0: twice the teacher's mean completion length in student tokens (its own samples, drawn first with a cap of 512), so the cap rarely decides where a student stops."""
    seed: int = 0
    """Seed of the draws; each (prompt id, sample index) draws from its own seed derived from it. A prompt id is the file's base name, row and text hash: the same prompts in a file of another name draw other samples."""
    teacher_samples: bool = True
    """Also sample the teacher on the same prompts, as the student is sampled, and report its completions' mean length and stop fraction beside the student's (a per-token measure favours a student that stops early)."""
    out: str | None = None
    """Write the report here as JSON (default: print only)."""

    def __post_init__(self):
        if self.samples_per_prompt < 0:
            raise ValueError(f"--samples-per-prompt {self.samples_per_prompt}: must be at least 1 (0: auto)")
        if self.max_new_tokens < 0:
            raise ValueError(f"--max-new-tokens {self.max_new_tokens}: must be at least 1 (0: auto)")


MIN_SAMPLES = 96  # --samples-per-prompt 0: at least this many samples in all (the report's standard errors)
PROBE_TOKENS = 512  # --max-new-tokens 0: the cap of the teacher's own samples that set the student's


@dataclass(frozen=True)
class SampleScore:
    """One sample: the student's and the teacher's log-probs of it and what they were summed over."""

    prompt_id: str
    sample: int
    student_ids: tuple[int, ...]  # the sampled ids, the stop token included
    student_logprob: float  # sum of their log-probs
    teacher_logprob: float  # NaN: not scored
    teacher_ids: tuple[int, ...]  # the teacher tokens summed (the text's, then up to the end-of-turn marker)
    text_bytes: int
    stopped: bool

    @property
    def student_tokens(self) -> int:
        return len(self.student_ids)

    @property
    def scored(self) -> bool:
        return not math.isnan(self.teacher_logprob)


def read_prompts(path: str, tokenizer) -> list:
    """The prompts of `path` (`stage1_teacher.onpolicy.rollouts.Prompt`), tokenized for the student; ConfigError
    naming --prompts and the row for a missing file, a row that is no prompt, or no rows."""
    if "://" not in path and not os.path.isfile(path):
        raise ConfigError(f"--prompts {path}: no such file; give a JSONL/Parquet file of held-out prompts")
    corpus = Corpus.resolve([path])
    corpus.messages_field = corpus.detect_messages_field()
    prompts = []
    for item in iter_corpus(corpus):
        if isinstance(item, Skipped):
            raise ConfigError(f"--prompts {item.source} row {item.row}: {item.reason}; every row must be a prompt")
        prompts.append(prompt_of(item, tokenizer, flag="--prompts"))
    if not prompts:
        raise ConfigError(f"--prompts {path}: no prompts; give at least one row")
    return prompts


def sample_student(student: str, tokenizer, prompts: list, *, samples_per_prompt: int, max_new_tokens: int,
                   seed: int):
    """(completions per prompt, completion texts per prompt, the sampler's stop ids), temperature 1."""
    sampling = SamplingConfig(samples_per_prompt=samples_per_prompt, temperature=1.0, top_p=1.0,
                              max_new_tokens=max_new_tokens, seed=seed)
    sampler = HfSampler(student, tokenizer, dtype="float32")
    try:
        completions = sampler.sample(prompts, sampling)
    finally:
        sampler.close()
    texts = [[completion_text(tokenizer, c, sampler.stop) for c in cs] for cs in completions]
    return completions, texts


def last_turn_tokens(conv: dict, r) -> tuple[int, int, list[int]] | None:
    """(start, end, the indices of the tokens that overlap it) of the conversation's last message's text in the
    rendering `r` (`xtcache.chat.render.Rendering`), or None where the template does not write that text whole."""
    last = len(conv["messages"]) - 1
    k = next((k for k, (m, f, _) in enumerate(message_texts(conv)) if m == last and f == 1), None)
    if k is None or r.located.at[k] < 0 or r.located.width[k] != len(conv["messages"][last]["content"]):
        return None
    a = int(r.located.at[k])
    b = a + int(r.located.width[k])
    return a, b, [j for j in range(len(r.ids)) if r.offsets[j, 0] < b and r.offsets[j, 1] > a]


class TeacherScorer:
    """The live teacher (transformers, float32, no remote code): log-probs of completion texts."""

    def __init__(self, teacher: str):
        import torch
        from transformers import AutoModelForCausalLM

        self.tokenizer = load_tokenizer(teacher, "teacher tokenizer")
        self.device = compute_device()
        self.model = AutoModelForCausalLM.from_pretrained(
            teacher, dtype=torch.float32, trust_remote_code=False, use_safetensors=True).to(self.device).eval()

    def token_logprobs(self, ids: list[int]):
        """log p_t(ids[j] | ids[:j]) for j >= 1 (index j - 1 of the result), float64 numpy [len(ids) - 1]."""
        import torch

        with torch.inference_mode():
            x = torch.tensor([ids], device=self.device)
            logp = torch.log_softmax(self.model(input_ids=x).logits[0, :-1].double(), dim=-1)  # [L-1, V]
            return logp.gather(1, x[0, 1:, None]).squeeze(1).cpu().numpy()

    def score_turns(self, convs: list[dict], stopped: list[bool]) -> list[tuple[float, tuple[int, ...]] | None]:
        """Per conversation (its last message the generated assistant turn): (teacher log-prob of the
        turn's text, and of the end-of-turn marker when `stopped`; the teacher ids summed), or None
        when the teacher's template does not write the text whole."""
        texts = [render(self.tokenizer, c, where="a sampled conversation (the teacher's template)") for c in convs]
        rs = renderings(self.tokenizer, texts, convs, side="teacher tokenizer")
        out = []
        for conv, r, stop in zip(convs, rs, stopped):
            located = last_turn_tokens(conv, r)
            if located is None:
                out.append(None)
                continue
            cover = located[2]
            last_tok = cover[-1]
            if stop:
                end = next((j for j in range(last_tok + 1, len(r.ids)) if r.markers[j]), None)
                if end is None:
                    out.append(None)
                    continue
                cover += list(range(last_tok + 1, end + 1))
            lp = self.token_logprobs(r.ids.tolist())
            out.append((float(sum(lp[j - 1] for j in cover)), tuple(int(r.ids[j]) for j in cover)))
        return out

    def score_sampled(self, prompt_ids: list[list[int]],
                      sampled: list[list[int]]) -> list[tuple[float, tuple[int, ...]] | None]:
        """A student with the teacher's tokenizer: per sample (the teacher's log-prob of the sampled ids, the stop
        token included, after the prompt ids the student read; those ids), or None for a sample of no token or
        with an id past the tokenizer (a padded output layer)."""
        out, vocab = [], len(self.tokenizer)
        for prompt, ids in zip(prompt_ids, sampled):
            if not ids or not prompt or max(ids) >= vocab:  # an id of a padded output layer names no token
                out.append(None)
                continue
            lp = self.token_logprobs([*prompt, *ids])  # index j - 1: token j given the ones before it
            out.append((float(lp[len(prompt) - 1:].sum()), tuple(int(i) for i in ids)))
        return out

    def score_texts(self, prefixes: list[str], completions: list[str],
                    stopped: list[bool]) -> list[tuple[float, tuple[int, ...]] | None]:
        """Per text prefix and its completion: (teacher log-prob of the completion's characters, and of the
        teacher's end-of-sequence token after them when `stopped`; the teacher ids summed), or None for an
        empty completion that did not stop (or a stop without an end-of-sequence token in the teacher's tokenizer)."""
        eos = self.tokenizer.eos_token_id
        out = []
        for prefix, text, stop in zip(prefixes, completions, stopped):
            enc = self.tokenizer(prefix + text, add_special_tokens=True, return_offsets_mapping=True)
            ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
            a, b = len(prefix), len(prefix) + len(text)
            cover = [j for j, (s, e) in enumerate(offsets) if j >= 1 and s < b and e > a]  # token 0 has no prediction
            if stop and eos is not None:
                ids.append(int(eos))
                cover.append(len(ids) - 1)
            if not cover or (stop and eos is None):
                out.append(None)
                continue
            lp = self.token_logprobs(ids)
            out.append((float(sum(lp[j - 1] for j in cover)), tuple(ids[j] for j in cover)))
        return out

    def close(self) -> None:
        self.model = None


def sample_conversations(prompts: list, texts: list[list[str]]) -> list[dict]:
    """Each sample of conversation prompts as a conversation whose last message is its completion."""
    return [{**p.conversation, "messages": [*p.conversation["messages"], {"role": "assistant", "content": t}]}
            for p, ts in zip(prompts, texts) for t in ts]


def ratio_se(ys: list[float], xs: list[float]) -> float:
    """Delta-method standard error of sum(ys) / sum(xs) over iid pairs (samples of one prompt counted as
    independent)."""
    n, total = len(ys), sum(xs)
    ratio = sum(ys) / total
    var = sum((y - ratio * x) ** 2 for y, x in zip(ys, xs)) / max(1, n - 1)
    return math.sqrt(var / n) / (total / n)


def summarize(scores: list[SampleScore]) -> dict:
    """The report's measures over the scored samples (see the module docstring)."""
    done = [s for s in scores if s.scored]
    n = len(done)
    tokens = sum(s.student_tokens for s in done)
    out = {"samples": len(scores), "scored": n, "unscored": len(scores) - n,
           "mean_student_tokens": tokens / n if n else float("nan"),
           "stopped_fraction": sum(s.stopped for s in scores) / len(scores) if scores else float("nan")}
    measures = ("reverse_kl_per_token", "reverse_kl_per_sequence", "teacher_nll_per_token", "teacher_nll_per_byte")
    if n == 0 or tokens == 0:
        return {**out, **{k + tail: float("nan") for k in measures for tail in ("", "_se")}}
    r = [s.student_logprob - s.teacher_logprob for s in done]
    nll = [-s.teacher_logprob for s in done]
    lengths = [float(s.student_tokens) for s in done]
    nbytes = [float(s.text_bytes) for s in done]
    per_seq = sum(r) / n
    seq_var = sum((ri - per_seq) ** 2 for ri in r) / max(1, n - 1)
    per_byte = (sum(nll) / sum(nbytes), ratio_se(nll, nbytes)) if sum(nbytes) else (float("nan"), float("nan"))
    return {**out, "reverse_kl_per_token": sum(r) / tokens, "reverse_kl_per_token_se": ratio_se(r, lengths),
            "reverse_kl_per_sequence": per_seq, "reverse_kl_per_sequence_se": math.sqrt(seq_var / n),
            "teacher_nll_per_token": sum(nll) / tokens, "teacher_nll_per_token_se": ratio_se(nll, lengths),
            "teacher_nll_per_byte": per_byte[0], "teacher_nll_per_byte_se": per_byte[1]}


def _files_key(path: str) -> tuple:
    """(name, validator) of a file, or of each file directly in a directory (`file_digest.validator`: size, mtime,
    ctime, inode): what a cached result was made from."""
    if os.path.isdir(path):
        files = [(e.name, e.stat()) for e in sorted(os.scandir(path), key=lambda e: e.name) if e.is_file()]
    else:
        files = [(path, os.stat(path))]
    return tuple((name, tuple(validator(st).items())) for name, st in files)


@functools.lru_cache(maxsize=4)
def _teacher_draws(teacher: str, prompts_path: str, samples_per_prompt: int, max_new_tokens: int, seed: int,
                   files: tuple) -> list:
    """The teacher's own samples of the prompts, [(completion, text)], kept for the process: they depend on the
    teacher, the prompts and the draw settings alone (`files`: the state of the teacher's and the prompts' files),
    and a bench grades many students on the same prompts."""
    tokenizer = load_tokenizer(teacher, "teacher tokenizer")
    completions, texts = sample_student(teacher, tokenizer, read_prompts(prompts_path, tokenizer),
                                        samples_per_prompt=samples_per_prompt, max_new_tokens=max_new_tokens, seed=seed)
    return [(c, x) for cs, xs in zip(completions, texts) for c, x in zip(cs, xs)]


def teacher_lengths(teacher: str, prompts_path: str, student_tokenizer, *, samples_per_prompt: int,
                    max_new_tokens: int, seed: int) -> dict:
    """The teacher's own completions of the prompts, sampled as the student's are: their mean UTF-8 bytes, their
    mean length in the student's tokens (the stop token counted where they stopped), the fraction that
    stopped before `max_new_tokens`, and the teacher's NLL per byte of them from the sampler's log-probs
    (`teacher_self_nll_per_byte`: its sampling entropy per byte, estimated; module docstring). The samples are
    drawn once per process for the same teacher, prompts and settings (`_teacher_draws`)."""
    local = os.path.exists(teacher) and os.path.exists(prompts_path)
    files = (_files_key(teacher), _files_key(prompts_path)) if local else None
    flat = (_teacher_draws if local else _teacher_draws.__wrapped__)(
        teacher, prompts_path, samples_per_prompt, max_new_tokens, seed, files)
    n = max(1, len(flat))
    student_tokens = sum(len(student_tokenizer(x, add_special_tokens=False)["input_ids"]) + (c.stop_reason == "stop")
                         for c, x in flat)
    nbytes = sum(len(x.encode("utf-8")) for _, x in flat)
    return {"teacher_mean_bytes": nbytes / n,
            "teacher_self_nll_per_byte": -sum(sum(c.logprobs) for c, _ in flat) / nbytes if nbytes else float("nan"),
            "teacher_mean_student_tokens": student_tokens / n,
            "teacher_stopped_fraction": sum(c.stop_reason == "stop" for c, _ in flat) / n,
            "teacher_max_new_tokens": max_new_tokens}


def policy_eval(student: str, teacher: str, prompts_path: str, *, samples_per_prompt: int = 0,
                max_new_tokens: int = 0, seed: int = 0, teacher_samples: bool = True
                ) -> tuple[dict, list[SampleScore]]:
    """The on-policy measure of `student` against `teacher` on the prompts of `prompts_path`:
    (report, per-sample scores). The reusable entry point (bench/quality.py, the demo). `samples_per_prompt`
    0: at least MIN_SAMPLES samples in all; `max_new_tokens` 0: twice the teacher's mean completion length in
    the student's tokens (needs `teacher_samples`)."""
    if max_new_tokens == 0 and not teacher_samples:  # checked before anything loads
        raise ConfigError("--max-new-tokens 0 (auto) reads the teacher's own samples: drop --no-teacher-samples "
                          "or give --max-new-tokens")
    tokenizer = load_tokenizer(student, "student tokenizer")
    prompts = read_prompts(prompts_path, tokenizer)
    text = prompts[0].conversation is None  # one file, one kind (the corpus reader refuses a row of the other)
    samples_per_prompt = samples_per_prompt or -(-MIN_SAMPLES // len(prompts))
    if samples_per_prompt * len(prompts) < MIN_SAMPLES:
        log.warning("policy-eval: %d samples (%d prompts x %d); at least %d keep the standard errors small: raise "
                    "--samples-per-prompt or give more prompts", samples_per_prompt * len(prompts), len(prompts),
                    samples_per_prompt, MIN_SAMPLES)
    lengths = {}
    if teacher_samples:
        lengths = teacher_lengths(teacher, prompts_path, tokenizer, samples_per_prompt=samples_per_prompt,
                                  max_new_tokens=max_new_tokens or PROBE_TOKENS, seed=seed)
    auto = max_new_tokens == 0
    if auto:
        max_new_tokens = max(8, math.ceil(2 * lengths["teacher_mean_student_tokens"]))
        if lengths["teacher_stopped_fraction"] < 0.5:
            log.warning("policy-eval: only %.0f%% of the teacher's own samples stopped within %d tokens: the auto "
                        "--max-new-tokens %d rests on cut samples; give --max-new-tokens",
                        100 * lengths["teacher_stopped_fraction"], PROBE_TOKENS, max_new_tokens)
    completions, texts = sample_student(student, tokenizer, prompts, samples_per_prompt=samples_per_prompt,
                                        max_new_tokens=max_new_tokens, seed=seed)
    flat = [(p, i, c, t) for p, cs, ts in zip(prompts, completions, texts) for i, (c, t) in enumerate(zip(cs, ts))]
    scorer = TeacherScorer(teacher)
    try:
        stopped = [c.stop_reason == "stop" for _, _, c, _ in flat]
        reads_sampled = _same_tokens(tokenizer, scorer.tokenizer, text)
        if reads_sampled:
            teacher_scores = scorer.score_sampled([p.token_ids for p, _, _, _ in flat], [c.ids for _, _, c, _ in flat])
        elif text:
            teacher_scores = scorer.score_texts([p.text for p, _, _, _ in flat], [t for _, _, _, t in flat], stopped)
        else:
            teacher_scores = scorer.score_turns(sample_conversations(prompts, texts), stopped)
    finally:
        scorer.close()
    scores = [SampleScore(p.prompt_id, i, tuple(c.ids), float(sum(c.logprobs)),
                          float("nan") if ts is None else ts[0], () if ts is None else ts[1],
                          len(t.encode("utf-8")), c.stop_reason == "stop")
              for (p, i, c, t), ts in zip(flat, teacher_scores)]
    report = summarize(scores)
    if report["unscored"]:
        log.warning("policy-eval: %d of %d samples not scored (the teacher's template does not write the text whole, "
                    "an empty completion, or no end-of-turn marker after it); the measures leave them out",
                    report["unscored"], report["samples"])
    report.update(teacher_reads="sampled ids" if reads_sampled else "text",
                  prompts=len(prompts), samples_per_prompt=samples_per_prompt, max_new_tokens=max_new_tokens,
                  max_new_tokens_auto=auto, seed=seed, student=student, teacher=teacher,
                  student_mean_bytes=sum(s.text_bytes for s in scores) / max(1, len(scores)), **lengths)
    return report, scores


def _same_tokens(student_tok, teacher_tok, text: bool) -> bool:
    """Whether the teacher reads the student's prompt and sampled ids as they are: the same tokenizer (text
    prefixes), and the same chat template too (conversations: the prompt ids are the student's rendering)."""
    if text:
        return tokenizer_fingerprint(student_tok) == tokenizer_fingerprint(teacher_tok)
    return chat_fingerprint(student_tok) == chat_fingerprint(teacher_tok)


def _run(cfg: PolicyEvalConfig) -> None:
    import typer

    report, _ = policy_eval(cfg.student, cfg.teacher, cfg.prompts, samples_per_prompt=cfg.samples_per_prompt,
                            max_new_tokens=cfg.max_new_tokens, seed=cfg.seed, teacher_samples=cfg.teacher_samples)
    lengths = ("student_mean_bytes", "teacher_mean_bytes", "teacher_mean_student_tokens",
               "teacher_stopped_fraction", "teacher_self_nll_per_byte") if cfg.teacher_samples else ("student_mean_bytes",)
    for key in ("teacher_reads", "prompts", "samples", "max_new_tokens", "unscored", "mean_student_tokens",
                "stopped_fraction", *lengths):
        typer.echo(f"{key:<26}{report[key]:.4g}" if isinstance(report[key], float) else f"{key:<26}{report[key]}")
    for key in ("reverse_kl_per_token", "reverse_kl_per_sequence", "teacher_nll_per_token", "teacher_nll_per_byte"):
        typer.echo(f"{key:<26}{report[key]:.4f} +- {report[key + '_se']:.4f} (standard error)")
    if cfg.out:
        with open(cfg.out, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
        typer.echo(f"{'report':<26}{cfg.out}")


policy_eval_command = command(
    PolicyEvalConfig, _run, name="policy_eval",
    help="On-policy measure: the student samples held-out prompts, the live teacher scores them (reverse KL, NLL).",
    paths={"student": "dir", "teacher": "dir"})
