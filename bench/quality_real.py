"""The quality bench on the real tier: a trained teacher, real student vocabularies, documentation text.

    python bench/quality.py --teacher real            # the table below (docs/losses.md, block quality-real)
    python bench/quality.py --teacher real --section cross  # the defaults and the 0.75 mix against CE only (README.md)
    python bench/quality.py --teacher real --quick    # a smoke run: few steps, one seed

The teacher is SmolLM2-135M-Instruct (49,152 ids), the corpus the Python language reference
(`xtcache.testing.real`: held-out documents come from topics never trained on). Stage 1 runs once per
store as a user runs it (`xtcache teacher-dump --dtype float32` on vLLM, one store holding both
students' alignment groups); every row trains a fresh tiny Llama (hidden 64, 2 layers; initialised with
seed 1 + s) with `xtcache train-student` for the same steps on the same windows in the same order (data
order seed s), then is graded in this process against a full-vocabulary store of held-out documents:

- cross rows: a student on the Llama-3 vocabulary (128,256 ids). `first-token KL`: at each chunk's first
  position, KL(teacher's distribution of its next token || the student's distribution of the first teacher
  token of its next token's text), each student token read through the first-piece projection map
  (`--chunk-rows first`, `projection build --pieces first`: both sides' distributions of one event, so 0
  only for a student that predicts the teacher's next text). `chunk-mean P-KL`: the chunk means of both
  sides through the decayed-pieces map (`--chunk-rows mean --pieces all`), the measure of P-KL's original
  form. Top-1 agreement: the student's argmax at a chunk's first position, read as its first teacher
  token, against the teacher's argmax at the chunk's first row.
- same-tokenizer rows: a student on the teacher's own tokenizer; KL(teacher || student) per token over the
  full vocabulary, and top-1 agreement.
- held-out CE: the student's next-token cross-entropy on its own tokens (nats per student token).

Rows run on their own number of seeds, at most `--seeds` (mean +- standard deviation); the notes compare each KD row with CE only
on the same seeds, and call a measure won when the row is better on every seed and the mean paired
difference exceeds its standard deviation.
"""

from __future__ import annotations

import json
import logging
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.quality_onpolicy import mean_pm

log = logging.getLogger("bench.quality.real")
REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class RealSettings:
    steps: int = 120
    seq_len: int = 256
    micro_batch_size: int = 4
    lr: float = 3e-3
    warmup_steps: int = 10
    train_docs: int = 100
    heldout_docs: int = 8
    eval_batches: int = 8
    seeds: int = 8  # at most: each row runs on its own number of seeds (RealRow.seeds)
    cross_student: str = "llama3"  # the cross rows' student vocabulary: llama3 (128,256 ids) or qwen3 (151,669)


QUICK = RealSettings(steps=4, warmup_steps=1, train_docs=6, heldout_docs=2, eval_batches=1, seeds=1)


@dataclass(frozen=True)
class RealRow:
    name: str
    cross: bool
    flags: tuple[str, ...]  # train-student flags of the row (the store and student are the bench's)
    seeds: int = 1  # run on seeds 0 .. seeds - 1 (at most --seeds)
    store: str = "train"  # the training store (STORES)


# training stores: name -> teacher-dump flags. "train" holds both students' alignment groups; the others (the modes
# section) only the teacher's own tokenizer. Every one is written from the same training documents.
STORES = {
    "train": ("--mode", "topk", "--top-k", "64"),
    "topk8": ("--mode", "topk", "--top-k", "8"),
    "topk32": ("--mode", "topk", "--top-k", "32"),
    "sampled16": ("--mode", "sampled", "--num-samples", "16"),
    "sampled64": ("--mode", "sampled", "--num-samples", "64"),
    "headtail4x16": ("--mode", "headtail", "--top-k", "4", "--num-samples", "16"),
    "full": ("--mode", "full"),
}


