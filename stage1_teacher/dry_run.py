"""`xtcache teacher-dump --dry-run`: the documents, positions and an estimated store size of this
job's share of the corpus, from tokenizing and aligning it, without the teacher.

    xtcache teacher-dump --teacher T --student-tokenizer S --data corpus.jsonl --out store --dry-run
"""

from __future__ import annotations

from dataclasses import dataclass, field

from schemas.arrays import entry_widths
from stage1_teacher.config import TeacherDumpConfig
from stage1_teacher.corpus import iter_corpus
from stage1_teacher.plan import Plan
from stage1_teacher.prep import Preparer, iter_parts
from xtcache.store.codecs import codec_from_config, default_codecs, side_dtype


@dataclass
class DryRun:
    """This job's share of the corpus as the teacher would see it, and the store it would write."""

    store: str
    cache_key: str
    documents: int = 0
    positions: int = 0  # teacher positions
    windows: int = 0  # teacher windows
    student_tokens: int = 0
    chunks: int = 0
    skipped: dict[str, int] = field(default_factory=dict)  # documents skipped, by reason
    bytes_per_position_before_compression: int = 0
    estimated_bytes_before_compression: int = 0

    def lines(self) -> list[str]:
        skipped = ", ".join(f"{k}: {v}" for k, v in sorted(self.skipped.items())) or "none"
        return [
            f"documents           {self.documents}",
            f"positions           {self.positions} in {self.windows} teacher windows",
            f"student tokens      {self.student_tokens} ({self.chunks} chunks)",
            f"estimated size      {self.estimated_bytes_before_compression / 1e6:.2f} MB before compression "
            f"({self.bytes_per_position_before_compression} B/position)",
            f"skipped documents   {skipped}",
            f"store               {self.store} (dry run: nothing written)",
        ]


def dry_run(cfg: TeacherDumpConfig, plan: Plan) -> DryRun:
    """Documents, positions and an estimated store size, without the teacher."""
    import numpy as np

    prep = Preparer(plan.teacher_tok, plan.students, window_len=plan.window_len, overlap=cfg.capture.window_overlap,
                    conversation=plan.messages_field is not None)
    docs = positions = windows = student_tokens = chunks = 0
    skipped: dict[str, int] = {}
    rows = iter_corpus(plan.corpus, plan=plan.shard_plan, job=cfg.store.shard_index)
    for part in iter_parts(rows, prep, docs_per_part=cfg.store.docs_per_part, max_positions=plan.part_positions):
        for s in part.skipped:
            skipped[s.reason] = skipped.get(s.reason, 0) + 1
        for pd in part.docs:
            docs += 1
            positions += pd.num_tokens
            windows += len(pd.windows)
            for r in pd.alignments.values():
                student_tokens += len(r.student_ids)
                chunks += len(r.alignment.student_end)
    mode, top_k = cfg.capture.mode, cfg.capture.top_k
    codec = default_codecs(mode, plan.vocab_size, k=plan.k, top_k=top_k)
    widths = entry_widths(mode, plan.k, top_k)
    id_bytes = np.dtype(codec["topk_ids"]["configuration"].get("dtype", "uint32")).itemsize
    lp_bytes = 0
    if "topk_logprobs" in codec:
        lp_bytes = np.dtype(codec_from_config(codec["topk_logprobs"]).dtype).itemsize
    # ids, log-probs of the head, uint16 counts of the tail (schemas.arrays.entry_widths)
    per_position = (plan.k * id_bytes + widths["k_head"] * lp_bytes + widths["k_tail"] * 2
                    + 4 + 8 + 1 + 2 * np.dtype(side_dtype()).itemsize)
    raw = positions * per_position + student_tokens * 4 + chunks * 9
    return DryRun(store=plan.out, cache_key=plan.cache_key, documents=docs, positions=positions, windows=windows,
                  student_tokens=student_tokens, chunks=chunks, skipped=skipped,
                  bytes_per_position_before_compression=int(per_position), estimated_bytes_before_compression=int(raw))
