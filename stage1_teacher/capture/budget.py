"""Device memory of `xtcache teacher-dump` on CUDA, estimated before any engine starts.

vLLM reserves `--gpu-memory-utilization` x total of every device it uses ("vLLM's share") and
refuses to start when that much is not free. Its share holds the teacher's weights (split by
tensor parallelism), its activations and its KV cache, which must hold at least one
`max_model_len` sequence. Everything else lives in the rest of the device, and on cuda:0 that
is a lot: the CUDA contexts of xtcache's process and of vLLM's worker (vLLM measures its free
memory after its own context exists, so the context is outside its share), the teacher's lm_head
(V x H in the compute dtype: 16 bits unless --dtype float32), the row blocks of [rows, V] float32 logits of
`head.distill_targets`, and, while the reference engine of the first-batch check runs, vLLM's own
prompt log-prob logits (its memory profile never runs prompt log-probs, so they are not in its
share). `device_budget` is the arithmetic (pure, no device needed); `stage1_teacher.capture.preflight.
check_device_memory` feeds it NVML's numbers and refuses a configuration that cannot fit.

`wait_for_release` polls NVML until the reference engine's memory is back, so the capture
engine does not start while the previous one still holds its share.

    python -m stage1_teacher.capture.budget TEACHER_DIR 80   # the budget of a teacher on one 80 GiB device
"""

from __future__ import annotations

import json
import logging
import math
import os
import struct
import sys
import time
from dataclasses import dataclass, field, replace

from stage1_teacher.capture.head import block_rows, read_config, weight_files
from xtcache import devices
from xtcache.errors import CaptureError

log = logging.getLogger(__name__)

GiB = 1 << 30
CUDA_CONTEXT_BYTES = GiB // 2  # per process and device: driver context, cuBLAS workspace, kernels (0.3-0.6 GiB measured elsewhere, not here)
KV_BLOCK_TOKENS = 16  # vLLM allocates KV cache in blocks of 16 tokens
# The CUDA runtime's total (what vLLM multiplies by --gpu-memory-utilization: torch.cuda.mem_get_info) is below
# NVML's (nvidia-smi), the driver's own reserve. Public pairs of PyTorch's "total capacity" and nvidia-smi's total:
# A100 80GB 79.14 GiB of 81,920 MiB (881 MiB, 1.08%), RTX 4090 23.68 GiB of 24,564 MiB (316 MiB, 1.29%), T4
# 14.75 GiB of 15,360 MiB (256 MiB, 1.67%). The budget takes max(320 MiB, 1.1% of NVML's total), which covers each.
RUNTIME_GAP_MIN, RUNTIME_GAP_SHARE = 320 << 20, 0.011


def reserve_estimate(nvml_total: int) -> int:
    """The driver's reserve of a device, estimated from NVML's total (see RUNTIME_GAP_*) where NVML does not
    report it."""
    return max(RUNTIME_GAP_MIN, math.ceil(RUNTIME_GAP_SHARE * nvml_total))


def runtime_total(nvml_total: int) -> int:
    """The CUDA runtime's total memory of a device, estimated from NVML's."""
    return nvml_total - reserve_estimate(nvml_total)
SAMPLER_ROWS = 256  # rows of vLLM's dummy sampler run in its memory profile (its max_num_seqs default)
BYTES = {"float32": 4, "fp32": 4, "float": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2}
SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                     "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
FLOAT_TENSORS = ("F64", "F32", "F16", "BF16")  # cast to the compute dtype by vLLM; others keep their bytes