ROWS = [
    RealRow("cross: CE only", True, ("--loss", "ce", "--ce-weight", "1.0"), seeds=8),
    RealRow("cross: P-KL forward, first rows, first-piece map, CE 1.0 (the first real-pair defaults)", True,
            ("--loss", "pkl", "--pkl-divergence", "forward", "--ce-weight", "1.0"), seeds=3),
    RealRow("cross: P-KL chunk means, decayed-pieces map, CE 0.1", True,
            ("--loss", "pkl", "--chunk-rows", "mean", "--projection", "{proj_all}", "--pkl-divergence", "forward",
             "--ce-weight", "0.1")),
    RealRow("same tokenizer: CE only", False, ("--loss", "ce", "--ce-weight", "1.0"), seeds=3),
    RealRow("same tokenizer: KL top-64 + rest (defaults)", False, ("--loss", "auto"), seeds=3),
    # candidates for top-1 agreement across tokenizers (docs/losses.md, "Defaults measured on a real pair"); appended,
    # not inserted: a run's directory is its row's index, so the finished runs above stay reusable
    RealRow("cross: P-KL forward-reverse, first rows, first-piece map, CE 1.0", True,
            ("--loss", "pkl", "--pkl-divergence", "forward-reverse", "--ce-weight", "1.0"), seeds=3),
    RealRow("cross: P-KL reverse, first rows, first-piece map, CE 1.0", True,
            ("--loss", "pkl", "--pkl-divergence", "reverse", "--ce-weight", "1.0"), seeds=3),
    # the half-and-half mix: the second defaults, and the defaults again since the control-token fix (docs/losses.md)
    RealRow("cross: P-KL defaults (forward-reverse, reverse weight 0.5, first rows, first-piece map, CE 0.5)", True,
            ("--loss", "auto"), seeds=8),
    # the modes section (`--section modes`): one tokenizer, each store mode with train-student's defaults for it
    RealRow("same tokenizer: top-8 + rest", False, ("--loss", "auto"), seeds=3, store="topk8"),
    RealRow("same tokenizer: top-32 + rest", False, ("--loss", "auto"), seeds=3, store="topk32"),
    RealRow("same tokenizer: sampled, 16 draws", False, ("--loss", "auto"), seeds=3, store="sampled16"),
    RealRow("same tokenizer: sampled, 64 draws", False, ("--loss", "auto"), seeds=3, store="sampled64"),
    RealRow("same tokenizer: head 4 + 16 tail draws", False, ("--loss", "auto"), seeds=3, store="headtail4x16"),
    RealRow("same tokenizer: full vocabulary", False, ("--loss", "auto"), seeds=3, store="full"),
    # the mix weighted towards the reverse KL: the third defaults, until the control-token fix (docs/losses.md)
    RealRow("cross: P-KL forward-reverse, reverse weight 0.75, first rows, first-piece map, CE 0.5 (the third defaults)",
            True, ("--loss", "pkl", "--pkl-divergence", "forward-reverse", "--pkl-reverse-weight", "0.75", "--ce-weight",
                   "0.5"), seeds=8),
]
MAIN = [*ROWS[:8], ROWS[14]]  # docs/losses.md's quality-real block
MODES = [ROWS[3], ROWS[4], *ROWS[8:14]]  # docs/losses.md's quality-real-modes block: CE only and every store mode
CROSS = [ROWS[0], ROWS[7], ROWS[14]]  # README.md's quality-real-cross block: CE only, the defaults, the 0.75 mix
CROSS_QWEN3 = [ROWS[0], ROWS[7]]  # docs/losses.md's quality-real-cross-qwen3 block: the defaults on a second vocabulary
VOCABULARIES = {"llama3": "Llama-3 (128,256 ids)", "qwen3": "Qwen3 (151,669 ids)"}
# rows renamed since a report was written: old name -> current name (a report is rendered under the current names)
RENAMED = {
    "cross: P-KL forward, first rows, first-piece map, CE 1.0 (the earlier defaults)": ROWS[1].name,
    "cross: P-KL defaults (forward-reverse, first rows, first-piece map, CE 0.5)": ROWS[7].name,
    "cross: P-KL forward-reverse, reverse weight 0.75, first rows, first-piece map, CE 0.5": ROWS[14].name,
    "cross: P-KL defaults (forward-reverse, reverse weight 0.75, first rows, first-piece map, CE 0.5)": ROWS[14].name,
    "cross: P-KL forward-reverse, reverse weight 0.5, first rows, first-piece map, CE 0.5 (the second defaults)":
        ROWS[7].name,
}
# the cross-tokenizer P-KL defaults a run without a "defaults" record ran under (before forward-reverse at CE 0.5)
EARLIER_DEFAULTS = {"--ce-weight": "1.0", "--pkl-divergence": "forward"}


def current_defaults() -> dict[str, str]:
    from stage2_student.objective import CE_WEIGHT_CROSS, PKL_DIVERGENCE, PKL_REVERSE_WEIGHT

    return {"--ce-weight": str(CE_WEIGHT_CROSS), "--pkl-divergence": PKL_DIVERGENCE,
            "--pkl-reverse-weight": str(PKL_REVERSE_WEIGHT)}


