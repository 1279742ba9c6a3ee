"""Every example command of README.md and docs/*.md is a command of the app, with its flags.

    .venv/bin/python -m pytest -q tests/test_doc_commands.py

What counts as a command: a line of a code block (fenced, or indented by four spaces) that starts
`xtcache ...`, `python -m stage2_student ...`, `torchrun ... -m stage2_student ...` or `deepspeed ...
--module stage2_student ...` (backslash continuations joined, `# comments` dropped); the `args` of a
Kubernetes container whose image is xtcache's; and an inline code span of the prose that starts
`xtcache SUBCOMMAND` and uses a flag. Output is not a command: `text` blocks, and in a block with `$ `
prompts only the prompted lines are commands.

Every such command resolves to a command of the typer app (`python -m stage2_student` and its
launchers are `xtcache train-student`), click parses its arguments as a shell would hand them over
(no unknown flag, no missing value, no extra argument, values of the flag's type), and a full
command of a `--config` command (no `...` in it) gives the settings it needs, with values its
config accepts (`--loss pkll`, a missing `--student` fail). `xtcache rounds`' `--dump-args`, `--generate-args`
and its flags after `--` are checked as teacher-dump's, generate's and train-student's. The short ones run: every
documented command's `--help`, the README walkthrough's stage 1 on the toy artifacts (teacher-dump,
`cache ls`, inspect, verify, projection build), the prompt file section of docs/on-policy.md, and
docs/train-student.example.yaml through `train-student --config`.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
import shutil
from pathlib import Path

import pytest

from tests.commands import xtcache

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
PARTIAL = ("...", "FLAGS")  # an example that stands for more flags: its settings are not all there
SHELL_LANGS = ("", "bash", "sh", "shell")
MAP_PARAMS = {"train-student": ("projection",), "rounds": ("projection",), "projection build": ("out",),
              "projection import": ("out",)}  # the parameters that name a projection map


@dataclasses.dataclass(frozen=True)
class DocCommand:
    """One documented command: where it is, and the `xtcache` arguments it stands for."""

    where: str  # "docs/on-policy.md:383"
    args: tuple[str, ...]  # after `xtcache` (train-student for python -m stage2_student and its launchers)
    inline: bool = False  # an inline code span of the prose: a mention, its settings not all given

    @property
    def partial(self) -> bool:
        return self.inline or any(a in PARTIAL for a in self.args)


def xtcache_args(tokens: list[str]) -> list[str] | None:
    """The `xtcache` arguments of a shell command, or None when it runs no xtcache command."""
    while tokens and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", tokens[0]):  # VAR=value before the command
        tokens = tokens[1:]
    if not tokens:
        return None
    prog = tokens[0].rsplit("/", 1)[-1]
    if prog == "xtcache":
        return tokens[1:]
    module = {"torchrun": "-m", "deepspeed": "--module"}.get(prog, "-m" if re.fullmatch(r"python[0-9.]*", prog) else None)
    if module is None:
        return None
    for i in range(1, len(tokens) - 1):
        if tokens[i] == module and tokens[i + 1] == "stage2_student":
            return ["train-student", *tokens[i + 2:]]
        if tokens[i] == module and tokens[i + 1] == "xtcache.app.cli":
            return tokens[i + 2:]
    return None


def _code_blocks(text: str):
    """(first line number, language, lines) of each fenced or four-space indented block."""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        fence = re.match(r"\s*(```+)\s*(\S*)", line)
        if fence:
            j = i + 1
            while j < len(lines) and not lines[j].strip().startswith(fence.group(1)):
                j += 1
            yield i + 2, fence.group(2), lines[i + 1:j]
            i = j + 1
        elif line.startswith("    ") and line.strip() and (i == 0 or not lines[i - 1].strip()):
            j = i
            while j < len(lines) and (lines[j].startswith("    ") or not lines[j].strip()):
                j += 1
            yield i + 1, "", lines[i:j]
            i = j
        else:
            i += 1


def _logical_lines(first: int, lines: list[str]):
    """(line number, text) with backslash continuations joined."""
    start, buf = None, []
    for n, line in enumerate(lines, first):
        if start is None:
            start = n
        buf.append(line.rstrip())
        if buf[-1].endswith("\\"):
            buf[-1] = buf[-1][:-1]
            continue
        yield start, " ".join(part.strip() for part in buf)
        start, buf = None, []
    if buf:
        yield start, " ".join(part.strip() for part in buf)


def _yaml_commands(block: list[str]):
    """`xtcache` arguments of the containers of a Kubernetes manifest whose image is xtcache's."""
    import yaml

    def walk(node):
        if isinstance(node, dict):
            if "xtcache" in str(node.get("image", "")) and isinstance(node.get("args"), list):
                yield [str(a) for a in node["args"]]
            for value in node.values():
                yield from walk(value)
        elif isinstance(node, list):
            for value in node:
                yield from walk(value)

    yield from walk(yaml.safe_load("\n".join(block)))


