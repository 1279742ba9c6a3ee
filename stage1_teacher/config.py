"""Configuration of `xtcache teacher-dump`: one kw-only dataclass, nested by concern.

Every leaf field has exactly one command-line flag of the same name (`top_k` <-> `--top-k`) whose
help text is the field's docstring; `xtcache.cliconfig` makes the typer options and reads a config
file (`--config run.yaml`, `.toml` or `.json`) with the same keys, flat (`top_k: 64` or `top-k: 64`)
or nested by section (`capture: {top_k: 64}`). Flags given on the command line win over the file,
the file wins over the defaults. Cross-field checks live in `__post_init__` and raise ValueError
naming the flag.

    python -c "from xtcache.cliconfig import leaf_fields; from stage1_teacher.config import TeacherDumpConfig as C; print(list(leaf_fields(C)))"
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from schemas.models import DRAWN_MODES
from stage1_teacher.shard_plan import launcher_index
from xtcache.cliconfig import from_flat
from xtcache.location import file_system, is_local, local_path

MODES = ("topk", "full", "sampled", "headtail")
ENGINES = ("vllm", "hf")
DEFAULT_MAX_SEQ_LEN = 2048  # a cap: a teacher with a shorter context gets windows of its context less one


@dataclass(kw_only=True)
class InputConfig:
    data: list[str] = field(default_factory=list)
    """Corpus files (.parquet, .arrow/.feather/.ipc, .jsonl/.json, .txt), local or fsspec URLs; globs are expanded."""
    text_field: str = "text"
    """Column or JSON key holding the document text (ignored for .txt)."""
    messages_field: str | None = None
    """Column or JSON key holding a conversation (a list of {role, content, ...} messages, optional per-row 'tools'); each model renders it with its own chat template. Default: 'messages' when the first row has no --text-field but a 'messages' field."""
    data_storage_options: dict[str, Any] | None = None
    """fsspec storage options for remote --data files (JSON object); default: --storage-options."""


@dataclass(kw_only=True)
class TeacherConfig:
    teacher: str
    """Teacher model directory (Hugging Face layout with safetensors weights and tokenizer)."""
    engine: str = "vllm"
    """Capture engine: 'vllm' (fast, default) or 'hf' (transformers forward)."""
    dtype: str = "auto"
    """Teacher compute dtype passed to the engine: auto, float32, bfloat16, float16."""
    tensor_parallel_size: int = 1
    """vLLM tensor-parallel degree (GPUs per teacher replica)."""
    gpu_memory_utilization: float | None = None
    """vLLM memory fraction; default 0.8 on CUDA, 0.3 on CPU (fraction of host memory)."""
    max_num_batched_tokens: int | None = None
    """vLLM tokens per scheduler step; default: vLLM's choice, at least one full window."""
    max_model_len: int | None = None
    """vLLM context length; default --max-seq-len + 1."""
    enforce_eager: bool | None = None
    """vLLM eager mode (no compilation / CUDA graphs); default: on for CPU, off for CUDA."""
    fast_path: bool = True
    """vLLM: capture hidden states and apply the teacher's lm_head (exact, fast); off: prompt log-probs."""
    check_tolerance: float | None = None
    """Largest allowed |fast - reference| log-prob gap on the first batch (the mean must stay below a tenth of it); default: fp32 1e-3, half precision 4 rounding steps at the largest logit (at least 0.5; mean: half a step, at least 0.05)."""
    memory_check: bool = True
    """On CUDA: refuse, before any engine starts, a configuration whose estimated device memory does not fit (docs/gpu.md); off: start anyway (the estimate is not a measurement)."""
    trust_check_from: str | None = None
    """Another store whose passed first-batch check of this teacher (same weights, vLLM version, platform and device, model runner, eager or compiled, dtype, tensor-parallel size) this dump trusts instead of starting the check's engine: one teacher filling several stores checks once."""


