"""The arrays of a part: the one table of names, stored dtypes, shapes, transforms and compression.

Everything that writes, reads or checks arrays goes through this table: the writer
(`xtcache/store/writer.py`) takes compression and the set of arrays from it, the reader
(`xtcache/store/reader.py`) checks each index against it, and `schemas/STORE_FORMAT.md` sections
4.1 and 5 are compared with it by tests/test_store_format.py.

Shapes are written with the counts of a part: `D` documents, `P` teacher positions, `k` entries
per position (the manifest's `k`), `k_head` of them with a log-prob and `k_tail` with a draw count
(`entry_widths`), `B` text bytes, `M` conversation bytes, `U` distinct top-k ids (the length of
`topk_id_dict`), `S` student tokens, `C` chunks.
Arrays marked `conversation` are held by the parts of conversation stores only (manifest field
`conversation`, format version 2). Arrays marked `optional` may be absent from a part that could
hold them: `sampled_logprobs`, written for the alignment group of the student that sampled a
rollout corpus (`xtcache generate`) only. Arrays marked `id_dictionary` are held by the parts whose
`topk_ids` transform is `xtcache.dict_delta_ids` (topk stores from format version 4) only.

    python -c "from schemas.arrays import TEACHER_ARRAYS; print([a.name for a in TEACHER_ARRAYS])"
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from schemas.models import DRAWN_MODES

CHECKSUM_CODEC = "crc32c"
"""The Zarr v3 bytes-to-bytes codec that ends every inner chunk's codec chain (section 4.2)."""


@dataclass(frozen=True)
class ArrayDef:
    """One array of a teacher part or an alignment part."""

    name: str
    dtypes: tuple[str, ...]  # stored numpy dtype names a reader accepts
    shape: tuple[str, ...]  # symbolic dimensions over D, P, k, k_head, k_tail, B, M, U, S, C (or a number)
    modes: tuple[str, ...] = ("topk", "full", "sampled", "headtail")  # modes whose parts hold it
    transform: str | None = None  # 'ids', 'logprobs' or 'offsets' (version 3): a transform named in the manifest
    shuffle: bool = False  # default compression: byte shuffle + zstd (blosc) instead of plain zstd
    conversation: bool = False  # held by the parts of conversation stores only
    optional: bool = False  # a part may hold it or not (its index says); readers accept both
    id_dictionary: bool = False  # held by the parts whose ids are dictionary coded only (its transform: the ids')

    def resolve(self, counts: dict[str, int]) -> tuple[int, ...]:
        """The concrete shape for a part's counts, e.g. {"D": 3, "P": 100, "k": 8}."""
        out = []
        for dim in self.shape:
            if dim.isdigit():
                out.append(int(dim))
            elif dim.endswith("+1"):
                out.append(counts[dim[:-2]] + 1)
            else:
                out.append(counts[dim])
        return tuple(out)


TEACHER_ARRAYS: tuple[ArrayDef, ...] = (
    ArrayDef("doc_pos_offsets", ("int64",), ("D+1",)),
    ArrayDef("doc_text_offsets", ("int64",), ("D+1",)),
    ArrayDef("doc_text", ("uint8",), ("B",)),
    ArrayDef("teacher_ids", ("int32",), ("P",), shuffle=True),
    ArrayDef("char_offsets", ("int32",), ("P", "2"), transform="offsets"),
    ArrayDef("has_pred", ("bool",), ("P",)),
    ArrayDef("topk_ids", ("uint16", "uint32"), ("P", "k"), transform="ids", shuffle=True),
    ArrayDef("topk_id_dict", ("int32",), ("U",), modes=("topk",), transform="ids", shuffle=True, id_dictionary=True),
    ArrayDef("topk_logprobs", ("uint8", "uint16", "float16", "float32"), ("P", "k_head"),
             modes=("topk", "full", "headtail"), transform="logprobs"),
    ArrayDef("topk_counts", ("uint16",), ("P", "k_tail"), modes=DRAWN_MODES),
    ArrayDef("residual", ("float32", "float16"), ("P",), shuffle=True),
    ArrayDef("realized_logprob", ("float32", "float16"), ("P",), shuffle=True),
    ArrayDef("doc_conversation_offsets", ("int64",), ("D+1",), conversation=True),
    ArrayDef("doc_conversation", ("uint8",), ("M",), conversation=True),
)
"""Arrays of `shards/{S}/`, in the order a part is written."""

ALIGN_ARRAYS: tuple[ArrayDef, ...] = (
    ArrayDef("doc_student_offsets", ("int64",), ("D+1",)),
    ArrayDef("doc_chunk_offsets", ("int64",), ("D+1",)),
    ArrayDef("student_ids", ("int32",), ("S",), shuffle=True),
    ArrayDef("student_end", ("int32",), ("C",)),
    ArrayDef("teacher_end", ("int32",), ("C",)),
    ArrayDef("exact", ("bool",), ("C",)),
    ArrayDef("student_role", ("uint8",), ("S",), conversation=True),
    ArrayDef("sampled_logprobs", ("float32",), ("S",), conversation=True, optional=True),
)
"""Arrays of `align/{F}/shards/{S}/`, in the order an alignment part is written."""


def entry_widths(mode: str, k: int, top_k: int | None = None) -> dict[str, int]:
    """The widths of a part's entry arrays: `k` ids per position (`topk_ids`), the first `k_head` of
    them with a log-prob (`topk_logprobs`) and the other `k_tail` with a draw count (`topk_counts`).

    topk and full modes: every entry has a log-prob (k_head = k); sampled mode: every entry is a draw
    (k_tail = k); headtail mode: the manifest's `top_k` head entries, then k - top_k tail entries.
    """
    if mode == "headtail":
        if top_k is None or not 0 < top_k <= k:
            raise ValueError(f"mode headtail: top_k {top_k} must be in [1, k={k}]")
        return {"k": k, "k_head": top_k, "k_tail": k - top_k}
    return {"k": k, "k_head": 0 if mode == "sampled" else k, "k_tail": k if mode == "sampled" else 0}


def teacher_arrays(mode: str, conversation: bool = False, id_dictionary: bool = False) -> tuple[ArrayDef, ...]:
    """The arrays a teacher part of `mode` holds (of a conversation store: `conversation`; whose ids are
    dictionary coded: `id_dictionary`)."""
    return tuple(a for a in TEACHER_ARRAYS if mode in a.modes and (conversation or not a.conversation)
                 and (id_dictionary or not a.id_dictionary))


TEXT_ROLLOUT_ARRAYS = ("student_role", "sampled_logprobs")
"""The conversation arrays a plain-text store's alignment part may hold too: its documents are text rollouts
(`xtcache generate` on text prefixes), the prompt's tokens and the completion's told apart by role."""


def align_arrays(conversation: bool = False) -> tuple[ArrayDef, ...]:
    """The arrays an alignment part holds (of a conversation store: `conversation`; of a plain-text store,
    the text rollouts' `TEXT_ROLLOUT_ARRAYS` are optional)."""
    return tuple(a if conversation or not a.conversation else replace(a, optional=True) for a in ALIGN_ARRAYS
                 if conversation or not a.conversation or a.name in TEXT_ROLLOUT_ARRAYS)


def array_def(name: str) -> ArrayDef:
    for a in (*TEACHER_ARRAYS, *ALIGN_ARRAYS):
        if a.name == name:
            return a
    raise KeyError(name)
