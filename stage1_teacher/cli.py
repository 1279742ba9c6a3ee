"""Command-line entry points of stage 1: `xtcache teacher-dump` and `xtcache align`.

Each option mirrors one field of `stage1_teacher.config.TeacherDumpConfig` (same name, '-' for
'_'); `--config FILE` (YAML or TOML) supplies any of them, flags given on the command line win.
Heavy imports (torch, vLLM, zarr) happen inside the functions so `xtcache --help` stays fast.

    xtcache teacher-dump --teacher T --student-tokenizer S --data corpus.jsonl --out store --mode topk
    xtcache align store --student-tokenizer another_student
"""

from __future__ import annotations

from typing import List, Optional

import typer

_EXPLICIT_SOURCES = ("COMMANDLINE", "ENVIRONMENT")


def teacher_dump(
    ctx: typer.Context,
    teacher: Optional[str] = typer.Option(None, "--teacher", help="Teacher model directory (HF layout, safetensors)."),
    student_tokenizer: Optional[List[str]] = typer.Option(
        None, "--student-tokenizer", help="Student tokenizer directory (repeatable: one alignment group each)."),
    data: Optional[List[str]] = typer.Option(
        None, "--data", help="Corpus file or fsspec URL (repeatable, globs expanded): .parquet .arrow .jsonl .txt"),
    out: Optional[str] = typer.Option(None, "--out", help="Store path or URL (default: under --cache-dir)."),
    text_field: str = typer.Option("text", "--text-field", help="Column / JSON key with the document text."),
    mode: str = typer.Option("topk", "--mode", help="topk | full | sampled."),
    top_k: int = typer.Option(64, "--top-k", help="Ids kept per position (topk mode)."),
    num_samples: int = typer.Option(64, "--num-samples", help="Draws per position (sampled mode)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the sampled mode's draws."),
    max_seq_len: int = typer.Option(2048, "--max-seq-len", help="Teacher window in tokens."),
    window_overlap: int = typer.Option(0, "--window-overlap", help="Left-context tokens repeated between windows."),
    batch_tokens: int = typer.Option(65536, "--batch-tokens", help="Teacher tokens per engine call."),
    engine: str = typer.Option("vllm", "--engine", help="vllm | hf."),
    dtype: str = typer.Option("auto", "--dtype", help="Teacher dtype: auto, float32, bfloat16, float16."),
    tensor_parallel_size: int = typer.Option(1, "--tensor-parallel-size", help="vLLM tensor-parallel degree."),
    gpu_memory_utilization: Optional[float] = typer.Option(
        None, "--gpu-memory-utilization", help="vLLM memory fraction (default 0.8 CUDA, 0.3 CPU)."),
    max_num_batched_tokens: Optional[int] = typer.Option(
        None, "--max-num-batched-tokens", help="vLLM tokens per scheduler step."),
    max_model_len: Optional[int] = typer.Option(
        None, "--max-model-len", help="vLLM context (default --max-seq-len + 1)."),
    enforce_eager: Optional[bool] = typer.Option(
        None, "--enforce-eager/--no-enforce-eager", help="vLLM eager mode (default: on for CPU, off for CUDA)."),
    fast_path: bool = typer.Option(True, "--fast-path/--no-fast-path",
                                   help="vLLM hidden states + teacher lm_head (exact); off: prompt log-probs."),
    check_tolerance: Optional[float] = typer.Option(
        None, "--check-tolerance", help="Allowed fast-vs-reference log-prob gap on the first batch."),
    cache_dir: Optional[str] = typer.Option(
        None, "--cache-dir", help="Directory of reusable caches (looked up by key)."),
    storage_options: str = typer.Option("", "--storage-options", help="fsspec options as a JSON object."),
    data_storage_options: str = typer.Option(
        "", "--data-storage-options", help="fsspec options for remote --data (JSON); default: --storage-options."),
    docs_per_part: int = typer.Option(256, "--docs-per-part", help="Documents per store part (unit of --resume)."),
    shard_index: Optional[int] = typer.Option(
        None, "--shard-index", help="This job's index in [0, --num-shards) (default: Slurm array, indexed Job, RANK)."),
    num_shards: Optional[int] = typer.Option(
        None, "--num-shards", help="Parallel jobs, each reading its share (default: Slurm count, WORLD_SIZE, 1)."),
    resume: bool = typer.Option(False, "--resume", help="Continue an interrupted run (keeps committed parts)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Count documents/positions, estimate size; no teacher."),
    config: Optional[str] = typer.Option(None, "--config", help="YAML or TOML file with any of these options."),
) -> None:
    """Run the teacher once over a corpus and write a reusable teacher cache."""
    import json
    import logging

    from stage1_teacher.config import build_config, leaf_fields, read_config_file
    from xtcache.errors import ConfigError

    values = {name: value for name, value in locals().items() if name in leaf_fields()}
    if config:
        from_file = read_config_file(config)
        for name, value in from_file.items():
            source = ctx.get_parameter_source(name)
            if source is None or source.name not in _EXPLICIT_SOURCES:
                values[name] = value
    try:
        cfg = build_config(values)
    except json.JSONDecodeError as e:
        raise ConfigError(f"--storage-options / --data-storage-options: not a JSON object ({e})") from None
    except ValueError as e:
        raise ConfigError(str(e)) from None

    from stage1_teacher.dump import Summary, run_teacher_dump

    logging.getLogger("vllm").setLevel(logging.WARNING)
    result = run_teacher_dump(cfg)
    if isinstance(result, Summary):
        for line in result.lines():
            typer.echo(line)
    else:
        typer.echo(f"documents           {result['documents']}")
        typer.echo(f"positions           {result['positions']} in {result['windows']} teacher windows")
        typer.echo(f"student tokens      {result['student_tokens']} ({result['chunks']} chunks)")
        typer.echo(f"estimated size      {result['estimated_bytes_before_compression'] / 1e6:.2f} MB before "
                   f"compression ({result['bytes_per_position_before_compression']} B/position)")
        typer.echo("skipped documents   " + (", ".join(f"{k}: {v}" for k, v in sorted(result["skipped"].items()))
                                             or "none"))
        typer.echo(f"store               {result['store']} (dry run: nothing written)")


def align(
    store: str = typer.Argument(..., help="An existing xtcache store."),
    student_tokenizer: str = typer.Option(..., "--student-tokenizer", help="Student tokenizer directory to add."),
    teacher_tokenizer: Optional[str] = typer.Option(
        None, "--teacher-tokenizer", help="Teacher tokenizer (default: the store's teacher, if present)."),
    storage_options: str = typer.Option("", "--storage-options", help="fsspec options as a JSON object."),
    allow_incomplete: bool = typer.Option(
        False, "--allow-incomplete", help="Align the committed parts of an incomplete store (a dump still running)."),
) -> None:
    """Add an alignment group for another student tokenizer to a store, without running the teacher."""
    import json

    from stage1_teacher.align_cmd import run_align

    stats = run_align(store, student_tokenizer, teacher_tokenizer=teacher_tokenizer, allow_incomplete=allow_incomplete,
                      storage_options=json.loads(storage_options) if storage_options.strip() else {})
    typer.echo(f"alignment group {stats['fingerprint'][:16]}..: {stats['parts_aligned']} parts aligned "
               f"({stats['documents']} documents), {stats['parts_kept']} already present")
