"""What a part holds, as plain numpy: the records stage 1 writes and the decoded parts readers get.

    python -c "from xtcache.store.records import DocRecord; help(DocRecord)"
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from schemas.models import DocId
from xtcache.align.chunks import Alignment
from xtcache.fingerprint import content_hash, doc_id


@dataclass
class DocRecord:
    """One document as stage 1 writes it (teacher-position-major arrays, see docs/architecture.md)."""

    source: str
    row: int
    text: str
    teacher_ids: np.ndarray  # int32 [T]
    char_offsets: np.ndarray  # int32 [T, 2]
    has_pred: np.ndarray  # bool [T]
    topk_ids: np.ndarray  # int32 [T, k]; headtail: the head's k_head ids first, then the tail's
    topk_logprobs: np.ndarray | None  # float32 [T, k_head] (schemas.arrays.entry_widths); None in sampled mode
    topk_counts: np.ndarray | None  # uint16 [T, k_tail]; sampled and headtail modes, 0 = padding
    residual: np.ndarray  # float32 [T]
    realized_logprob: np.ndarray  # float32 [T]; NaN where not has_pred
    content_hash: str = ""
    conversation: str | None = None  # conversation stores: the conversation's JSON (text = its rendering)

    def __post_init__(self):
        if not self.content_hash:
            self.content_hash = content_hash(self.text)

    @property
    def doc_id(self) -> str:
        return doc_id(self.source, self.row, self.content_hash)


@dataclass
class AlignmentRecord:
    """One document's student tokens and its chunk alignment (an xtcache.align.chunks.Alignment)."""

    student_ids: np.ndarray  # int32 [S]
    alignment: Any  # Alignment: student_end int32 [C], teacher_end int32 [C], exact bool [C]
    student_role: np.ndarray | None = None  # uint8 [S] conversation stores: xtcache.chat.layout role code per token
    stats: dict | None = None  # conversation stores: content/unaligned character counts (xtcache.chat.layout)
    sampled_logprobs: np.ndarray | None = None  # float32 [S] rollouts: the sampling policy's log-prob, NaN: not sampled


@dataclass
class ShardData:
    """Decoded teacher arrays of one part, concatenated over its documents (plain numpy)."""

    shard_id: str
    docs: list[DocId]
    texts: list[str]
    doc_pos_offsets: np.ndarray  # int64 [D+1]
    teacher_ids: np.ndarray  # int32 [P]
    char_offsets: np.ndarray  # int32 [P, 2]
    has_pred: np.ndarray  # bool [P]
    # int32 [P, k]: each row ascending by id, or by dictionary code (xtcache.dict_delta_ids, a set in no id
    # order); headtail: the head's k_head, then the tail's
    topk_ids: np.ndarray
    topk_logprobs: np.ndarray | None  # float32 [P, k_head] (schemas.arrays.entry_widths)
    topk_counts: np.ndarray | None  # uint16 [P, k_tail]
    residual: np.ndarray  # float32 [P]
    realized_logprob: np.ndarray  # float32 [P]
    conversations: list[str] | None = None  # conversation stores: per document, the messages' JSON

    @property
    def num_docs(self) -> int:
        return len(self.docs)

    def doc_ids(self) -> list[str]:
        return [doc_id(d.source, d.row, d.content_hash) for d in self.docs]

    def doc(self, i: int) -> DocRecord:
        a, b = int(self.doc_pos_offsets[i]), int(self.doc_pos_offsets[i + 1])
        d = self.docs[i]
        return DocRecord(
            source=d.source, row=d.row, text=self.texts[i], teacher_ids=self.teacher_ids[a:b],
            char_offsets=self.char_offsets[a:b], has_pred=self.has_pred[a:b], topk_ids=self.topk_ids[a:b],
            topk_logprobs=None if self.topk_logprobs is None else self.topk_logprobs[a:b],
            topk_counts=None if self.topk_counts is None else self.topk_counts[a:b],
            residual=self.residual[a:b], realized_logprob=self.realized_logprob[a:b], content_hash=d.content_hash,
            conversation=None if self.conversations is None else self.conversations[i])


@dataclass
class AlignShardData:
    """Student tokens and chunks of one part for one student tokenizer (plain numpy)."""

    fingerprint: str
    shard_id: str
    doc_student_offsets: np.ndarray  # int64 [D+1]
    doc_chunk_offsets: np.ndarray  # int64 [D+1]
    student_ids: np.ndarray  # int32 [S]
    student_end: np.ndarray  # int32 [C] per-document exclusive ends
    teacher_end: np.ndarray  # int32 [C]
    exact: np.ndarray  # bool [C]
    student_role: np.ndarray | None = None  # uint8 [S] conversation stores and text rollouts
    sampled_logprobs: np.ndarray | None = None  # float32 [S] optional: the sampling policy's log-probs (NaN: none)

    def record(self, i: int) -> AlignmentRecord:
        a, b = int(self.doc_student_offsets[i]), int(self.doc_student_offsets[i + 1])
        c0, c1 = int(self.doc_chunk_offsets[i]), int(self.doc_chunk_offsets[i + 1])
        return AlignmentRecord(
            student_ids=self.student_ids[a:b],
            student_role=None if self.student_role is None else self.student_role[a:b],
            sampled_logprobs=None if self.sampled_logprobs is None else self.sampled_logprobs[a:b],
            alignment=Alignment(student_end=self.student_end[c0:c1], teacher_end=self.teacher_end[c0:c1],
                                exact=self.exact[c0:c1]))
