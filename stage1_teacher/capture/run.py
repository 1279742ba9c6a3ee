"""Choosing, checking and decoding the teacher capture path of `xtcache teacher-dump`.

`open_capture` starts the engine the config asks for and returns a `Capture`: the engine plus how
to turn its raw per-window output into `head.Targets`.

* `--engine vllm` with `--fast-path` (default): the first batch is run through vLLM's prompt
  log-probs (the reference), that engine is shut down, the hidden-state engine is started and
  its log-probs (via the teacher's lm_head) must agree with the reference within the tolerance,
  else `CaptureError`. One engine at a time keeps peak memory at one engine (two coexist on a CPU
  host, but on a GPU each reserves its own memory fraction). The check costs a second engine
  start, so a store runs it once: given a passed `trusted` check of the same teacher, vLLM
  version, dtype and tensor-parallel size (`check_key`), only the hidden-state engine starts.
* Architectures whose head the fast path cannot reproduce fall back to prompt log-probs, with a
  WARNING and a note in the summary; full and sampled modes then ask vLLM for the whole
  vocabulary (exact, slow).
* `--engine hf`: transformers logits.

    python -c "import stage1_teacher.capture.run as c; help(c.open_capture)"
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np

from schemas.models import DRAWN_MODES
from stage1_teacher.capture import budget, preflight
from stage1_teacher.capture.head import (
    Targets,
    TeacherHead,
    UnsupportedHead,
    block_rows,
    distill_targets,
    read_config,
    resolved_dtype,
    sample_seed,
)
from stage1_teacher.capture.hf_engine import FORWARD_TOKENS, HfEngine
from stage1_teacher.capture.vllm_engine import (
    VllmHiddenEngine,
    VllmPromptLogprobEngine,
    platform_name,
    requested_model_runner,
    resolved_eager,
    vllm_options,
)
from xtcache.devices import compute_device
from xtcache.errors import CaptureError
from xtcache.fingerprint import canonical_sha256

log = logging.getLogger(__name__)

CHECK_K = 20  # reference log-probs compared on the first batch
CHECK_WINDOWS = 16  # at most this many windows of the first batch are compared
FAST_PATH = "vLLM hidden states + teacher lm_head (exact)"


@dataclass
class Capture:
    """A started engine plus the settings needed to decode its output."""

    engine: object
    kind: str  # "hidden", "logits" or "logprobs"
    mode: str
    k: int  # stored width (top-k, V, num_samples, or top-k + min(num_samples, V - top-k) in headtail mode)
    vocab_size: int  # len(teacher tokenizer)
    num_samples: int
    seed: int
    top_k: int = 0  # headtail mode: the exact head's width (--top-k)
    head: TeacherHead | None = None
    path: str = ""
    notes: list[str] = field(default_factory=list)
    check_gap: float | None = None
    check: dict | None = None  # the first-batch check run here (None: trusted or not needed)
    start_seconds: float = 0.0
    owned: bool = True  # close the engine at the end (False when a test shares it)

    def targets(self, raw, rows: np.ndarray, window_tokens: np.ndarray, doc_hash: str, window: int) -> Targets:
        """Targets of window rows `rows` (indices >= 1 into the window; row j predicts token j)."""
        import torch

        next_ids = window_tokens[rows]

        def generator(device):
            if self.mode not in DRAWN_MODES:
                return None
            return torch.Generator(device=device).manual_seed(sample_seed(self.seed, doc_hash, window))

        if self.kind in ("hidden", "logits"):
            sel = torch.as_tensor(rows - 1, device=raw.device)
            head = self.head if self.kind == "hidden" else None
            device = head.weight.device if head is not None else raw.device
            return distill_targets(raw[sel], next_ids, mode=self.mode, k=self.head_k, vocab_size=self.vocab_size,
                                   num_samples=self.num_samples, generator=generator(device), head=head)
        return logprobs_to_targets(raw, rows - 1, self, generator("cpu"))

    def targets_many(self, items: list[tuple]) -> list[Targets]:
        """`targets` for many (raw, rows, window_tokens, doc_hash, window) at once.

        Top-k and full modes concatenate the rows of all windows into one block (one matmul, one
        top-k): per-call overhead dominates for short windows. Sampled and headtail modes keep one call
        per window because each window has its own seeded stream.
        """
        import torch

        if self.mode in DRAWN_MODES or self.kind == "logprobs" or len(items) < 2:
            return [self.targets(*it) for it in items]
        blocks, nexts = [], []
        for raw, rows, tokens, _, _ in items:
            blocks.append(raw[torch.as_tensor(rows - 1, device=raw.device)])
            nexts.append(tokens[rows])
        t = distill_targets(torch.cat(blocks), np.concatenate(nexts), mode=self.mode, k=self.k,
                            vocab_size=self.vocab_size, head=self.head if self.kind == "hidden" else None)
        out, a = [], 0
        for b in blocks:
            n = int(b.shape[0])
            out.append(Targets(ids=t.ids[a:a + n], logprobs=t.logprobs[a:a + n], counts=None,
                               residual=t.residual[a:a + n], realized=t.realized[a:a + n]))
            a += n
        return out

    @property
    def head_k(self) -> int:
        """The `k` distill_targets takes: the head's width in headtail mode, else the stored width."""
        return self.top_k if self.mode == "headtail" else self.k

    def close(self) -> None:
        if self.owned and self.engine is not None:
            self.engine.close()
        self.engine = None


