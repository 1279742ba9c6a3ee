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

    python -c "import stage1_teacher.capture as c; help(c.open_capture)"
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np

from stage1_teacher.head import Targets, TeacherHead, UnsupportedHead, distill_targets, sample_seed
from xtcache.errors import CaptureError

log = logging.getLogger(__name__)

CHECK_K = 20  # reference log-probs compared on the first batch
CHECK_WINDOWS = 16  # at most this many windows of the first batch are compared


@dataclass
class Capture:
    """A started engine plus the settings needed to decode its output."""

    engine: object
    kind: str  # "hidden", "logits" or "logprobs"
    mode: str
    k: int  # stored width (top-k, V or num_samples)
    vocab_size: int  # len(teacher tokenizer)
    num_samples: int
    seed: int
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
            if self.mode != "sampled":
                return None
            return torch.Generator(device=device).manual_seed(sample_seed(self.seed, doc_hash, window))

        if self.kind in ("hidden", "logits"):
            sel = torch.as_tensor(rows - 1, device=raw.device)
            head = self.head if self.kind == "hidden" else None
            device = head.weight.device if head is not None else raw.device
            return distill_targets(raw[sel], next_ids, mode=self.mode, k=self.k, vocab_size=self.vocab_size,
                                   num_samples=self.num_samples, generator=generator(device), head=head)
        return logprobs_to_targets(raw, rows - 1, self, generator("cpu"))

    def targets_many(self, items: list[tuple]) -> list[Targets]:
        """`targets` for many (raw, rows, window_tokens, doc_hash, window) at once.

        Top-k and full modes concatenate the rows of all windows into one block (one matmul, one
        top-k): per-call overhead dominates for short windows. Sampled mode keeps one call per window
        because each window has its own seeded stream.
        """
        import torch

        if self.mode == "sampled" or self.kind == "logprobs" or len(items) < 2:
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
    out = distill_targets(torch.from_numpy(dense), np.zeros(len(sel), dtype=np.int64), mode=cap.mode, k=cap.k,
                          vocab_size=V, num_samples=cap.num_samples, generator=gen)
    out.realized = realized.astype(np.float32)
    return out


def reference_k(mode: str, k: int, model_vocab: int, vocab_size: int) -> int:
    """Log-probs to request from vLLM: top-k plus room for padded columns, or -1 (all)."""
    if mode != "topk":
        return -1
    return min(model_vocab, k + max(0, model_vocab - vocab_size))


def default_tolerance(dtype: str) -> float:
    """Largest allowed |fast - reference| log-prob gap on the first batch.

    In float32 both paths agree to ~1e-5. In half precision (and "auto", which vLLM may run in fp16
    or bf16) vLLM's own log-probs come from half-precision logits: with logits of magnitude ~20 one
    rounding step is 0.016 (fp16) or 0.125 (bf16), so single entries can differ by a few tenths
    while the head is right. A wrong head (missing soft-capping or scaling) shifts every entry, which
    the mean gap (MEAN_GAP_FACTOR x smaller bound) catches.
    """
    return 1e-3 if dtype in ("float32", "fp32") else 0.5


MEAN_GAP_FACTOR = 10  # the mean gap must stay below tolerance / MEAN_GAP_FACTOR


def compare_with_reference(hidden: list, reference: list, head: TeacherHead, tolerance: float) -> float:
    """Largest |fast - reference| log-prob gap over the reference's ids and realized tokens.

    Raises CaptureError when the largest gap exceeds `tolerance` or the mean gap exceeds
    `tolerance / MEAN_GAP_FACTOR`.
    """
    import torch

    gap, total, count = 0.0, 0.0, 0
    for h, ref in zip(hidden, reference):
        if len(ref.ids) == 0:
            continue
        z = head.logits(h[:-1])
        lp = (z - torch.logsumexp(z, -1, keepdim=True)).cpu().numpy()
        ids = np.minimum(ref.ids, lp.shape[1] - 1)
        diff = np.abs(np.take_along_axis(lp, ids, 1) - ref.logprobs)
        gap = max(gap, float(diff.max()))
        total, count = total + float(diff.sum()), count + diff.size
    mean = total / max(1, count)
    if not np.isfinite(gap) or gap > tolerance or mean > tolerance / MEAN_GAP_FACTOR:
        raise CaptureError(
            f"the hidden-state fast path disagrees with vLLM's own prompt log-probs on the first batch: "
            f"max |gap| = {gap:.4g}, mean {mean:.3g} (tolerance {tolerance:g}, mean {tolerance / MEAN_GAP_FACTOR:g}). "
            "The teacher's output head is not reproduced (unusual scaling or head); rerun with --no-fast-path, "
            "or raise --check-tolerance if the dtype explains it")
    return gap


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