def doc_commands(paths=DOCS) -> list[DocCommand]:
    out = []
    for path in paths:
        text = path.read_text(encoding="utf-8")
        name = str(path.relative_to(REPO))
        for first, lang, block in _code_blocks(text):
            if lang not in SHELL_LANGS + ("yaml", "yml"):
                continue  # output (text), code (python, json)
            if lang in ("yaml", "yml"):
                out += [DocCommand(f"{name}:{first}", tuple(args)) for args in _yaml_commands(block)]
                continue
            prompted = any(line.lstrip().startswith("$ ") for line in block)
            for n, line in _logical_lines(first, block):
                if prompted and not line.startswith("$ "):
                    continue  # the output of the prompted command above
                try:
                    tokens = shlex.split(line.removeprefix("$ "), comments=True)
                except ValueError:
                    continue  # not shell (a Python or JSON line)
                args = xtcache_args(tokens)
                if args is not None:
                    out.append(DocCommand(f"{name}:{n}", tuple(args)))
        for n, line in enumerate(_prose(text), 1):
            for span in re.findall(r"`(xtcache [a-z][^`]*)`", line):
                if " --" in span and not re.search(r"[\[\]|<>]", span):
                    try:
                        args = shlex.split(span)[1:]
                    except ValueError:
                        continue  # prose inside the span ("F's tokenizer")
                    out.append(DocCommand(f"{name}:{n}", tuple(args), inline=True))
    return out


def _prose(text: str) -> list[str]:
    """The document's lines with its code blocks blanked (line numbers kept)."""
    lines = text.splitlines()
    for first, _, block in _code_blocks(text):
        for k in range(len(block)):
            lines[first - 1 + k] = ""
    return lines


COMMANDS = doc_commands()


def _root():
    import typer.main

    from xtcache.app.cli import app

    return typer.main.get_command(app)


def resolve(args: tuple[str, ...]):
    """(the click command, its path after `xtcache`, the arguments left for it)."""
    group, path, rest = _root(), [], list(args)
    root_opts = {o for p in group.params for o in [*p.opts, *p.secondary_opts]}
    while rest and rest[0] in root_opts and not path:  # xtcache -v teacher-dump ...
        rest.pop(0)
    while hasattr(group, "list_commands"):  # a group (typer may ship its own click)
        assert rest, f"`xtcache {' '.join(path)}` needs a subcommand"
        ctx = group.make_context(" ".join(["xtcache", *path]), [], resilient_parsing=True)
        cmd = group.get_command(ctx, rest[0])
        assert cmd is not None, f"`xtcache {' '.join(path)}` has no command {rest[0]!r}"
        path.append(rest.pop(0))
        group = cmd
    return group, path, rest


def check(cmd, path: list[str], args: list[str], *, partial: bool) -> None:
    """Parse `args` as click does for `xtcache PATH`; for a full command of a `--config` command, build
    its config from the flags given."""
    from xtcache.cliconfig import from_flat

    name = "xtcache " + " ".join(path)
    given = [a for a in args if a not in PARTIAL]
    ctx = cmd.make_context(name, given)  # unknown flag, missing value, extra argument, bad type: UsageError
    assert not ctx.args, f"{name}: arguments it does not take: {ctx.args}"
    cls = getattr(cmd.callback, "config_class", None)
    explicit = {k: v for k, v in ctx.params.items() if getattr(ctx.get_parameter_source(k), "name", "") == "COMMANDLINE"}
    for param in MAP_PARAMS.get(" ".join(path), ()):
        value = explicit.get(param) or []
        maps = [str(v) for v in (value if isinstance(value, (list, tuple)) else [value])]
        assert all(m.endswith(".safetensors") for m in maps), f"{name} --{param} {maps}: a projection map is .safetensors"
    if cls is not None and not partial and "config" not in explicit:
        from_flat(cls, explicit)  # a setting without a default left out, or a value the config refuses