def logprobs_to_targets(raw, sel: np.ndarray, cap: Capture, gen) -> Targets:
    """Targets from vLLM prompt log-probs (rows `sel` of the window's [L-1, k'] arrays)."""
    import torch

    ids, lp, realized = raw.ids[sel], raw.logprobs[sel], raw.realized[sel]
    V = cap.vocab_size
    if cap.mode == "topk":
        keep = ids < V  # drop padded lm_head columns; their mass stays in the residual
        order = np.argsort(~keep, axis=1, kind="stable")[:, :cap.k]
        out_ids = np.take_along_axis(ids, order, 1)
        out_lp = np.take_along_axis(lp, order, 1)
        if not np.all(out_ids < V):
            raise CaptureError(f"vLLM returned fewer than --top-k {cap.k} ids inside the tokenizer's vocabulary "
                               "for a position (padded lm_head columns ranked high); use --engine hf")
        mass = np.exp(out_lp.astype(np.float64)).sum(1)
        return Targets(ids=out_ids.astype(np.int32), logprobs=out_lp.astype(np.float32), counts=None,
                       residual=np.clip(1.0 - mass, 0.0, None).astype(np.float32), realized=realized.astype(np.float32))
    # whole-vocabulary log-probs: scatter into a dense matrix; log-probs are valid logits
    width = int(ids.max()) + 1 if ids.size else V
    dense = np.full((len(sel), max(width, V)), -np.inf, dtype=np.float32)
    np.put_along_axis(dense, ids, lp, 1)
    out = distill_targets(torch.from_numpy(dense), np.zeros(len(sel), dtype=np.int64), mode=cap.mode, k=cap.head_k,
                          vocab_size=V, num_samples=cap.num_samples, generator=gen)
    out.realized = realized.astype(np.float32)
    return out


def reference_k(mode: str, k: int, model_vocab: int, vocab_size: int) -> int:
    """Log-probs to request from vLLM: top-k plus room for padded columns, or -1 (all)."""
    if mode != "topk":
        return -1
    return min(model_vocab, k + max(0, model_vocab - vocab_size))


HALF_MANTISSA_BITS = {"bfloat16": 7, "bf16": 7, "auto": 7, "float16": 10, "fp16": 10, "half": 10}


def logit_ulp(dtype: str, logit_max: float) -> float:
    """Spacing of `dtype`'s representable values at the magnitude of the largest logit (0 in fp32).

    vLLM's reference log-probs come from logits rounded to the engine's dtype ("auto" counts as
    bf16, the coarser of the two half types), so their error grows with the logits' scale: at
    |z| in [32, 64) one bf16 step is 0.25 nats, at [16, 32) 0.125.
    """
    bits = HALF_MANTISSA_BITS.get(dtype)
    if bits is None or not np.isfinite(logit_max) or logit_max <= 0:
        return 0.0
    return float(2.0 ** (np.floor(np.log2(logit_max)) - bits))