@dataclass(kw_only=True)
class CaptureConfig:
    mode: str = "topk"
    """What to store per position: 'topk', 'full' (every id), 'sampled' (N draws at T=1: ids + counts) or 'headtail' (the exact top-k + N draws from the rest of the distribution, with its mass)."""
    top_k: int = 64
    """Ids kept per position in topk mode; the exact head's ids in headtail mode."""
    num_samples: int = 64
    """Draws per position in sampled mode; draws from the tail (outside the head) in headtail mode."""
    seed: int = 0
    """Seed of the sampled and headtail modes' draws (per document and window, independent of batching)."""
    max_seq_len: int = DEFAULT_MAX_SEQ_LEN
    """Teacher window in tokens, at most the teacher's context less one; longer documents are cut into windows at chunk boundaries."""
    window_overlap: int = 0
    """Tokens of left context repeated from the previous window (their predictions are stored once)."""
    batch_tokens: int = 65536
    """Teacher tokens handed to the engine per call (bounds host memory of the pipeline)."""


@dataclass(kw_only=True)
class StoreConfig:
    out: str | None = None
    """Store URL or path: a new or empty directory, or one holding a store (never one holding other files); default: <cache-dir>/xtc-<cache key>."""
    cache_dir: str | None = None
    """Directory of reusable caches: a complete cache with the same key is reused, not recomputed."""
    storage_options: dict[str, Any] = field(default_factory=dict)
    """fsspec storage options for remote stores (JSON object on the command line); also for --data unless
    --data-storage-options is given."""
    docs_per_part: int = 256
    """Documents per store part (the unit of commit and of --resume); where that many windows of targets could pass 8 GiB (full mode on a large vocabulary), a part also ends before the document that would take it past 1 GiB."""
    shard_index: int | None = None
    """This job's writer index in [0, --num-shards); default: from the launcher (Slurm array, Kubernetes
    indexed Job, RANK), else 0."""
    num_shards: int | None = None
    """Parallel jobs filling the store, each reading its own byte-balanced ranges of the corpus; default:
    from the launcher (Slurm array count, WORLD_SIZE), else 1."""
    shard_source = ""  # not a setting: where shard_index / num_shards came from (set by TeacherDumpConfig)
    resume: bool = False
    """Continue a killed run: keep its committed parts, redo the rest."""