@dataclass(frozen=True)
class TeacherShape:
    """What the budget needs of a teacher: sizes from config.json, parameters from the safetensors headers."""

    hidden: int
    vocab: int  # lm_head rows (V_model)
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    float_params: int  # elements of floating-point tensors (stored in the compute dtype by vLLM)
    other_bytes: int = 0  # bytes of packed / integer tensors (quantized checkpoints), kept as stored
    config_dtype: str = "bfloat16"  # torch_dtype of config.json
    softcap: bool = False  # final_logit_softcapping: one more [rows, V] temporary

    def weight_bytes(self, compute_bytes: int) -> int:
        return self.float_params * compute_bytes + self.other_bytes

    @classmethod
    def read(cls, model_dir: str) -> "TeacherShape":
        """From a Hugging Face model directory, reading only config.json and the safetensors headers."""
        cfg = read_config(model_dir)
        text = cfg.get("text_config", cfg)
        float_params, other = 0, 0
        for path in weight_files(model_dir):
            for dtype, numel in _safetensors_header(path):
                if dtype in FLOAT_TENSORS:
                    float_params += numel
                else:
                    other += numel * SAFETENSORS_BYTES.get(dtype, 1)
        hidden, heads = int(text["hidden_size"]), int(text["num_attention_heads"])
        return cls(hidden=hidden, vocab=int(text["vocab_size"]), layers=int(text["num_hidden_layers"]),
                   heads=heads, kv_heads=int(text.get("num_key_value_heads") or heads),
                   head_dim=int(text.get("head_dim") or hidden // heads),
                   intermediate=int(text.get("intermediate_size") or 4 * hidden),
                   float_params=float_params, other_bytes=other,
                   config_dtype=str(text.get("torch_dtype") or cfg.get("torch_dtype") or text.get("dtype") or "bfloat16"),
                   softcap=bool(text.get("final_logit_softcapping")))


def _safetensors_header(path: str) -> list[tuple[str, int]]:
    """(dtype, number of elements) of every tensor of a safetensors file, from its JSON header alone."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return [(t["dtype"], math.prod(t["shape"])) for name, t in header.items() if name != "__metadata__"]


@dataclass(frozen=True)
class Run:
    """The settings of one teacher-dump that decide its device memory."""

    dtype: str = "auto"  # --dtype
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.8
    max_model_len: int = 2049
    window_len: int = 2048  # tokens per window (the first-batch check compares whole windows)
    batched_tokens: int = 8192  # vLLM's max_num_batched_tokens
    mode: str = "topk"
    k: int = 64
    fast_path: bool = True  # the teacher's lm_head on cuda:0 (False: vLLM prompt log-probs only)
    reference_check: bool = True  # the first-batch check's reference engine runs (no trusted record)

    def compute_bytes(self, shape: TeacherShape) -> int:
        """Bytes per element vLLM computes in: --dtype, or for 'auto' the checkpoint's half type
        (vLLM runs float32 checkpoints in 16 bits under 'auto')."""
        if self.dtype != "auto":
            return BYTES.get(self.dtype, 2)
        return min(2, BYTES.get(shape.config_dtype, 2))

    def head_bytes(self) -> int:
        """Bytes per lm_head element: the compute dtype's (`head.resolved_dtype`: --dtype auto is a half type on
        CUDA), float32 only under --dtype float32."""
        return 4 if self.dtype in ("float32", "fp32", "float") else 2


@dataclass(frozen=True)
class Term:
    name: str
    bytes: int


@dataclass(frozen=True)
class Budget:
    """Per-device memory terms in bytes. vLLM's `share` must hold `inside`; the rest of cuda:0 must
    hold `fixed` plus the largest of `phases` (the first-batch check's reference engine, then the
    capture: they never overlap). `total`: NVML's; share and rest split the CUDA runtime's (`usable`)."""

    total: int
    utilization: float
    inside: list[Term] = field(default_factory=list)
    fixed: list[Term] = field(default_factory=list)
    phases: dict[str, list[Term]] = field(default_factory=dict)
    reserved: int | None = None  # the driver's reserve as NVML reports it (version-2 memory info), else estimated

    @property
    def usable(self) -> int:
        """The CUDA runtime's total, which vLLM's share is a fraction of: NVML's less the driver's reserve, read
        where NVML reports it, else estimated (`runtime_total`)."""
        return self.total - self.reserved if self.reserved is not None else runtime_total(self.total)

    @property
    def share(self) -> int:
        return math.ceil(self.usable * self.utilization)

    @property
    def rest(self) -> int:
        return self.usable - self.share

    def need_inside(self) -> int:
        return sum(t.bytes for t in self.inside)

    def peak_phase(self) -> str | None:
        return max(self.phases, key=lambda p: sum(t.bytes for t in self.phases[p])) if self.phases else None

    def need_outside(self) -> int:
        peak = self.peak_phase()
        return sum(t.bytes for t in self.fixed + (self.phases[peak] if peak else []))

    def table(self) -> list[tuple[str, str, int]]:
        """(where, term, bytes) rows: vLLM's share and what it holds, the rest of cuda:0 and what
        it holds at all times and in each phase."""
        runtime = "CUDA runtime's total" + (", estimated" if self.reserved is None else "")
        rows = [("device", "NVML total", self.total), ("device", runtime, self.usable),
                ("vLLM share", "share", self.share)] + [("vLLM share", t.name, t.bytes) for t in self.inside]
        rows += [("rest of cuda:0", "rest", self.rest)] + [("rest of cuda:0", t.name, t.bytes) for t in self.fixed]
        return rows + [(f"rest of cuda:0, {p}", t.name, t.bytes) for p, terms in self.phases.items() for t in terms]


def device_budget(shape: TeacherShape, run: Run, total: int, in_use: int = 0, reserved: int | None = None) -> Budget:
    """The memory terms of `run` on a device of `total` bytes (`in_use`: held by other processes now).

    Follows capture.open_capture: the reference engine runs first with nothing of xtcache on the
    device; the lm_head moves to cuda:0 once the capture engine has started.
    """
    tp = run.tensor_parallel_size
    act = run.compute_bytes(shape)
    V, H, T = shape.vocab, shape.hidden, run.batched_tokens
    kv_tokens = -(-run.max_model_len // KV_BLOCK_TOKENS) * KV_BLOCK_TOKENS
    kv = 2 * shape.layers * max(1, shape.kv_heads // tp) * shape.head_dim * act * kv_tokens
    forward = T * (2 * H + (shape.heads + 2 * shape.kv_heads) * shape.head_dim // tp + 2 * shape.intermediate // tp) * act
    output = max(T * H * 4, min(SAMPLER_ROWS, T) * V * 4 * 2)  # pooled hidden states, or sampler logits + probs
    inside = [Term(f"weights per device at --tensor-parallel-size {tp}", -(-shape.weight_bytes(act) // tp)),
              Term("activations, estimated", forward + output),
              Term(f"KV cache of one {run.max_model_len}-token sequence", kv)]
    fixed = [Term("in use by other processes", in_use)] if in_use else []
    fixed.append(Term("vLLM worker's CUDA context", CUDA_CONTEXT_BYTES))
    phases = {}
    if not run.fast_path or run.reference_check:  # vLLM's prompt log-prob logits of one window
        rows = min(run.window_len, T)
        whole = not run.fast_path and run.mode != "topk"  # the fallback asks vLLM for every id
        per_entry = act + 4 + 1 + (12 if whole else 0)  # logits, float32 log-probs, rank mask (+ sorted ids)
        phases["reference engine" if run.fast_path else "prompt log-probs"] = [
            Term(f"vLLM's prompt log-prob logits of {rows} x V", rows * V * per_entry)]
    if run.fast_path:
        head_b = run.head_bytes()
        rows, temporaries = block_rows(V), BLOCK_TEMPORARIES.get(run.mode, 3)
        blocks = block_bytes(run.mode, V, H, head_b, reference_check=run.reference_check)
        phases["capture"] = [Term("xtcache's CUDA context", CUDA_CONTEXT_BYTES),
                             Term(f"{'float32' if head_b == 4 else 'half'} lm_head", V * H * head_b),
                             Term(f"logit blocks of {temporaries} x {rows} x V float32", blocks)]
    return Budget(total=total, utilization=run.gpu_memory_utilization, inside=inside, fixed=fixed, phases=phases,
                  reserved=reserved)


# float32 [rows, V] temporaries of one block of `distill_targets`: real, exp(real - m) and its argument;
# sampled: multinomial's 3; headtail: also the tail and its histogram
BLOCK_TEMPORARIES = {"sampled": 5, "headtail": 8}


def block_bytes(mode: str, V: int, H: int, head_bytes: int, *, reference_check: bool, rows: int | None = None) -> int:
    """Peak bytes of the capture's logit blocks beside the lm_head: `distill_targets`' temporaries plus the
    block's hidden states in the head's dtype; with the first-batch check, at least its blocks
    (capture.head_rows_logprobs: logits + one logsumexp temporary). `rows`: a block's rows when fewer than
    `block_rows(V)` (a short input)."""
    rows = block_rows(V) if rows is None else min(rows, block_rows(V))
    blocks = BLOCK_TEMPORARIES.get(mode, 3) * rows * V * 4 + rows * H * head_bytes
    if reference_check:
        blocks = max(blocks, 2 * rows * V * 4 + rows * H * head_bytes)
    return blocks


def _gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


def refusal(shape: TeacherShape, run: Run, budget: Budget) -> str | None:
    """None when `budget` fits; else one line naming the numbers and the flag to change."""
    util = run.gpu_memory_utilization
    need_in, need_out = budget.need_inside(), budget.need_outside()
    highest = math.floor((1 - need_out / budget.usable) * 100) / 100  # largest share leaving room outside
    lowest = math.ceil(need_in / budget.usable * 100) / 100  # smallest share holding vLLM's terms
    if need_in > budget.share:
        parts = " + ".join(f"{t.name} ({_gib(t.bytes)})" for t in budget.inside)
        fix = (f"raise --gpu-memory-utilization to {lowest:.2f}" if lowest <= highest else
               "raise --tensor-parallel-size (the weights are split across devices) or lower --max-model-len")
        return (f"--gpu-memory-utilization {util:g} gives vLLM {_gib(budget.share)} of cuda:0; its {parts} "
                f"need {_gib(need_in)}: {fix}")
    if need_out <= budget.rest:
        return None
    peak = budget.peak_phase()
    parts = " + ".join(f"{t.name} ({_gib(t.bytes)})" for t in budget.fixed + (budget.phases[peak] if peak else []))
    fixes = [f"lower --gpu-memory-utilization to {highest:.2f}"] if lowest <= highest else []
    if run.fast_path and run.head_bytes() == 4:  # --dtype float32: the engine and the head in 16 bits
        half = device_budget(shape, replace(run, dtype="bfloat16"), budget.total, in_use=_in_use(budget),
                             reserved=budget.reserved)
        if half.need_outside() <= half.rest:
            fixes.append("pass --dtype bfloat16 (a half-precision lm_head)")
    if not fixes:
        fixes.append("use a device with more memory or pass --no-fast-path (no lm_head on cuda:0)")
    return (f"--gpu-memory-utilization {util:g} leaves {_gib(budget.rest)} on cuda:0 outside vLLM; the {parts} "
            f"need {_gib(need_out)}: {' or '.join(fixes)}")


def _in_use(budget: Budget) -> int:
    return next((t.bytes for t in budget.fixed if t.name == "in use by other processes"), 0)


# ------------------------------------------------------------------------------ NVML (no CUDA init)


def physical_indices(count: int) -> list[int]:
    """NVML indices of the first `count` devices this process sees (CUDA_VISIBLE_DEVICES: indices or UUIDs)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return list(range(count))
    ids = [v.strip() for v in visible.split(",") if v.strip()][:count]
    if all(v.isdigit() for v in ids):
        return [int(v) for v in ids]
    nvml = _nvml()
    with _nvml_session(nvml):
        return [int(v) if v.isdigit() else nvml.nvmlDeviceGetIndex(nvml.nvmlDeviceGetHandleByUUID(v)) for v in ids]