def default_tolerance(dtype: str, logit_max: float = 0.0) -> tuple[float, float]:
    """(largest, mean) |fast - reference| log-prob gap allowed on the first batch.

    In float32 both paths agree to ~1e-5: (1e-3, 1e-4). In half precision the reference rounds
    each logit to the nearest representable value, an error uniform within half a step u =
    `logit_ulp(dtype, logit_max)`: its mean size is u/4 (measured on a 152k vocabulary in bf16:
    0.03 at top logits of 20-30, u = 0.125; 0.062 near 45, u = 0.25). The mean bound is u/2 (at
    least 0.05), twice that expectation; single entries may differ by a step on each side, so the
    largest bound is 4u (at least 0.5). A wrong head (missing soft-capping or scaling) shifts
    every entry by far more than a rounding step, which the mean bound catches.
    """
    u = logit_ulp(dtype, logit_max)
    if dtype in ("float32", "fp32") or u == 0.0 and dtype not in HALF_MANTISSA_BITS:
        return 1e-3, 1e-4
    return max(0.5, 4 * u), max(0.05, u / 2)


def compare_with_reference(hidden: list, reference: list, head: TeacherHead, dtype: str,
                           tolerance: float | None = None) -> dict:
    """The fast path's log-probs against the reference's at the reference's ids and realized tokens.

    Logits are made block by block on the head's device (`head_rows`), so no [L-1, V] matrix of a
    whole window exists. Returns the check record's fields (max and mean gap, the largest logit,
    the tolerances); raises CaptureError, carrying them as `.check`, when the largest gap exceeds
    the tolerance (`--check-tolerance`, else `default_tolerance` at the largest logit) or the mean
    gap its bound.
    """
    gap, total, count, logit_max = 0.0, 0.0, 0, 0.0
    for h, ref in zip(hidden, reference):
        if len(ref.ids) == 0:
            continue
        lp, zmax = head_rows_logprobs(head, h[:-1], ref.ids)
        diff = np.abs(lp - ref.logprobs)
        gap = max(gap, float(diff.max()))
        total, count = total + float(diff.sum()), count + diff.size
        logit_max = max(logit_max, zmax)
    mean = total / max(1, count)
    tol, mean_tol = default_tolerance(dtype, logit_max)
    if tolerance is not None:
        tol, mean_tol = tolerance, tolerance / MEAN_GAP_FACTOR
    check = {"max_gap": gap, "mean_gap": mean, "logit_max": logit_max, "tolerance": tol, "mean_tolerance": mean_tol}
    if not np.isfinite(gap) or gap > tol or mean > mean_tol:
        err = CaptureError(
            f"the hidden-state fast path disagrees with vLLM's own prompt log-probs on the first batch: "
            f"max |gap| = {gap:.4g}, mean {mean:.3g} (tolerance {tol:g}, mean {mean_tol:g}, derived from {dtype} "
            f"rounding at the largest logit {logit_max:.1f}). The teacher's output head is not reproduced (unusual "
            "scaling or head); rerun with --no-fast-path, or set --check-tolerance if the dtype explains it")
        err.check = {**check, "passed": False}
        raise err
    return check


MEAN_GAP_FACTOR = 10  # with --check-tolerance T the mean gap must stay below T / MEAN_GAP_FACTOR


