"""Pydantic models of every JSON document in an xtcache store (format version 1).

The store's metadata is plain JSON validated by these models: the manifest (`manifest.json`), one
index file per committed teacher part (`index/<shard>.json`), one per committed alignment part
(`align/<fingerprint>/index/<shard>.json`), alignment-group metadata, writer claims and writer done
markers. `schemas/STORE_FORMAT.md` describes the layout; the JSON Schema files beside this module are
exported from these models:

    python -m schemas.export          # rewrite schemas/*.schema.json
    python -m schemas.export --check  # fail if the committed files are stale
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

FORMAT_VERSION = 4
"""Version of the on-disk layout; written to the manifest and to every part's metadata."""

READ_VERSIONS = (1, 2, 3, 4)
"""Versions a reader of this xtcache reads: 2 added conversation stores; a version 1 store is a
plain-text store of version 2's layout (and keeps version 1 when an alignment group is added);
3 added the sqrt-prob value code and float16 residual / realized log-prob (codec v2); 4 added
dictionary coded top-k ids with the part's `topk_id_dict` (codec v3, topk mode)."""

Mode = Literal["topk", "full", "sampled", "headtail"]
DRAWN_MODES = ("sampled", "headtail")
"""Modes whose parts store draws from the teacher (ids with `topk_counts`): an unbiased estimate, at T = 1."""


def support_width(mode: str, top_k: int, num_samples: int, vocab_size: int) -> int:
    """The store's `k` (entries per teacher position) for a capture: `--top-k` in topk mode, the
    vocabulary V in full mode, min(`--num-samples`, V) in sampled mode, and in headtail mode the
    head plus room for every distinct tail draw: `--top-k` + min(`--num-samples`, V - `--top-k`).

    The one place that checks "k at most the vocabulary": ValueError naming --top-k otherwise.
    """
    if mode in ("topk", "headtail") and top_k > vocab_size:
        raise ValueError(f"--top-k {top_k} is larger than the teacher vocabulary ({vocab_size}); "
                         "use --mode full to store every id")
    if mode == "headtail":
        return top_k + min(num_samples, vocab_size - top_k)
    return {"topk": top_k, "full": vocab_size, "sampled": min(num_samples, vocab_size)}[mode]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=False)


class CodecConfig(_Model):
    """One transform or compressor: `{"name": ..., "configuration": {...}}` (Zarr v3 style)."""

    name: str = Field(description="Codec name, e.g. 'xtcache.sorted_delta_ids' or 'zstd'.")
    configuration: dict[str, Any] = Field(default_factory=dict, description="Codec parameters.")


class ArraySpec(_Model):
    """One Zarr v3 array of a part: what it holds, how it is encoded and its checksum."""

    name: str = Field(description="Array name inside the part's group, e.g. 'topk_ids'.")
    dtype: str = Field(description="Stored numpy dtype name (little-endian), e.g. 'uint32'.")
    shape: list[int] = Field(description="Stored shape.")
    chunks: list[int] = Field(description="Inner chunk shape (the whole array is one shard).")
    transform: CodecConfig | None = Field(
        default=None, description="xtcache transform applied before storing (None: values stored as is).")
    compressors: list[CodecConfig] = Field(default_factory=list, description="Zarr bytes-to-bytes codecs.")
    sha256: str = Field(description="sha256 of the stored values, C order, little-endian bytes.")
    stored_bytes: int = Field(default=0, description="Bytes the array occupies in the store.")


class AlignGroupMeta(_Model):
    """A student tokenizer whose alignment to the teacher tokens is stored (one per fingerprint)."""

    format_version: int = FORMAT_VERSION
    fingerprint: str = Field(description="tokenizer_fingerprint of the student tokenizer.")
    tokenizer_name: str = Field(default="", description="Human-readable tokenizer name or path.")
    vocab_size: int = Field(ge=0, description="Student vocabulary size (len(tokenizer)).")
    identity: bool = Field(default=False, description="Student tokenizer equals the teacher's: chunks are 1:1.")
    stats: dict[str, float | int] = Field(
        default_factory=dict, description="Alignment statistics (chunk shape counts, exact share, ...).")
    created: str = Field(default="", description="ISO 8601 UTC time the group was declared.")


class ShardPlanMeta(_Model):
    """The shard plan the store's writers read the corpus by (`shard_plan.json` holds all of it)."""

    fingerprint: str = Field(description="sha256 of the plan: corpus listing (names, sizes, Parquet row groups), "
                                         "number of jobs and every job's ranges.")
    num_jobs: int = Field(ge=1, description="Jobs (writers) the corpus was split for.")
    num_files: int = Field(ge=0, description="Corpus files in the listing.")
    corpus_bytes: int = Field(ge=0, description="Bytes the plan reads in total (Parquet: the text column).")
    max_job_bytes: int = Field(ge=0, description="Bytes read by the job with the most.")