def check_key(teacher_model: str, dtype: str, tensor_parallel_size: int) -> dict:
    """What a first-batch check of the fast path depends on, and its sha256 (`key`)."""
    import hashlib
    import json

    import vllm

    d = {"teacher_model": teacher_model, "vllm_version": vllm.__version__, "dtype": dtype,
         "tensor_parallel_size": tensor_parallel_size}
    return {**d, "key": hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()}


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
    t0 = time.perf_counter()
    common = dict(mode=c.mode, k=k, vocab_size=vocab_size, num_samples=c.num_samples, seed=c.seed,
                  owned=engines is None)

    def make(key, factory):
        return engines.get(key, factory) if engines is not None else factory()

    if t.engine == "hf":
        from stage1_teacher.capture_hf import HfEngine

        eng = make(("hf", t.teacher, t.dtype), lambda: HfEngine(t.teacher, dtype=t.dtype, batch_tokens=c.batch_tokens))
        cap = Capture(engine=eng, kind="logits", path="transformers forward + torch top-k", **common)
        cap.start_seconds = time.perf_counter() - t0
        return cap

    from stage1_teacher.capture_vllm import VllmHiddenEngine, VllmOptions, VllmPromptLogprobEngine, on_cuda

    opts = VllmOptions(model=t.teacher, tensor_parallel_size=t.tensor_parallel_size, dtype=t.dtype,
                       gpu_memory_utilization=t.gpu_memory_utilization, max_model_len=max_model_len,
                       max_num_batched_tokens=t.max_num_batched_tokens or max(8192, max_model_len),
                       enforce_eager=t.enforce_eager, seed=c.seed)
    head = None
    notes = []
    if t.fast_path:
        try:
            head = TeacherHead.load(t.teacher, "cuda" if on_cuda() else "cpu",
                                    dtype=None if t.dtype in ("auto", "float32") else _torch_dtype(t.dtype))
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

    if trusted is not None:  # the store holds a passed check of this teacher, vLLM, dtype and TP
        eng = make(("vllm-hidden", opts), lambda: VllmHiddenEngine(opts))
        cap = Capture(engine=eng, kind="hidden", head=head, notes=notes, check_gap=trusted.get("max_gap"),
                      path="vLLM hidden states + teacher lm_head (exact)", **common)
        cap.start_seconds = time.perf_counter() - t0
        return cap
    sample = first_batch[:CHECK_WINDOWS]
    ref_engine = make(("vllm-plp", opts, CHECK_K), lambda: VllmPromptLogprobEngine(opts, min(CHECK_K, model_vocab)))
    try:
        reference = ref_engine.run(sample)
    finally:
        if engines is None:
            ref_engine.close()
    eng = make(("vllm-hidden", opts), lambda: VllmHiddenEngine(opts))
    start = time.perf_counter() - t0
    tol = t.check_tolerance if t.check_tolerance is not None else default_tolerance(t.dtype)
    check = {"tolerance": tol, "windows": len(sample), "reference": f"vLLM prompt log-probs (top {CHECK_K})"}
    try:
        gap = compare_with_reference(eng.run(sample), reference, head, tol)
    except BaseException as e:
        if engines is None:
            eng.close()
        if isinstance(e, CaptureError):
            e.check = {**check, "passed": False, "max_gap": None}
        raise
    log.info("fast path checked against vLLM prompt log-probs on %d windows: max gap %.3g (tolerance %g)",
             len(sample), gap, tol)
    cap = Capture(engine=eng, kind="hidden", head=head, notes=notes, check_gap=gap,
                  check={**check, "passed": True, "max_gap": gap},
                  path="vLLM hidden states + teacher lm_head (exact)", **common)
    cap.start_seconds = start
    return cap


def _torch_dtype(name: str):
    import torch

    return {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
            "half": torch.float16}.get(name, torch.float32)


def _model_vocab(model_dir: str, default: int) -> int:
    from stage1_teacher.head import read_config

    cfg = read_config(model_dir)
    return int(cfg.get("vocab_size") or cfg.get("text_config", {}).get("vocab_size") or default)