def resolved(argv: list[str], cross: bool, defaults: dict[str, str]) -> dict[str, str]:
    """A run's flags (flag -> value) with the cross-tokenizer P-KL defaults it ran under written out (`--loss auto`
    is P-KL on the bench's top-64 store), so a finished run is reused only for a row that means the same."""
    flags = dict(zip(argv[::2], argv[1::2]))
    if cross and flags.get("--loss") in ("auto", "pkl"):
        flags = {**defaults, **flags, "--loss": "pkl"}
    return flags


def _xtcache(*args, log_file: Path) -> None:
    cmd = [str(Path(sys.executable).with_name("xtcache")), *map(str, args)]
    with open(log_file, "a") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:2])} failed (exit {done.returncode}): see {log_file}")


def _first_lines(src: Path, dst: Path, n: int) -> Path:
    lines = src.read_text(encoding="utf-8").splitlines(keepends=True)[:n]
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_text("".join(lines), encoding="utf-8")
    return dst


def prepare(work: Path, s: RealSettings, log_file: Path, stores: tuple[str, ...] = ("train",)) -> dict:
    """The real tier, the held-out store and the training `stores` (each reused when complete), both projection maps."""
    from xtcache.app.store_commands import store_summary
    from xtcache.errors import StoreError
    from xtcache.store import CacheReader
    from xtcache.testing.real import build_real_models

    m = build_real_models()
    cross_tok = getattr(m, f"{s.cross_student}_tokenizer")
    p = {"models": m, "work": work, "stores": {}, "cross_tok": cross_tok}
    plans = [("held", m.heldout_jsonl, s.heldout_docs, ("--mode", "full"), (cross_tok, m.teacher))]
    plans += [(name, m.train_jsonl, s.train_docs, STORES[name],
               (cross_tok, m.teacher) if name == "train" else (m.teacher,)) for name in stores]
    for name, src, n, mode, tokenizers in plans:
        store = work / "stores" / f"{name}-{n}"
        try:
            complete = CacheReader(str(store)).is_complete()
        except StoreError:
            complete = False
        if not complete:
            shutil.rmtree(store, ignore_errors=True)
            data = _first_lines(src, work / "data" / f"{'held' if name == 'held' else 'train'}-{n}.jsonl", n)
            t0 = time.perf_counter()
            _xtcache("teacher-dump", "--teacher", m.teacher, *[a for t in tokenizers for a in ("--student-tokenizer", t)],
                     "--data", data, "--out", store, "--dtype", "float32", *mode, log_file=log_file)
            log.info("store %s written in %.0f s", store, time.perf_counter() - t0)
        reader = CacheReader(str(store))
        positions = sum(int(reader.doc_pos_offsets(sh.shard_id)[-1]) for sh in reader.shards)
        p["stores"][name] = {"path": store, "positions": positions, "bytes_per_position": reader.total_bytes() / positions,
                             "teacher_bytes_per_position": store_summary(str(store)).total_array_bytes / positions,
                             "tokenizer_bytes": reader.loc.du("teacher_tokenizer"),  # the copy a store carries: fixed size
                             "dump": list(mode)}
    for pieces in ("first", "all"):
        out = work / f"{s.cross_student}-to-smollm2-{pieces}.safetensors"
        if not out.exists():
            _xtcache("projection", "build", "--student-tokenizer", cross_tok, "--teacher-tokenizer",
                     m.teacher, "--pieces", pieces, "--out", out, log_file=log_file)
        p[f"proj_{pieces}"] = out
    return p


def student(p: dict, cross: bool, seed: int) -> Path:
    from xtcache.testing.toy import build_tiny_model

    m = p["models"]
    out = p["work"] / "students" / f"{'cross' if cross else 'same'}-seed{seed}"
    if not (out / "config.json").exists():
        build_tiny_model("llama", p["cross_tok"] if cross else m.teacher, out, hidden=64, layers=2,
                         intermediate=192, seed=1 + seed)
    return out