class ShardPlanFile(_Model):
    """`shard_plan.json`: the corpus listing and every job's contiguous ranges, stored by writer 0."""

    format_version: int = FORMAT_VERSION
    num_jobs: int = Field(ge=1)
    fingerprint: str = Field(description="Same as the manifest's shard_plan.fingerprint.")
    corpus_fingerprint: str = Field(default="", description="corpus_fingerprint() of the files, taken by writer 0.")
    files: list[dict[str, Any]] = Field(
        description="Per file: name (base name), size, format and, for Parquet, row_groups as [rows, text bytes].")
    jobs: list[list[list[int]]] = Field(
        description="Per job: ranges [file, first row group, end row group) (whole-file formats: [file, 0, 1]).")


class CaptureCheck(_Model):
    """`capture_checks/<key>.json`: one first-batch check of the vLLM fast path, trusted by the other
    writers and resumed jobs whose teacher, vLLM version, platform, model runner, execution mode,
    dtype and tensor-parallel size match (all of them are in the key)."""

    format_version: int = FORMAT_VERSION
    key: str = Field(description="sha256 of the canonical JSON of the fields from teacher_model to tensor_parallel_size.")
    teacher_model: str = Field(description="model_fingerprint of the teacher that was checked.")
    vllm_version: str
    platform: str = Field(default="", description="'cpu', or 'cuda:' + the CUDA device's name.")
    model_runner_requested: str = Field(default="auto", description="VLLM_USE_V2_MODEL_RUNNER: v1, v2 or auto.")
    enforce_eager: bool | None = Field(default=None, description="Eager (true) or compiled (false) execution.")
    dtype: str
    tensor_parallel_size: int = Field(ge=1)
    model_runner: str = Field(default="", description="The model runner the checked engine ran: v1 or v2.")
    passed: bool = Field(description="False: the fast path disagreed with the reference; writers refuse to finish.")
    max_gap: float | None = Field(default=None, description="Largest |fast - reference| log-prob gap measured.")
    mean_gap: float | None = Field(default=None, description="Mean |fast - reference| log-prob gap measured.")
    logit_max: float | None = Field(default=None, description="Largest |logit| of the checked rows (sets the "
                                                                "half-precision tolerance).")
    tolerance: float
    mean_tolerance: float | None = Field(default=None, description="Bound on the mean gap.")
    windows: int = Field(ge=0, description="First-batch windows compared.")
    reference: str = Field(description="What the fast path was compared against.")
    writer_index: int = Field(ge=0, description="Writer that ran the check.")
    created: str = Field(default="", description="ISO 8601 UTC time of the check.")


class Manifest(_Model):
    """The store-wide settings; written once when the store is created."""

    format_version: int = FORMAT_VERSION
    cache_key: str = Field(description="cache_key() of teacher, tokenizer, corpus and capture settings.")
    mode: Mode = Field(description="'topk', 'full' (k = teacher vocab), 'sampled' (ids + counts) or 'headtail' "
                                   "(exact top-k head + counts of draws from the tail).")
    k: int = Field(ge=1, description="Entries per teacher position: --top-k in topk mode, V in full mode, "
                                     "min(--num-samples, V) in sampled mode, --top-k + min(--num-samples, "
                                     "V - --top-k) in headtail mode (support_width).")
    teacher_vocab_size: int = Field(ge=1, description="Teacher vocabulary size V; every stored id is in [0, V).")
    num_samples: int | None = Field(default=None, description="Draws per position in sampled and headtail modes.")
    top_k: int | None = Field(default=None, ge=1, description="Head entries per position in headtail mode "
                                                              "(exact log-probs); None in the other modes.")
    num_writers: int = Field(default=1, ge=1, description="Writers that fill the store (shards w00000..).")
    teacher_name: str = Field(default="", description="Teacher model name or path.")
    fingerprints: dict[str, str] = Field(
        default_factory=dict, description="Component fingerprints: teacher_model, teacher_tokenizer, corpus, settings.")
    settings: dict[str, Any] = Field(default_factory=dict, description="Capture settings (free-form JSON).")
    codecs: dict[str, CodecConfig] = Field(
        default_factory=dict,
        description="Transforms for 'topk_ids' and 'topk_logprobs'; filled with defaults when empty.")
    alignment_groups: list[AlignGroupMeta] = Field(
        default_factory=list, description="Alignment groups written together with the teacher parts.")
    created: str = Field(default="", description="ISO 8601 UTC creation time.")
    xtcache_version: str = Field(default="", description="Version of xtcache that created the store.")
    shard_plan: ShardPlanMeta | None = Field(
        default=None, description="The plan the writers split the corpus by (None: written by one job).")
    conversation: bool = Field(
        default=False, description="Documents are conversations rendered in the teacher's chat template: parts "
                                   "hold doc_conversation(_offsets), alignment parts student_role (version 2).")

    @model_validator(mode="after")
    def _k_is_a_support_width(self) -> "Manifest":
        if self.mode == "headtail":
            if self.top_k is None or self.num_samples is None:
                raise ValueError("mode headtail: the manifest needs top_k and num_samples")
            if support_width("headtail", self.top_k, self.num_samples, self.teacher_vocab_size) != self.k:
                raise ValueError(f"mode headtail: k={self.k} is not top_k {self.top_k} + min(num_samples "
                                 f"{self.num_samples}, V - top_k) for the teacher vocabulary {self.teacher_vocab_size}")
            return self
        if support_width(self.mode, self.k, self.k, self.teacher_vocab_size) != self.k:
            raise ValueError(f"mode {self.mode}: k={self.k} does not fit the teacher vocabulary "
                             f"{self.teacher_vocab_size} (full mode stores every id: k = V; otherwise k <= V)")
        return self


