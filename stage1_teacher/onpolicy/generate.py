"""`xtcache generate`: the student samples completions for a prompt set; the rollouts are a corpus
that `teacher-dump --data 'OUT/parts/*.jsonl'` reads as it is (`stage1_teacher.onpolicy.rollouts`).

The prompt files are read as teacher-dump reads `--data` (`stage1_teacher.corpus`: JSONL, Parquet,
Arrow, local or fsspec URLs, the messages field detected the same way). `N` jobs (`--num-shards`,
`--shard-index` or the launcher's environment) split them by rows, not by teacher-dump's byte plan:
job `j` samples rows `j, j + N, j + 2N, ...` of the whole prompt set (`job_share`), so one JSONL
file feeds every job and their prompt counts differ by at most one. Each job reads the whole set
(prompts are small beside what sampling them costs). A job's prompts form parts of
`--prompts-per-part` prompts, a fixed run of its stream; each part is written whole, then named in
the writer's index, so a job killed at any point and started again with `--resume` keeps its
committed parts and generates the others. With `--engine hf` the resumed run writes exactly the
rollouts of an uninterrupted one (per-sample seeds).

    xtcache generate --student OUT/hf --data prompts.jsonl --out rollouts --samples-per-prompt 4 --engine hf
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import Iterator

from stage1_teacher.capture.preflight import open_corpus
from stage1_teacher.corpus import Skipped, iter_corpus
from stage1_teacher.onpolicy.generate_config import GenerateConfig
from stage1_teacher.onpolicy.rollouts import (
    ROLLOUT_FORMAT,
    committed_parts,
    completion_text,
    done_name,
    index_name,
    open_manifest,
    part_name,
    policy_fingerprint,
    policy_settings,
    prompt_of,
    rollout_row,
    write_part,
)
from stage1_teacher.onpolicy.samplers import HfSampler, VllmSampler
from stage1_teacher.placement import place_job
from xtcache.errors import ConfigError, StoreError
from xtcache.fingerprint import listing_fingerprint
from xtcache.location import Location
from xtcache.store.claims import Claim, writer_claim_path
from xtcache.tokenizer import load_tokenizer

log = logging.getLogger(__name__)

SPLIT = "rows"  # the manifest's name for `job_share`'s split (rollouts of several jobs before it have none)


@dataclass
class GenerateSummary:
    out: str
    policy: str
    writer: int
    num_writers: int
    prompts: int = 0
    rows: int = 0
    parts_written: int = 0
    parts_kept: int = 0
    generated_tokens: int = 0
    stopped: int = 0
    reproducible: bool = True
    notes: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        return [f"rollouts            {self.out} (writer {self.writer} of {self.num_writers})",
                f"policy              {self.policy[:16]}..",
                f"prompts             {self.prompts} ({self.rows} rows, {self.generated_tokens} generated tokens, "
                f"{self.stopped} stopped, {self.rows - self.stopped} at --max-new-tokens)",
                f"parts               {self.parts_written} written, {self.parts_kept} kept from an earlier run",
                f"reproducible        {'yes' if self.reproducible else 'no (vLLM on CPU: see the log)'}",
                *self.notes]


@dataclass
class RowCount:
    seen: int = 0  # rows of the whole prompt set read so far, every job's


def job_share(items, job: int, jobs: int, count: RowCount):
    """Job `job`'s rows of the prompt set's stream `items`: rows job, job + jobs, job + 2 jobs, ... (a row
    not usable as a prompt is the business of the job it falls to); `count` counts every row read."""
    for i, item in enumerate(items):
        count.seen = i + 1
        if i % jobs == job:
            yield item


def prompt_parts(items, size: int) -> Iterator[tuple[int, list]]:
    """(part index, documents) of a job's stream; a row that is not a usable prompt is refused."""
    part, docs = 0, []
    for item in items:
        if isinstance(item, Skipped):
            raise ConfigError(f"--data {item.source} row {item.row}: {item.reason}; every row of a prompt set must be "
                              "a prompt (fix or remove the row)")
        docs.append(item)
        if len(docs) == size:
            yield part, docs
            part, docs = part + 1, []
    if docs:
        yield part, docs


def _manifest(cfg: GenerateConfig, policy: dict, corpus) -> dict:
    return {"kind": "xtcache-rollouts", "format_version": ROLLOUT_FORMAT, "policy": policy["policy"],
            "model_fingerprint": policy["model"], "chat_fingerprint": policy["chat"],
            "sampling": policy_settings(cfg.sampling), "student": str(cfg.student), "engine": cfg.engine,
            "prompts_per_part": cfg.output.prompts_per_part, "num_shards": cfg.output.num_shards, "split": SPLIT,
            "messages_field": corpus.messages_field, "text_field": corpus.text_field,
            "data": listing_fingerprint((f.name, f.size) for f in corpus.files)}