def train(p: dict, row: RealRow, s: RealSettings, seed: int, log_file: Path) -> dict:
    out = p["work"] / "runs" / f"seed{seed}" / row.name.split(":")[0].replace(" ", "-") / str(ROWS.index(row))
    flags = [f.format(proj_all=p["proj_all"]) for f in row.flags]
    if row.cross and "--projection" not in flags and "ce" not in flags:
        flags += ["--projection", str(p["proj_first"])]
    argv = ["--cache", p["stores"][row.store]["path"], "--student", student(p, row.cross, seed), "--out", out, "--seed", seed,
            "--seq-len", s.seq_len, "--micro-batch-size", s.micro_batch_size, "--max-steps", s.steps, "--lr", s.lr,
            "--warmup-steps", s.warmup_steps, "--zero-stage", 2, *flags]
    record = out / "bench_row.json"  # the run's flags and defaults: a finished run of the same meaning is reused
    argv = list(map(str, argv))
    if record.exists() and (out / "summary.json").exists() and same_run(json.loads(record.read_text()), argv, row.cross):
        summary = json.loads((out / "summary.json").read_text())
        if same_maps(summary, argv):
            log.info("%s seed %d: reusing the finished run in %s", row.name, seed, out)
            return {"hf_dir": out / "hf", "train_s": None, "steps_per_s": summary.get("steps_per_s"), "reused": True}
        log.info("%s seed %d: the run in %s was trained through another projection map (or one its summary does not "
                 "name): training it again", row.name, seed, out)
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    _xtcache("train-student", *argv, log_file=log_file)
    record.write_text(json.dumps({"argv": argv, "defaults": current_defaults()}))
    summary = json.loads((out / "summary.json").read_text())
    return {"hf_dir": out / "hf", "train_s": time.perf_counter() - t0, "steps_per_s": summary.get("steps_per_s"),
            "reused": False}


def same_maps(summary: dict, argv: list[str]) -> bool:
    """Whether a finished run read its --projection file as it is now (the digest its summary records): a map
    built again, by an xtcache that builds maps otherwise, is another objective under the same flags."""
    from xtcache.projection import ProjectionMap

    if "--projection" not in argv:
        return True
    want = ProjectionMap.load(argv[argv.index("--projection") + 1]).digest()
    return [m.get("sha256") for m in summary.get("data", {}).get("projections", [])] == [want]


def same_run(record, argv: list[str], cross: bool) -> bool:
    """Whether a finished run's record (its argv and the defaults it ran under; a bare argv list: the earlier
    defaults) means the row's argv under the current defaults."""
    done, defaults = (record, EARLIER_DEFAULTS) if isinstance(record, list) else (record["argv"], record["defaults"])
    defaults = {"--pkl-reverse-weight": "0.5", **defaults}  # a record from before the weight: the mean
    return resolved(done, cross, defaults) == resolved(argv, cross, current_defaults())


def grade(p: dict, hf_dir: Path, cross: bool, s: RealSettings) -> dict:
    """The held-out measures of one student (module docstring), from the product's objectives."""
    import torch

    from bench.quality import Settings, batches, load_model
    from stage2_student.losses import ProjectionOperator
    from stage2_student.objective import Objective
    from stage2_student.student import model_inputs
    from xtcache.projection import ProjectionMap

    m = p["models"]
    bs = Settings(seq_len=s.seq_len, micro_batch_size=s.micro_batch_size)
    tok = p["cross_tok"] if cross else m.teacher
    key = ("evals", cross)
    if key not in p:  # the held-out full store's rows renormalised over the tokenizer's ids
        p[key] = [{**b, "teacher_residual": torch.zeros_like(b["teacher_residual"])}
                  for b in batches(str(p["stores"]["held"]["path"]), tok, bs, s.eval_batches)]
    if cross:
        ops = {pc: ProjectionOperator(ProjectionMap.load(p[f"proj_{pc}"]).to_torch_sparse(49_152))
               for pc in ("first", "all")}
        measures = {"kl": Objective("pkl", ce_weight=0.0, projection=ops["first"], chunk_rows="first"),
                    "kl_chunk_mean": Objective("pkl", ce_weight=0.0, projection=ops["all"], chunk_rows="mean")}
    else:
        measures = {"kl": Objective("kl", ce_weight=0.0)}
    ce_obj = Objective(None, ce_weight=1.0)
    model = load_model(hf_dir).eval()
    tot = {k: 0.0 for k in [*measures, "chunks", "agree", "agree_n", "ce", "tokens"]}
    tot.update({f"{k}_chunks": 0.0 for k in measures})
    with torch.no_grad():
        for b in p[key]:
            logits = model(**model_inputs(b)).logits
            for name, obj in measures.items():
                prep = obj.prepare(b, vocab=logits.shape[-1])
                tot[name] += float(obj.sums(logits, prep)[0])
                tot[f"{name}_chunks"] += prep.chunks
                if name == "kl":
                    a, n = obj.agreement(logits, prep)
                    tot["agree"] += float(a)
                    tot["agree_n"] += float(n)
            prep = ce_obj.prepare(b, vocab=logits.shape[-1])
            tot["ce"] += float(ce_obj.sums(logits, prep)[1])
            tot["tokens"] += prep.tokens
    out = {name: tot[name] / tot[f"{name}_chunks"] for name in measures}
    out.update(ce=tot["ce"] / tot["tokens"], top1=tot["agree"] / tot["agree_n"])
    return out