@pytest.mark.parametrize("doc", COMMANDS, ids=[c.where for c in COMMANDS])
def test_every_documented_command_is_a_command_of_the_app_with_its_flags(doc, monkeypatch):
    for module in ("stage1_teacher.config", "stage1_teacher.onpolicy.generate_config"):  # the example's corpus is not here
        monkeypatch.setattr(f"{module}.expand_globs", lambda paths, storage_options=None: list(paths))
    args = list(doc.args)
    passed: list[str] = []
    if args and args[0] == "rounds" and "--" in args:  # the flags after -- are train-student's
        args, passed = args[:args.index("--")], args[args.index("--") + 1:]
    cmd, path, rest = resolve(tuple(args))
    if doc.inline:  # a mention in the prose (`xtcache rounds --student`): its flags are the command's
        flags = {o for p in cmd.params for o in [*p.opts, *p.secondary_opts]}
        unknown = [a.split("=")[0] for a in rest if a.startswith("-") and a.split("=")[0] not in flags]
        assert not unknown, f"xtcache {' '.join(path)} has no {', '.join(unknown)}"
        return
    check(cmd, path, rest, partial=doc.partial)
    if path == ["rounds"]:
        ts, ts_path, _ = resolve(("train-student",))
        check(ts, ts_path, passed, partial=True)
        for flag, stage in (("--dump-args", "teacher-dump"), ("--generate-args", "generate")):
            if flag in rest:
                sub, sub_path, _ = resolve((stage,))
                check(sub, sub_path, shlex.split(rest[rest.index(flag) + 1]), partial=True)


def test_the_extraction_finds_the_documented_commands():
    """A guard on the extractor itself: the commands of each kind of place are found, outputs are not."""
    found = {c.where: c for c in COMMANDS}
    heads = {(c.where.split(":")[0], c.args[0]) for c in COMMANDS}
    walkthrough = [c for c in COMMANDS if c.where.startswith("README.md:") and not c.inline]
    assert [c.args[0] for c in walkthrough][:8] == ["teacher-dump", "inspect", "verify", "projection",
                                                    "train-student", "train-student", "align", "generate"]
    assert "--student" in walkthrough[5].args  # the two-teacher run, joined over its continuation lines
    assert ("docs/scaling.md", "teacher-dump") in heads and ("docs/scaling.md", "train-student") in heads  # YAML, torchrun
    assert ("docs/on-policy.md", "rounds") in heads and ("docs/store.md", "align") in heads  # indented, `$ ` prompt
    assert not any(c.args[0] == "demo" and not c.inline for c in COMMANDS)  # the demo's printed output
    assert any(c.inline for c in COMMANDS) and len(found) == len(COMMANDS)


def test_every_documented_command_has_a_working_help():
    paths = sorted({" ".join(resolve(c.args)[1]) for c in COMMANDS})
    assert "train-student" in paths and "rounds" in paths
    for path in paths:
        proc = xtcache(*path.split(), "--help")
        assert proc.returncode == 0 and "Usage:" in proc.stdout, f"xtcache {path} --help:\n{proc.stderr[-2000:]}"


def _block_after(doc: Path, heading: str, lang: str) -> list[str]:
    """The lines of the first code block of language `lang` after `heading` in `doc`."""
    text = doc.read_text(encoding="utf-8")
    return next(block for _, lg, block in _code_blocks(text[text.index(heading):]) if lg == lang)