@dataclass(kw_only=True)
class TeacherDumpConfig:
    student_tokenizer: list[str] = field(default_factory=list)
    """Student tokenizer directories (repeatable); one alignment group each."""
    input: InputConfig = field(default_factory=InputConfig)
    teacher: TeacherConfig
    capture: CaptureConfig = field(default_factory=CaptureConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    dry_run: bool = False
    """Count documents and positions and estimate the store size; do not run the teacher."""

    @property
    def data_options(self) -> dict:
        return data_options(self.input.data_storage_options, self.store.storage_options)

    def __post_init__(self):
        c, t, s = self.capture, self.teacher, self.store
        if not self.student_tokenizer:
            raise ValueError("--student-tokenizer: give at least one student tokenizer directory")
        if not self.input.data:
            raise ValueError("--data: give at least one corpus file")
        if t.engine not in ENGINES:
            raise ValueError(f"--engine {t.engine}: use one of {', '.join(ENGINES)}")
        if c.mode not in MODES:
            raise ValueError(f"--mode {c.mode}: use one of {', '.join(MODES)}")
        if c.top_k < 1:
            raise ValueError(f"--top-k {c.top_k}: must be at least 1")
        if not 1 <= c.num_samples <= 65535:
            raise ValueError(f"--num-samples {c.num_samples}: must be in [1, 65535]")
        if c.max_seq_len < 2:
            raise ValueError(f"--max-seq-len {c.max_seq_len}: must be at least 2")
        if not 0 <= c.window_overlap <= c.max_seq_len - 3:
            raise ValueError(f"--window-overlap {c.window_overlap}: must be in [0, --max-seq-len - 3]")
        if c.batch_tokens < c.max_seq_len:
            raise ValueError(f"--batch-tokens {c.batch_tokens}: must be at least --max-seq-len {c.max_seq_len}")
        if t.max_model_len is not None and t.max_model_len < c.max_seq_len + 1:
            raise ValueError(f"--max-model-len {t.max_model_len}: must exceed --max-seq-len {c.max_seq_len}")
        if t.gpu_memory_utilization is not None and not 0 < t.gpu_memory_utilization <= 1:
            raise ValueError(f"--gpu-memory-utilization {t.gpu_memory_utilization}: must be in (0, 1]")
        if t.trust_check_from and not (t.engine == "vllm" and t.fast_path):
            raise ValueError("--trust-check-from: only the vLLM fast path runs a first-batch check "
                             "(--engine vllm without --no-fast-path)")
        if t.tensor_parallel_size < 1:
            raise ValueError(f"--tensor-parallel-size {t.tensor_parallel_size}: must be at least 1")
        if s.num_shards is not None and s.num_shards < 1:
            raise ValueError(f"--num-shards {s.num_shards}: must be at least 1")
        if not s.shard_source:
            s.shard_index, s.num_shards, s.shard_source = launcher_index(s.shard_index, s.num_shards)
        if s.num_shards < 1 or not 0 <= s.shard_index < s.num_shards:
            raise ValueError(f"--shard-index {s.shard_index}: must be in [0, --num-shards {s.num_shards})")
        if s.docs_per_part < 1:
            raise ValueError(f"--docs-per-part {s.docs_per_part}: must be at least 1")
        if not s.out and not s.cache_dir:
            raise ValueError("--out: give the store path (or --cache-dir to keep it among reusable caches)")
        self.input.data = expand_globs(self.input.data, self.data_options)


def build_config(values: dict[str, Any]) -> TeacherDumpConfig:
    """A TeacherDumpConfig from flat {field: value} (what `teacher-dump` builds from flags and --config)."""
    return from_flat(TeacherDumpConfig, values)


def data_options(data_storage_options: dict | None, storage_options: dict | None) -> dict:
    """fsspec options for the corpus files: --data-storage-options, else --storage-options."""
    return dict(storage_options or {}) if data_storage_options is None else dict(data_storage_options)


def expand_globs(paths: list[str], storage_options: dict | None = None) -> list[str]:
    """Expand glob patterns in --data, local or remote (s3://bucket/corpus/*.parquet), sorted."""
    import glob

    out = []
    for p in paths:
        if any(ch in p for ch in "*?["):
            if is_local(p):
                hits = sorted(glob.glob(local_path(p)))
            else:
                fs, pattern = file_system(p, storage_options)
                protocol = p.split("://", 1)[0]
                hits = sorted(h if "://" in h else f"{protocol}://{h}" for h in fs.glob(pattern))
            if not hits:
                raise ValueError(f"--data {p}: the pattern matches no file")
            out.extend(hits)
        else:
            out.append(p)
    return out


def settings_for_fingerprint(cfg: TeacherDumpConfig, *, window_len: int, boundary_tokenizers: list[str],
                             shard_plan: str = "", conversation: dict | None = None,
                             part_positions: int | None = None) -> dict:
    """The capture settings that change what is stored (part of the cache key); with several jobs,
    the shard plan's fingerprint (which job writes which rows); for a conversation corpus, the
    messages field, the teacher's chat template fingerprint and its end-of-turn candidate ids; where parts
    also end at a number of positions (plan.part_position_limit), that number."""
    c = cfg.capture
    return {
        "mode": c.mode, "top_k": c.top_k if c.mode in ("topk", "headtail") else None,
        "num_samples": c.num_samples if c.mode in DRAWN_MODES else None,
        "seed": c.seed if c.mode in DRAWN_MODES else None,
        "max_seq_len": window_len, "window_overlap": c.window_overlap, "dtype": cfg.teacher.dtype,
        "docs_per_part": cfg.store.docs_per_part, "num_shards": cfg.store.num_shards,
        **({"part_positions": part_positions} if part_positions else {}),
        **({"shard_plan": shard_plan} if cfg.store.num_shards > 1 else {}),
        "window_cut_tokenizers": boundary_tokenizers, "text_field": cfg.input.text_field,
        **({"conversation": conversation} if conversation else {}),
    }


@dataclass(kw_only=True)
class AlignConfig:
    """`xtcache align`: add an alignment group for another student tokenizer to an existing store."""

    store: str = field(metadata={"positional": True})
    """An existing xtcache store."""
    student_tokenizer: str
    """Student tokenizer directory to add."""
    teacher_tokenizer: str | None = None
    """Teacher tokenizer (default: the store's teacher, if present)."""
    storage_options: dict[str, Any] = field(default_factory=dict)
    """fsspec storage options for remote stores (JSON object)."""
    allow_incomplete: bool = False
    """Align the committed parts of an incomplete store (a dump still running)."""