def nvml_memory(indices: list[int]) -> list[tuple[int, int, int | None]]:
    """(total, used, reserved) bytes of each NVML device index, read without initialising CUDA. With NVML's
    version-2 memory info `reserved` is the driver's own reserve and `used` leaves it out; with version 1
    (older drivers) `reserved` is None and `used` includes it."""
    nvml = _nvml()
    with _nvml_session(nvml):
        out = []
        for i in indices:
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
            try:
                info = nvml.nvmlDeviceGetMemoryInfo(handle, version=nvml.nvmlMemory_v2)
                out.append((int(info.total), int(info.used), int(info.reserved)))
            except (AttributeError, TypeError, nvml.NVMLError):
                info = nvml.nvmlDeviceGetMemoryInfo(handle)
                out.append((int(info.total), int(info.used), None))
        return out


def _nvml():
    """NVIDIA's NVML bindings: vLLM's own copy of nvidia-ml-py where vLLM imports, else nvidia-ml-py itself
    (a bare PyTorch GPU machine: bench/gpu_check.py)."""
    try:
        from vllm.utils.import_utils import import_pynvml
    except ImportError:
        import pynvml

        return pynvml
    return import_pynvml()


class _nvml_session:
    def __init__(self, nvml):
        self.nvml = nvml

    def __enter__(self):
        self.nvml.nvmlInit()

    def __exit__(self, *exc):
        self.nvml.nvmlShutdown()