def head_rows_logprobs(head: TeacherHead, hidden, ids: np.ndarray) -> tuple[np.ndarray, float]:
    """Log-probs at `ids` [n, k] of the rows of `hidden` [n, H] and the largest |logit| seen.

    Rows go through the head in blocks of `block_rows(V)`; everything is computed on the
    head's device and only the [n, k] gathered values come back.
    """
    import torch

    ids = np.minimum(ids, head.model_vocab - 1)
    out = np.empty(ids.shape, dtype=np.float32)
    zmax = []
    step = block_rows(head.model_vocab)
    for a in range(0, int(hidden.shape[0]), step):
        z = head.logits(hidden[a:a + step])  # [r, V_model] fp32 on the head's device
        lp = z.gather(1, torch.as_tensor(ids[a:a + step]).to(z.device)) - torch.logsumexp(z, -1, keepdim=True)
        out[a:a + step] = lp.cpu().numpy()
        zmax.append(z.abs().amax().reshape(1))
    return out, float(torch.cat(zmax).amax().cpu().numpy()) if zmax else 0.0


class EngineCache:
    """Started engines kept across several dumps in one process (tests); keys are settings tuples."""

    def __init__(self):
        self.engines: dict[tuple, object] = {}

    def get(self, key: tuple, factory):
        if key not in self.engines:
            self.engines[key] = factory()
        return self.engines[key]

    def close(self) -> None:
        for e in self.engines.values():
            e.close()
        self.engines.clear()


def check_key(teacher_model: str, teacher) -> dict:
    """Where a first-batch check of the fast path was made, and its sha256 (`key`).

    `teacher`: the dump's teacher settings. A check holds for one teacher, vLLM version, platform
    (CPU, or the CUDA device's name: the CPU and CUDA builds report the same version), requested
    model runner, eager or compiled execution, dtype and tensor-parallel size; a record made
    anywhere else has another key and is never trusted.
    """
    import vllm

    d = {"teacher_model": teacher_model, "vllm_version": vllm.__version__, "platform": platform_name(),
         "model_runner_requested": requested_model_runner(), "enforce_eager": resolved_eager(teacher.enforce_eager),
         "dtype": resolved_dtype(teacher.teacher, teacher.dtype), "tensor_parallel_size": teacher.tensor_parallel_size}
    return {**d, "key": canonical_sha256(d)}


def needs_check(cfg) -> bool:
    """True when the configured path starts with a first-batch check (vLLM fast path)."""
    return cfg.teacher.engine == "vllm" and cfg.teacher.fast_path


def open_capture(cfg, *, vocab_size: int, k: int, window_len: int, max_model_len: int,
                 first_batch: list[np.ndarray], engines: EngineCache | None = None,
                 trusted: dict | None = None) -> Capture:
    """Start the configured capture path; for the vLLM fast path, check it on `first_batch`, unless
    `trusted` (a passed check record of the same `check_key`, or {} to defer to one) is given.

    The check run here is returned in `Capture.check` (max gap, tolerance, windows; on failure the
    CaptureError carries it as `.check`) for the caller to record."""
    t = cfg.teacher
    c = cfg.capture
    dtype = resolved_dtype(t.teacher, t.dtype)  # one dtype for the engines, the head and the check's tolerance
    t0 = time.perf_counter()
    common = dict(mode=c.mode, k=k, vocab_size=vocab_size, num_samples=c.num_samples, seed=c.seed,
                  top_k=c.top_k if c.mode == "headtail" else 0, owned=engines is None)

    def make(key, factory):
        return engines.get(key, factory) if engines is not None else factory()

    if t.engine == "hf":
        eng = make(("hf", t.teacher, dtype), lambda: HfEngine(t.teacher, dtype=dtype,
                                                                batch_tokens=min(c.batch_tokens, FORWARD_TOKENS)))
        cap = Capture(engine=eng, kind="logits", path="transformers forward, targets on its logits", **common)
        cap.start_seconds = time.perf_counter() - t0
        return cap

    opts = vllm_options(cfg, max_model_len)
    preflight.check_device_memory(cfg, opts, window_len=window_len, k=k, reference_check=trusted is None)
    head = None
    notes = []
    if t.fast_path:  # read into host memory; it moves to the device once the engine has started
        try:
            head = TeacherHead.load(t.teacher, "cpu", dtype=_torch_dtype(dtype))
        except UnsupportedHead as e:
            msg = f"FALLBACK to vLLM prompt log-probs (slower): {e}"
            log.warning(msg)
            notes.append(msg)
    model_vocab = head.model_vocab if head is not None else _model_vocab(t.teacher, vocab_size)
    if head is None:
        kk = reference_k(c.mode, k, model_vocab, vocab_size)
        eng = make(("vllm-plp", opts, kk), lambda: VllmPromptLogprobEngine(opts, kk))
        cap = Capture(engine=eng, kind="logprobs", path=f"vLLM prompt log-probs (k={kk})", notes=notes, **common)
        cap.start_seconds = time.perf_counter() - t0
        return cap

    if trusted is not None:  # the store holds a passed check of this teacher, vLLM, platform, dtype and TP
        eng = make(("vllm-hidden", opts), lambda: VllmHiddenEngine(opts))
        if trusted:
            _same_runner(trusted, eng)
        cap = Capture(engine=eng, kind="hidden", head=head.to(compute_device()), notes=notes,
                      check_gap=trusted.get("max_gap"), path=FAST_PATH, **common)
        cap.start_seconds = time.perf_counter() - t0
        return cap
    return _checked_fast_path(cfg, head, first_batch[:CHECK_WINDOWS], make, model_vocab=model_vocab, opts=opts,
                              owned=engines is None, t0=t0, notes=notes, common=common)