def run_real(work: Path, s: RealSettings, rows: list[RealRow] = MAIN) -> dict:
    if s.cross_student != "llama3":  # stores, students, maps and runs of another vocabulary: a directory of its own
        work = work / s.cross_student
    work.mkdir(parents=True, exist_ok=True)
    log_file = work / "commands.log"
    t0 = time.perf_counter()
    p = prepare(work, s, log_file, tuple(dict.fromkeys(r.store for r in rows)))
    t_prep = time.perf_counter() - t0
    results = []
    for seed in range(s.seeds):
        for row in rows:
            if seed >= row.seeds:
                continue
            run = train(p, row, s, seed, log_file)
            rec = {"row": row.name, "cross": row.cross, "store": row.store, "seed": seed, "train_s": run["train_s"],
                   "reused": run["reused"],
                   **grade(p, run["hf_dir"], row.cross, s)}
            results.append(rec)
            log.info("%s", json.dumps(rec))
    stores = {k: {key: v for key, v in st.items() if key != "path"} for k, st in p["stores"].items()}
    from bench.quality import machine

    return {"settings": asdict(s), "results": results, "stores": stores, "prepare_s": t_prep,
            "wall_s": time.perf_counter() - t0, "machine": machine(), "date": time.strftime("%Y-%m-%d", time.gmtime())}


def current_names(results: list[dict]) -> list[dict]:
    """A report's runs with each row under its current name (RENAMED: a report written before a rename)."""
    return [{**r, "row": RENAMED.get(r["row"], r["row"])} for r in results]


