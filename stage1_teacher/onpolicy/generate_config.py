"""Configuration of `xtcache generate`: one kw-only dataclass, nested by concern, one flag per leaf.

The prompt files are read as teacher-dump reads `--data` (the same `InputConfig`); the shard and
resume flags mean what they mean for teacher-dump. Cross-field checks raise ValueError naming the flag.

    python -c "from xtcache.cliconfig import leaf_fields; from stage1_teacher.onpolicy.generate_config import GenerateConfig as C; print(list(leaf_fields(C)))"
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from stage1_teacher.config import InputConfig, data_options, expand_globs
from stage1_teacher.shard_plan import launcher_index
from xtcache.cliconfig import from_flat

GEN_ENGINES = ("vllm", "hf")


@dataclass(kw_only=True)
class SamplingConfig:
    samples_per_prompt: int = 1
    """Completions sampled per prompt."""
    temperature: float = 1.0
    """Sampling temperature (> 0)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top-p, in (0, 1]."""
    max_new_tokens: int = 256
    """Most tokens generated per completion (stop reason 'length' when reached)."""
    seed: int = 0
    """Seed of the draws; each (prompt id, sample index) draws from its own seed derived from it (hf, vLLM on CUDA). A prompt id is the file's base name, row and text hash: the same prompts in a file of another name draw other samples."""


@dataclass(kw_only=True)
class RolloutOutConfig:
    out: str
    """Output directory (local or fsspec URL): parts/*.jsonl, manifest.json, index/, done/. A new or empty directory, or one holding rollouts (never one holding other files)."""
    storage_options: dict[str, Any] = field(default_factory=dict)
    """fsspec storage options for a remote --out (JSON object); also for --data unless --data-storage-options is given."""
    prompts_per_part: int = 64
    """Prompts per part file (the unit of commit and of --resume)."""
    shard_index: int | None = None
    """This job's writer index in [0, --num-shards); default: from the launcher (Slurm array, Kubernetes indexed Job, RANK), else 0."""
    num_shards: int | None = None
    """Parallel jobs; job j samples rows j, j + N, ... of the prompt set (N = --num-shards); default: from the launcher, else 1."""
    shard_source = ""  # not a setting: where shard_index / num_shards came from
    resume: bool = False
    """Continue a killed run: keep its committed parts, generate the rest."""


@dataclass(kw_only=True)
class GenerateConfig:
    student: str
    """Student model directory (Hugging Face layout with its tokenizer; train-student's export OUT/hf works)."""
    engine: str = "vllm"
    """Sampling engine: 'vllm' (fast; on CPU not reproducible run to run) or 'hf' (transformers, seeded per prompt and sample: reproducible)."""
    dtype: str = "auto"
    """Compute dtype: auto, float32, bfloat16, float16."""
    gpu_memory_utilization: float | None = None
    """vLLM memory fraction; default 0.8 on CUDA, 0.3 on CPU (fraction of host memory)."""
    input: InputConfig = field(default_factory=InputConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    output: RolloutOutConfig

    @property
    def data_options(self) -> dict:
        return data_options(self.input.data_storage_options, self.output.storage_options)

    def __post_init__(self):
        s, o = self.sampling, self.output
        if not self.input.data:
            raise ValueError("--data: give at least one prompt file")
        if self.engine not in GEN_ENGINES:
            raise ValueError(f"--engine {self.engine}: use one of {', '.join(GEN_ENGINES)}")
        if s.samples_per_prompt < 1:
            raise ValueError(f"--samples-per-prompt {s.samples_per_prompt}: must be at least 1")
        if not s.temperature > 0:
            raise ValueError(f"--temperature {s.temperature}: must be above 0 (greedy decoding is not sampling)")
        if not 0 < s.top_p <= 1:
            raise ValueError(f"--top-p {s.top_p}: must be in (0, 1]")
        if s.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens {s.max_new_tokens}: must be at least 1")
        if o.prompts_per_part < 1:
            raise ValueError(f"--prompts-per-part {o.prompts_per_part}: must be at least 1")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"--gpu-memory-utilization {self.gpu_memory_utilization}: must be in (0, 1]")
        if o.num_shards is not None and o.num_shards < 1:
            raise ValueError(f"--num-shards {o.num_shards}: must be at least 1")
        if not o.shard_source:
            o.shard_index, o.num_shards, o.shard_source = launcher_index(o.shard_index, o.num_shards)
        if not 0 <= o.shard_index < o.num_shards:
            raise ValueError(f"--shard-index {o.shard_index}: must be in [0, --num-shards {o.num_shards})")
        self.input.data = expand_globs(self.input.data, self.data_options)


def build_generate_config(values: dict[str, Any]) -> GenerateConfig:
    """A GenerateConfig from flat {field: value} (what `generate` builds from flags and --config)."""
    return from_flat(GenerateConfig, values)