def _checked_fast_path(cfg, head: TeacherHead, sample: list, make, *, model_vocab: int, opts, owned: bool, t0: float,
                       notes: list, common: dict) -> Capture:
    """The vLLM fast path, checked on `sample` against a prompt-log-probs reference engine that is
    started (and, when `owned`, closed and its memory released) before the hidden-state engine;
    the head moves to the device only once that engine has started."""
    t = cfg.teacher
    before = budget.device_memory_used(t.tensor_parallel_size)  # None off CUDA
    ref_engine = make(("vllm-plp", opts, CHECK_K), lambda: VllmPromptLogprobEngine(opts, min(CHECK_K, model_vocab)))
    try:
        reference = ref_engine.run(sample)
    finally:
        if owned:
            ref_engine.close()
    if owned:
        budget.wait_for_release(before, lambda: budget.device_memory_used(t.tensor_parallel_size))
    eng = make(("vllm-hidden", opts), lambda: VllmHiddenEngine(opts))
    start = time.perf_counter() - t0
    check = {"windows": len(sample), "reference": f"vLLM prompt log-probs (top {CHECK_K})",
             "model_runner": eng.model_runner()}
    try:
        head = head.to(compute_device())
        measured = compare_with_reference(eng.run(sample), reference, head, opts.dtype, t.check_tolerance)
    except BaseException as e:
        if owned:
            eng.close()
        if isinstance(e, CaptureError):
            e.check = {**check, **(getattr(e, "check", None) or {"passed": False, "tolerance": 0.0})}
        raise
    log.info("fast path checked against vLLM prompt log-probs on %d windows: max gap %.3g, mean %.3g (tolerance "
             "%g, mean %g, at the largest logit %.1f)", len(sample), measured["max_gap"], measured["mean_gap"],
             measured["tolerance"], measured["mean_tolerance"], measured["logit_max"])
    cap = Capture(engine=eng, kind="hidden", head=head, notes=notes, check_gap=measured["max_gap"],
                  check={**check, **measured, "passed": True}, path=FAST_PATH, **common)
    cap.start_seconds = start
    return cap


def _same_runner(trusted: dict, engine) -> None:
    """A trusted record checked another model runner than the one this engine chose: refuse it."""
    ran = engine.model_runner()
    if trusted.get("model_runner") and trusted["model_runner"] != ran:
        raise CaptureError(f"the first-batch check this store trusts ran on vLLM's model runner "
                           f"{trusted['model_runner']}; this engine runs {ran}: set VLLM_USE_V2_MODEL_RUNNER to "
                           f"match, or start a new --out so the check runs here")


def _torch_dtype(name: str):
    import torch

    return {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
            "half": torch.float16}.get(name, torch.float32)


def _model_vocab(model_dir: str, default: int) -> int:
    cfg = read_config(model_dir)
    return int(cfg.get("vocab_size") or cfg.get("text_config", {}).get("vocab_size") or default)