def markdown(report: dict) -> str:
    s, res = report["settings"], current_names(report["results"])
    names = sorted(dict.fromkeys(r["row"] for r in res), key=lambda n: n.startswith("same"))  # cross rows first
    train = report["stores"]["train"]
    vocab = VOCABULARIES[s.get("cross_student", "llama3")]
    out = [f"Measured {report['date']} on {report['machine']}; SmolLM2-135M-Instruct teacher, fresh tiny Llama students "
           f"(cross rows: on the {vocab} vocabulary), "
           f"{s['steps']} steps x {s['micro_batch_size']} windows x {s['seq_len']} tokens at lr {s['lr']:g}, "
           f"{s['train_docs']} training and {s['heldout_docs']} held-out documents of the Python language reference; "
           f"training store top-64 + rest, {train['bytes_per_position']:.1f} B/position ("
           f"{train['tokenizer_bytes'] / train['positions']:.1f} of them the {train['tokenizer_bytes'] / 1e6:.1f} MB "
           "teacher tokenizer it carries, a fixed size); "
           f"total {report['wall_s'] / 60:.0f} min.", "",
           "| row | seeds | held-out KL | chunk-mean P-KL | held-out CE | top-1 agreement |",
           "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for name in names:
        rs = [r for r in res if r["row"] == name]
        cm = [r["kl_chunk_mean"] for r in rs if "kl_chunk_mean" in r]
        out.append(f"| {name} | {len(rs)} | {mean_pm([r['kl'] for r in rs])} | {mean_pm(cm) if cm else '-'} | "
                   f"{mean_pm([r['ce'] for r in rs])} | {mean_pm([r['top1'] for r in rs])} |")
    reused = sorted({(r["row"], r["seed"]) for r in res if r.get("reused")}, key=lambda x: (x[1], x[0]))
    if reused:
        out += ["", f"{len(reused)} of the {len(res)} runs (seed {', '.join(sorted({str(sd) for _, sd in reused}))}) "
                "were finished runs of the same objective in the bench's work directory, reused (each run's "
                "bench_row.json holds its flags and the defaults it ran under); every run is graded in this invocation."]
    out += ["", "Held-out KL: cross rows the first-token KL, same-tokenizer rows the token-level KL over the full "
            "vocabulary (different measures: compare rows of one kind). Chunk-mean P-KL: cross rows only.", ""]
    out += [f"- {n}" for n in paired_notes(res)]
    return "\n".join(out) + "\n"


def paired_notes(res: list[dict]) -> list[str]:
    """Each key KD row against CE only of its kind on the same seeds: mean paired difference and its spread."""
    notes = []
    for cross in (False, True):
        base = {r["seed"]: r for r in res if r["cross"] == cross and r["row"].endswith("CE only")}
        for name in dict.fromkeys(r["row"] for r in res if r["cross"] == cross and not r["row"].endswith("CE only")):
            rs = [r for r in res if r["row"] == name and r["seed"] in base]
            if len(rs) < 2:
                continue
            parts, lost = [], []
            for col, better in (("kl", -1), ("ce", -1), ("top1", 1)):
                d = [r[col] - base[r["seed"]][col] for r in rs]
                mean, sd = statistics.fmean(d), statistics.stdev(d)
                wins = sum(x * better > 0 for x in d)
                parts.append(f"{col} {mean:+.3f} (sd {sd:.3f}, better on {wins}/{len(d)} seeds)")
                if wins < len(d) or mean * better <= sd:  # a win: better on every seed, mean beyond the paired sd
                    lost.append(col)
            verdict = f"not won: {', '.join(lost)}" if lost else "won on all three"
            notes.append(f"{name} vs CE only, paired by seed: " + "; ".join(parts) + f" ({verdict})")
    return notes


def share_of_full_gain(rs: list[dict], ce: dict, full: dict) -> list[float]:
    """Per seed: the part of the full-vocabulary store's held-out KL gain over CE only that a row recovers (seeds
    where the full store gained nothing have no share)."""
    return [(ce[r["seed"]]["kl"] - r["kl"]) / (ce[r["seed"]]["kl"] - full[r["seed"]]["kl"])
            for r in rs if r["seed"] in ce and r["seed"] in full and ce[r["seed"]]["kl"] > full[r["seed"]]["kl"]]


def modes_markdown(report: dict) -> str:
    """The modes section: one tokenizer, a row per training store, graded like the main table, with each row's share
    of the full-vocabulary store's KL gain over CE only (paired by seed) and its store's bytes per position."""
    s, res, stores = report["settings"], current_names(report["results"]), report["stores"]
    ce = {r["seed"]: r for r in res if r["row"].endswith("CE only")}
    full = {r["seed"]: r for r in res if r["store"] == "full"}
    out = [f"Measured {report['date']} on {report['machine']}; SmolLM2-135M-Instruct teacher, fresh tiny Llama students on "
           f"its own vocabulary (49,152 ids), {s['steps']} steps x {s['micro_batch_size']} windows x {s['seq_len']} tokens "
           f"at lr {s['lr']:g}, train-student's defaults for each store (`--loss auto`), {s['train_docs']} training "
           f"documents ({stores['train']['positions']:,} positions) and {s['heldout_docs']} held-out documents of the "
           f"Python language reference; total {report['wall_s'] / 60:.0f} min.", "",
           "| row | teacher-dump | B/position | seeds | held-out KL | share of the full store's gain | held-out CE | "
           "top-1 agreement |", "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    names = sorted(dict.fromkeys(r["row"] for r in res),
                   key=lambda n: float("-inf") if n.endswith("CE only") else
                   -stores[next(r["store"] for r in res if r["row"] == n)]["teacher_bytes_per_position"])
    for name in names:
        rs = [r for r in res if r["row"] == name]
        st = stores[rs[0]["store"]]
        ce_row = name.endswith("CE only")
        shares = [] if ce_row else [100 * x for x in share_of_full_gain(rs, ce, full)]
        share = mean_pm(shares, ".0f") + "%" if shares else "-"
        out.append(f"| {name} | {'-' if ce_row else '`' + ' '.join(st['dump']) + '`'} | "
                   f"{'-' if ce_row else format(st['teacher_bytes_per_position'], '.1f')} | {len(rs)} | "
                   f"{mean_pm([r['kl'] for r in rs])} | {share} | {mean_pm([r['ce'] for r in rs])} | "
                   f"{mean_pm([r['top1'] for r in rs])} |")
    out += ["", "B/position: the teacher arrays of the store (`xtcache inspect`'s array table), without the teacher "
            "tokenizer every store carries and the alignment arrays. Held-out KL: the token-level KL(teacher || student) "
            "over the full vocabulary on the held-out documents, against a full-vocabulary store of them. Share: "
            "(KL of CE only - KL of the row) / (KL of CE only - KL of the full-vocabulary row), paired by seed.", ""]
    out += [f"- {n}" for n in paired_notes(res)]
    return "\n".join(out) + "\n"