def device_memory_used(count: int) -> list[int] | None:
    """Used bytes of the first `count` visible CUDA devices (NVML); None off CUDA or without NVML (logged)."""
    if not devices.cuda_present():
        return None
    try:
        return [used for _, used, _ in nvml_memory(physical_indices(count))]
    except Exception as e:  # no NVML library or driver
        log.warning("FALLBACK: not waiting for the reference engine's memory, NVML unavailable (%s)", e)
        return None


RELEASE_TIMEOUT_S = 120.0  # an engine shut down normally frees its memory within seconds
RELEASE_MARGIN = 256 << 20  # bytes above the level before the reference engine that count as released
RELEASE_POLL_S = 0.5


def wait_for_release(before: list[int] | None, probe, *, timeout_s: float = RELEASE_TIMEOUT_S,
                     margin: int = RELEASE_MARGIN, poll_s: float = RELEASE_POLL_S,
                     sleep=time.sleep, clock=time.monotonic) -> float:
    """Wait until every device's used memory (`probe()`, bytes per device) is back within `margin` of
    `before` (taken before the reference engine started); returns the seconds waited.

    CaptureError after `timeout_s` naming the device and how much is still held. `before` None
    (not on CUDA): returns at once.
    """
    if before is None:
        return 0.0
    start = clock()
    while True:
        used = probe()
        held = [(i, u - b) for i, (u, b) in enumerate(zip(used, before)) if u - b > margin]
        if not held:
            return clock() - start
        if clock() - start >= timeout_s:
            i, extra = max(held, key=lambda h: h[1])
            raise CaptureError(
                f"cuda:{i} still holds {_gib(extra)} more than before the first-batch check's reference engine "
                f"started ({_gib(used[i])} used, {_gib(before[i])} before) after {timeout_s:.0f} s: its processes "
                "did not exit, or another process took the memory; free the device (nvidia-smi) and rerun "
                "(--trust-check-from a store with a passed check skips the reference engine)")
        sleep(poll_s)


def main(argv: list[str]) -> None:
    """Print the budget of a teacher at the default settings on one device of `argv[1]` GiB."""
    if len(argv) != 2:
        raise SystemExit("usage: python -m stage1_teacher.capture.budget TEACHER_DIR DEVICE_GIB")
    shape = TeacherShape.read(argv[0])
    budget = device_budget(shape, Run(), int(float(argv[1]) * GiB))
    for where, name, n in budget.table():
        print(f"{where:26s} {name:48s} {n / GiB:8.2f} GiB")
    print(refusal(shape, Run(), budget) or "fits")


if __name__ == "__main__":
    main(sys.argv[1:])