def test_the_readme_walkthrough_stage_1_runs_on_the_toy_artifacts(toy_setup, tmp_path):
    """The walkthrough's stage 1 as written, with its paths standing for the toy artifacts and the engine
    the suite runs without vLLM (`--engine hf`): the store lands where it says (`xtc-<key16>` under the
    cache directory, which `cache ls` lists), inspect and verify read it, projection build writes the map."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "corpus").mkdir()
    texts = [json.loads(line)["text"] for line in toy_setup.heldout_jsonl.read_text().splitlines()[:6]]
    pq.write_table(pa.table({"text": texts}), tmp_path / "corpus" / "part-0.parquet")
    cache_dir = tmp_path / "caches"
    paths = {"./qwen-teacher": str(toy_setup.teacher_model), "./llama-student": str(toy_setup.student_model),
             "corpus/*.parquet": str(tmp_path / "corpus" / "*.parquet"), "/data/xtcache": str(cache_dir),
             "llama_to_qwen.safetensors": str(tmp_path / "llama_to_qwen.safetensors")}
    block = [line for _, line in _logical_lines(1, _block_after(REPO / "README.md", "## Walkthrough", "bash"))]
    runs = [shlex.split(line, comments=True) for line in block]
    runs = [r[1:] for r in runs if r and r[0] == "xtcache"]
    assert [r[0] for r in runs] == ["teacher-dump", "inspect", "verify", "projection"]
    listing = re.search(r"`xtcache (cache ls [^`]*)`", "\n".join(block)).group(1).split()  # the comment's command

    def real(args: list[str]) -> list[str]:
        out = []
        for a in args:
            for doc_path, here in paths.items():
                a = a.replace(doc_path, here)
            out.append(a)
        return out

    dump = xtcache(*real(runs[0]), "--engine", "hf", "--max-seq-len", "256")
    assert dump.returncode == 0, dump.stdout[-2000:] + dump.stderr[-3000:]
    [store] = cache_dir.glob("xtc-*")
    assert re.fullmatch(r"xtc-[0-9a-f]{16}", store.name)
    paths["xtc-<key16>"] = store.name
    listed = xtcache(*real(listing))
    assert listed.returncode == 0 and store.name in listed.stdout, listed.stdout + listed.stderr
    for args in runs[1:]:
        proc = xtcache(*real(args))
        assert proc.returncode == 0, f"xtcache {shlex.join(real(args))}:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}"
    assert (tmp_path / "llama_to_qwen.safetensors").is_file()


def test_the_prompt_file_section_of_on_policy_md_runs(toy_setup, tmp_path, monkeypatch):
    """Its example prompts and the prompts its Python cuts from a chat corpus are prompts `generate` takes."""
    from xtcache.testing.chat import build_chat_setup

    setup = build_chat_setup(toy_setup, tmp_path / "chat", num_train=3, num_heldout=1, teacher_steps=0)
    doc = REPO / "docs" / "on-policy.md"
    examples = _block_after(doc, "**Making a prompt file.**", "jsonl")
    code = "\n".join(_block_after(doc, "**Making a prompt file.**", "python"))
    [command] = [line for _, line in _logical_lines(1, _block_after(doc, "**Making a prompt file.**", "bash"))]
    monkeypatch.chdir(tmp_path)
    shutil.copy(setup.train_jsonl, tmp_path / "chat.jsonl")
    exec(compile(code, str(doc), "exec"), {})
    (tmp_path / "examples.jsonl").write_text("\n".join(examples) + "\n")
    args = shlex.split(command)[1:]
    for prompts, n in (("prompts.jsonl", 3), ("examples.jsonl", len(examples))):
        real = [str(setup.student_model) if a == "run/hf" else prompts if a == "prompts.jsonl" else
                f"rollouts-{prompts}" if a == "rollouts" else a for a in args]
        proc = xtcache(*real, "--max-new-tokens", "4")
        assert proc.returncode == 0, f"{prompts}:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}"
        rows = [line for p in (tmp_path / f"rollouts-{prompts}" / "parts").glob("*.jsonl")
                for line in p.read_text().splitlines()]
        assert len(rows) == n


def test_the_example_config_file_is_a_train_student_config():
    """docs/train-student.example.yaml: every section of train-student, every key a setting of its section,
    every value one the config takes; `train-student --config` reads it and stops only at its placeholder
    paths (before any model loads)."""
    import yaml

    from stage2_student.config import TrainConfig
    from xtcache.cliconfig import from_flat, read_config_file, sections

    path = REPO / "docs" / "train-student.example.yaml"
    raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    assert set(sections(TrainConfig)) <= set(raw), "the example shows every section"
    cfg = from_flat(TrainConfig, read_config_file(TrainConfig, path))  # an unknown key or a bad value: ConfigError
    assert cfg.loss.loss == raw["loss"]["loss"] and cfg.optim.lr == raw["optim"]["lr"]
    proc = xtcache("train-student", "--config", path)
    assert proc.returncode == 2 and re.fullmatch(r"error: --\S+ \S+: no such (directory|file)\n", proc.stderr), proc.stderr