def _sampler(cfg: GenerateConfig, tokenizer):
    if cfg.engine == "hf":
        return HfSampler(cfg.student, tokenizer, dtype=cfg.dtype)
    return VllmSampler(cfg.student, tokenizer, dtype=cfg.dtype, gpu_memory_utilization=cfg.gpu_memory_utilization,
                       seed=cfg.sampling.seed)


def _open_writer(cfg: GenerateConfig, loc, writer: int):
    """This writer's claim, taken (or taken over with --resume), and its committed parts; None when
    the writer is done already and --resume was given."""
    o = cfg.output
    if loc.exists(done_name(writer)):
        if o.resume:
            return None
        raise StoreError(f"--out {o.out}: writer {writer} has generated all its parts already; use another --out")
    committed = committed_parts(loc, writer)
    if committed and not o.resume:
        raise StoreError(f"--out {o.out}: writer {writer} has {len(committed)} committed parts; continue with "
                         "--resume (keeps them) or use another --out")
    claim = Claim(loc, writer_claim_path(writer), writer, f"writer {writer} (claims/w{writer:05d}.json)")
    claim.require_exclusive(o.num_shards > 1)
    claim.acquire(resume=o.resume)
    return claim, committed


def run_generate(cfg: GenerateConfig) -> GenerateSummary:
    """Generate this job's parts of the rollouts (see the module docstring)."""
    o, w = cfg.output, cfg.output.shard_index
    place_job(1)  # one GPU per job under a launcher's several jobs per node (the student runs unsharded)
    corpus = open_corpus(cfg)
    for f in corpus.files:  # before the student is loaded: refused in a second
        if f.size == 0:
            raise ConfigError(f"--data {f.url}: the file is empty; give prompt files with at least one row")
    tokenizer = load_tokenizer(cfg.student, "--student")
    policy = policy_fingerprint(cfg.student, tokenizer, cfg.sampling)
    loc = Location(o.out, o.storage_options)
    open_manifest(loc, _manifest(cfg, policy, corpus))
    summary = GenerateSummary(out=o.out, policy=policy["policy"], writer=w, num_writers=o.num_shards)
    opened = _open_writer(cfg, loc, w)
    if opened is None:
        summary.notes.append(f"writer {w} was done already: nothing generated")
        return summary
    claim, committed = opened
    sampler = None
    try:
        read = RowCount()
        todo = _parts_to_generate(job_share(iter_corpus(corpus), w, o.num_shards, read), committed, tokenizer, cfg,
                                  summary)
        first = next(todo, None)
        if first is not None:
            sampler = _sampler(cfg, tokenizer)
            for part, prompts, completions in sampler.stream(itertools.chain([first], todo), cfg.sampling):
                rows = _rows(prompts, completions, tokenizer, sampler.stop, policy, summary)
                claim.check("committing a part")
                sha = write_part(loc, part_name(w, part), rows)
                committed[part] = {"part": part, "name": part_name(w, part), "rows": len(rows),
                                   "prompts": len(prompts), "sha256": sha}
                loc.write_json_atomic(index_name(w), {"writer": w, "parts": [committed[p] for p in sorted(committed)]})
                summary.parts_written += 1
        if read.seen == 0:
            raise ConfigError(f"--data {', '.join(corpus.urls)}: no prompts")
        summary.reproducible = sampler is None or sampler.reproducible
        claim.check("marking the writer done")
        loc.write_json_atomic(done_name(w), {"writer": w, "parts": len(committed), "policy": policy["policy"],
                                             "reproducible": summary.reproducible})
    finally:
        if sampler is not None:
            sampler.close()
        claim.release()
    return summary


def _parts_to_generate(items, committed: dict, tokenizer, cfg: GenerateConfig, summary: GenerateSummary):
    """(part, prompts) of the job's parts not committed yet, read lazily from the job's stream; the
    committed ones are counted in `summary` and skipped."""
    for part, docs in prompt_parts(items, cfg.output.prompts_per_part):
        summary.prompts += len(docs)
        if part in committed:
            summary.parts_kept += 1
            summary.rows += committed[part]["rows"]
            continue
        yield part, [prompt_of(d, tokenizer) for d in docs]


def _rows(prompts, completions, tokenizer, stop: set[int], policy: dict, summary: GenerateSummary) -> list[dict]:
    """The rollout rows of one part: each prompt's completions, in sample order."""
    rows = []
    for prompt, samples in zip(prompts, completions, strict=True):
        for i, c in enumerate(samples):
            rows.append(rollout_row(prompt, i, c, completion_text(tokenizer, c, stop), policy["policy"],
                                    policy["chat"]))
            summary.generated_tokens += len(c.ids)
            summary.stopped += c.stop_reason == "stop"
    summary.rows += len(rows)
    return rows