class DocId(_Model):
    """Identity of one document: where it came from and a hash of its text."""

    source: str
    row: int
    content_hash: str


class ShardMeta(_Model):
    """Index of one committed teacher part; its presence is what makes the part visible."""

    format_version: int = FORMAT_VERSION
    shard_id: str = Field(description="'w{writer:05d}-p{part:06d}'.")
    writer_index: int = Field(ge=0)
    part_index: int = Field(ge=0)
    mode: Mode
    k: int = Field(ge=1)
    teacher_vocab_size: int | None = Field(
        default=None, description="The manifest's teacher_vocab_size when the part was written (absent in older stores).")
    num_docs: int = Field(ge=0)
    num_positions: int = Field(ge=0, description="Teacher positions (tokens) over all documents.")
    num_predicted: int = Field(ge=0, description="Positions with has_pred = True.")
    docs: list[DocId] = Field(default_factory=list)
    arrays: dict[str, ArraySpec] = Field(default_factory=dict)
    stats: dict[str, float | int] = Field(default_factory=dict, description="e.g. mean_topk_mass.")
    created: str = ""


class AlignPartMeta(_Model):
    """Index of one committed alignment part (one student tokenizer, one teacher part)."""

    format_version: int = FORMAT_VERSION
    fingerprint: str
    shard_id: str
    num_docs: int = Field(ge=0)
    num_student_tokens: int = Field(ge=0)
    num_chunks: int = Field(ge=0)
    chunk_shapes: dict[str, int] = Field(
        default_factory=dict, description="Chunk counts by shape: '1:1', '1:n', 'n:1', 'n:m', 'empty'.")
    num_exact: int = Field(default=0, ge=0, description="Chunks whose two sides decode to identical text.")
    conversation: dict[str, int] = Field(
        default_factory=dict, description="Conversation stores: content_chars, shared_chars, unaligned_chars, "
                                          "unaligned_spans and role_<name> student token counts.")
    arrays: dict[str, ArraySpec] = Field(default_factory=dict)
    created: str = ""


class WriterClaim(_Model):
    """`claims/w{writer:05d}.json`: which process currently writes as this writer index."""

    writer_index: int  # -1: the claim of `xtcache align` (claims/align.json)
    pid: int
    host: str
    time: str
    token: str = ""  # random per claim: a process releases or keeps writing under a claim only while it is its own


class WriterDone(_Model):
    """`done/w{writer:05d}.json`: the writer finished all its parts."""

    format_version: int = FORMAT_VERSION
    writer_index: int
    num_parts: int
    time: str
    summary: dict[str, Any] = Field(default_factory=dict)


EXPORTED_MODELS: dict[str, type[BaseModel]] = {
    "manifest": Manifest,
    "shard_meta": ShardMeta,
    "align_part_meta": AlignPartMeta,
    "align_group_meta": AlignGroupMeta,
    "array_spec": ArraySpec,
    "codec_config": CodecConfig,
    "writer_claim": WriterClaim,
    "writer_done": WriterDone,
    "shard_plan": ShardPlanFile,
    "capture_check": CaptureCheck,
}
