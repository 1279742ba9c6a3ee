"""`xtcache projection build|import|inspect`: make, convert and look at student->teacher maps.

    xtcache projection build --student-tokenizer S --teacher-tokenizer T --out w.safetensors --top-k 4
    xtcache projection import nemo_map.pt --student-tokenizer S --teacher-tokenizer T --out w.safetensors
    xtcache projection inspect w.safetensors [--student-tokenizer S --teacher-tokenizer T]

Tokenizers are local directories (or hub-cache names) loaded with `AutoTokenizer` as fast
tokenizers, never with remote code. The map itself is in `xtcache.projection`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import typer

from xtcache.errors import ConfigError, ProjectionError
from xtcache.projection import ProjectionMap, build_projection, format_report, import_nemo
from xtcache.tokenizer import load_tokenizer as load

app = typer.Typer(help="Student->teacher projection maps for cross-tokenizer distillation.", no_args_is_help=True)


@dataclass(kw_only=True)
class ProjectionBuildConfig:
    """Settings of `xtcache projection build`."""

    student_tokenizer: str
    """Student tokenizer directory (fast tokenizer with tokenizer.json)."""
    teacher_tokenizer: str
    """Teacher tokenizer directory (fast tokenizer with tokenizer.json)."""
    out: Path
    """Output safetensors file."""
    top_k: int = 4
    """Teacher entries kept per student token (default 4)."""
    decay: float = 0.5
    """Weight ratio between consecutive pieces of a decomposed token (first piece dominant; default 0.5)."""
    reverse_scale: float = 0.5
    """Weight of teacher->student decompositions credited back, relative to forward ones (default 0.5)."""
    pieces: str = "first"
    """Pieces of a decomposition kept: first (a student token stands for the first teacher token of its text; what `--chunk-rows first` compares) or all (weighted by --decay)."""

    def __post_init__(self):
        if self.top_k < 1:
            raise ValueError(f"--top-k {self.top_k}: must be at least 1")
        if not 0.0 < self.decay <= 1.0:
            raise ValueError(f"--decay {self.decay}: must be in (0, 1]")
        if self.reverse_scale < 0:
            raise ValueError(f"--reverse-scale {self.reverse_scale}: must be at least 0")
        if self.pieces not in ("first", "all"):
            raise ValueError(f"--pieces {self.pieces!r}: use first or all")


def load_tokenizer(name: str, flag: str):
    """A fast tokenizer from a local directory, loaded as stage 1 and stage 2 load it; errors name `flag`."""
    try:
        return load(name, flag)
    except ConfigError as e:
        raise ProjectionError(str(e)) from None


@app.command("build")
def build(
    student_tokenizer: str = typer.Option(..., help="Student tokenizer directory (fast tokenizer with tokenizer.json)."),
    teacher_tokenizer: str = typer.Option(..., help="Teacher tokenizer directory (fast tokenizer with tokenizer.json)."),
    out: Path = typer.Option(..., help="Output safetensors file."),
    top_k: int = typer.Option(4, help="Teacher entries kept per student token (default 4)."),
    decay: float = typer.Option(0.5, help="Weight ratio between consecutive pieces of a decomposed token."),
    reverse_scale: float = typer.Option(0.5, help="Weight of teacher->student decompositions credited back."),
    pieces: str = typer.Option("first", help="Decomposition pieces kept: first (a student token stands for the first "
                                             "teacher token of its text) or all (weighted by --decay)."),
) -> None:
    """Build the student->teacher map from the two tokenizers and print its coverage."""
    try:
        cfg = ProjectionBuildConfig(student_tokenizer=student_tokenizer, teacher_tokenizer=teacher_tokenizer,
                                    out=out, top_k=top_k, decay=decay, reverse_scale=reverse_scale, pieces=pieces)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    s_tok = load_tokenizer(cfg.student_tokenizer, "--student-tokenizer")
    t_tok = load_tokenizer(cfg.teacher_tokenizer, "--teacher-tokenizer")
    pm = build_projection(s_tok, t_tok, top_k=cfg.top_k, decay=cfg.decay, reverse_scale=cfg.reverse_scale,
                          pieces=cfg.pieces)
    pm.save(cfg.out)
    typer.echo(format_report(pm, s_tok, t_tok))
    missing = pm.notes.get("specials_without_counterpart") or []
    if missing:
        more = f" and {len(missing) - 10} more" if len(missing) > 10 else ""
        typer.echo(f"  student control tokens without a teacher counterpart (empty rows: their probability counts in "
                   f"the rest bucket): {len(missing)}, {', '.join(missing[:10])}{more}")
    typer.echo(f"wrote {cfg.out}")


@app.command("import")
def import_(
    source: Path = typer.Argument(..., help="NeMo-RL projection file (.pt with 'indices' and 'likelihoods')."),
    student_tokenizer: str = typer.Option(..., help="Student tokenizer the map was built for."),
    teacher_tokenizer: str = typer.Option(..., help="Teacher tokenizer the map was built for."),
    out: Path = typer.Option(..., help="Output safetensors file."),
) -> None:
    """Convert a NeMo-RL projection map (.pt) into an xtcache map, checking shapes and ids."""
    s_tok = load_tokenizer(student_tokenizer, "--student-tokenizer")
    t_tok = load_tokenizer(teacher_tokenizer, "--teacher-tokenizer")
    pm, changes = import_nemo(source, s_tok, t_tok)
    pm.save(out)
    typer.echo(format_report(pm, s_tok, t_tok))
    typer.echo(f"  import: {changes['duplicate_entries_merged']} duplicated teacher ids merged in "
               f"{changes['rows_with_duplicates']} rows (weights summed); {changes['rows_targeting_u_fffd']} rows map "
               "to partial-UTF-8 teacher tokens (U+FFFD when decoded), kept")
    typer.echo(f"wrote {out}")


@app.command("inspect")
def inspect(
    path: Path = typer.Argument(..., help="Projection map (.safetensors) to describe."),
    student_tokenizer: str = typer.Option(None, help="Student tokenizer, to show rows as token strings."),
    teacher_tokenizer: str = typer.Option(None, help="Teacher tokenizer, to show rows as token strings."),
) -> None:
    """Print coverage: exact-match share, rows with a mapping, entries per row, the content digest a run's summary
    names it by, the teacher ids no student row reaches, example rows."""
    pm = ProjectionMap.load(path)
    s_tok = load_tokenizer(student_tokenizer, "--student-tokenizer") if student_tokenizer else None
    t_tok = load_tokenizer(teacher_tokenizer, "--teacher-tokenizer") if teacher_tokenizer else None
    typer.echo(format_report(pm, s_tok, t_tok))
    typer.echo(f"  student fingerprint {pm.student_fingerprint[:16]}  teacher fingerprint {pm.teacher_fingerprint[:16]}")
