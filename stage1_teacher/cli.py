"""Command-line entry points of stage 1: `xtcache teacher-dump`, `xtcache align` and `xtcache generate`.

The options of `teacher-dump` and `align` are made by `xtcache.cliconfig` from the fields of
`stage1_teacher.config.TeacherDumpConfig` and `AlignConfig` (same name, '-' for '_', the field
docstring as help);
`--config FILE` (YAML, TOML or JSON) supplies any of them, flags given on the command line win.
Heavy imports (torch, vLLM, zarr) happen inside the functions so `xtcache --help` stays fast.

    xtcache teacher-dump --teacher T --student-tokenizer S --data corpus.jsonl --out store --mode topk
    xtcache align store --student-tokenizer another_student
"""

from __future__ import annotations

import typer

from stage1_teacher.align_cmd import run_align
from stage1_teacher.config import AlignConfig, TeacherDumpConfig
from stage1_teacher.dump import run_teacher_dump
from stage1_teacher.onpolicy.generate import run_generate
from stage1_teacher.onpolicy.generate_config import GenerateConfig
from stage1_teacher.onpolicy.policy_eval import policy_eval_command as policy_eval  # noqa: F401  (xtcache policy-eval)
from xtcache.cliconfig import command


def _dump(cfg: TeacherDumpConfig) -> None:
    import logging

    logging.getLogger("vllm").setLevel(logging.WARNING)
    for line in run_teacher_dump(cfg).lines():
        typer.echo(line)


teacher_dump = command(
    TeacherDumpConfig, _dump, name="teacher_dump",
    help="Run the teacher once over a corpus and write a reusable teacher cache.",
    panels={None: "Run", "input": "Input", "teacher": "Teacher", "capture": "Capture", "store": "Store"},
    paths={"teacher": "dir", "student_tokenizer": "dir", "trust_check_from": "dir"})


def _align(cfg: AlignConfig) -> None:
    stats = run_align(cfg.store, cfg.student_tokenizer, teacher_tokenizer=cfg.teacher_tokenizer,
                      allow_incomplete=cfg.allow_incomplete, storage_options=cfg.storage_options)
    typer.echo(f"alignment group {stats['fingerprint'][:16]}..: {stats['parts_aligned']} parts aligned "
               f"({stats['documents']} documents), {stats['parts_kept']} already present")


align = command(AlignConfig, _align, name="align",
                help="Add an alignment group for another student tokenizer to a store, without running the teacher.",
                paths={"store": "dir", "student_tokenizer": "dir", "teacher_tokenizer": "dir"})


def _generate(cfg: GenerateConfig) -> None:
    import logging

    logging.getLogger("vllm").setLevel(logging.WARNING)
    for line in run_generate(cfg).lines():
        typer.echo(line)


generate = command(GenerateConfig, _generate, name="generate",
                   help="Sample the student's completions for a prompt set: a rollout corpus teacher-dump reads as is.",
                   panels={None: "Run", "input": "Input", "sampling": "Sampling", "output": "Output"},
                   paths={"student": "dir"})
