"""vLLM capture engines for `xtcache teacher-dump`.

Two engines, both fed pre-tokenized windows (`{"prompt_token_ids": ids}`, no detokenization):

* `VllmHiddenEngine` (the fast, exact path): vLLM's pooling runner returns the final hidden states
  of every position (`token_embed` task, `ALL` pooling, no activation); `stage1_teacher.capture.head`
  multiplies them by the teacher's own lm_head on the device and derives exact top-k, full-vocab
  or sampled targets from the full logits.
* `VllmPromptLogprobEngine` (the reference and the fallback): vLLM's prompt log-probs with
  `flat_logprobs=True`, `detokenize=False` and `max_logprobs` sized to k. vLLM reports the
  realized prompt token at every position even outside the top-k, so the realized log-prob is
  kept. `k = -1` asks for the whole vocabulary (full and sampled modes on the fallback path).

On a CPU build vLLM needs `VLLM_CPU_KVCACHE_SPACE` (set here to 1 GiB only when not on CUDA and
not already set) and a `gpu_memory_utilization` around 0.3 (the fraction of host memory it
reserves). There the engine runs inside this process (`engine_in_process`). On CUDA vLLM starts
its engine core and worker processes, so scripts that use these engines need the
`if __name__ == "__main__":` guard. `close()` shuts the engine's processes down; if this process
dies first (even by SIGKILL), `xtcache.reaper` stops them.

vLLM returns a call's outputs only when all of them are done, so `run(windows, done)` cuts a batch
into calls of a few seconds each (`progress.CallPacer`) and hands each call's outputs to `done` as
it returns; an engine that runs a whole batch within that time gets it in one call.

    python -m stage1_teacher.capture.vllm_engine TEACHER_DIR   # starts both engines once and compares them
"""

from __future__ import annotations

import gc
import logging
import os
import sys
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from stage1_teacher.capture.head import TeacherHead, resolved_dtype
from stage1_teacher.capture.progress import CallPacer
from xtcache import devices
from xtcache.devices import compute_device
from xtcache.errors import CaptureError
from xtcache.reaper import guard_children

log = logging.getLogger(__name__)


def on_cuda() -> bool:
    """A CUDA device is there (asked through NVML: nothing is initialised before the engine forks)."""
    return devices.cuda_present()


def resolved_eager(enforce_eager: bool | None) -> bool:
    """--enforce-eager as the engine runs it: the flag, else eager on CPU and compiled on CUDA."""
    return enforce_eager if enforce_eager is not None else not on_cuda()


def platform_name() -> str:
    """'cpu', or 'cuda:' + device 0's product name read through NVML (CUDA stays uninitialised)."""
    from vllm.platforms import current_platform as p

    kind = str(p.device_type or "unknown")
    if kind == "cuda" and type(p).__name__ == "NvmlCudaPlatform":
        return f"cuda:{p.get_device_name(0)}"
    return kind


def engine_in_process(tensor_parallel_size: int = 1) -> bool:
    """Whether vLLM's engine runs inside this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, which
    `VllmOptions.llm_kwargs` sets where this holds and the variable is unset; a value set wins).

    xtcache's choice on a CPU host with one worker: there vLLM's own process model (an engine core
    and a worker process, each importing vLLM and torch, the worker's threads bound to all cores but
    one) cost a toy teacher-dump more than twice its wall time on 2 cores, mostly in engine starts
    (`bench/engine_process.py`, docs/troubleshooting.md). On CUDA, or with several workers, vLLM's
    processes stay."""
    value = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "").strip()
    if value:
        return value == "0"
    return tensor_parallel_size == 1 and not on_cuda()


def _quiet_thread_setting() -> None:
    """Drop vLLM's CPU worker warning that it skipped a `torch.set_num_threads` call. In this process the
    worker makes the call a no-op (the dump's torch threads stay as they are) and vLLM's own start makes
    several: a screenful of warnings about nothing the user set."""
    worker_log = logging.getLogger("vllm.v1.worker.cpu_worker")
    if not any(isinstance(f, _SkippedThreadSetting) for f in worker_log.filters):
        worker_log.addFilter(_SkippedThreadSetting())


class _SkippedThreadSetting(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "torch.set_num_threads" not in record.getMessage()


def requested_model_runner() -> str:
    """The model runner the engines run: 'v1' unless VLLM_USE_V2_MODEL_RUNNER asks for 'v2' ('auto': empty).

    xtcache pins vLLM's V1 model runner (`VllmOptions.llm_kwargs` sets VLLM_USE_V2_MODEL_RUNNER=0 where
    it is unset): the capture, its first-batch check and generate are proven on it; on the CPU build V2
    cannot start (it requires Triton), and on CUDA vLLM would otherwise pick V2 by itself."""
    value = os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "0").strip().lower()
    if value in ("1", "true"):
        return "v2"
    return "v1" if value in ("0", "false") else "auto"


@dataclass(frozen=True)
class VllmOptions:
    """Engine arguments passed through to `vllm.LLM` (None: vLLM's default or xtcache's CPU default)."""

    model: str
    tensor_parallel_size: int = 1
    dtype: str = "auto"
    gpu_memory_utilization: float | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    enforce_eager: bool | None = None
    seed: int = 0

    def llm_kwargs(self) -> dict:
        cuda = on_cuda()
        if not cuda:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")  # the runner xtcache is proven on (requested_model_runner)
        if engine_in_process(self.tensor_parallel_size):
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
            _quiet_thread_setting()
        util = self.gpu_memory_utilization
        if util is None:
            util = 0.8 if cuda else 0.3
        kw = dict(model=self.model, tokenizer=self.model, tensor_parallel_size=self.tensor_parallel_size,
                  dtype=self.dtype, gpu_memory_utilization=util, seed=self.seed, enable_prefix_caching=False,
                  trust_remote_code=False, enforce_eager=resolved_eager(self.enforce_eager))
        if self.max_model_len is not None:
            kw["max_model_len"] = self.max_model_len
        if self.max_num_batched_tokens is not None:
            kw["max_num_batched_tokens"] = self.max_num_batched_tokens
        return kw


def vllm_options(cfg, max_model_len: int) -> VllmOptions:
    """The engine options of a `teacher-dump` config (its teacher and capture settings)."""
    t = cfg.teacher
    return VllmOptions(model=t.teacher, tensor_parallel_size=t.tensor_parallel_size,
                       dtype=resolved_dtype(t.teacher, t.dtype),
                       gpu_memory_utilization=t.gpu_memory_utilization, max_model_len=max_model_len,
                       max_num_batched_tokens=t.max_num_batched_tokens or max(8192, max_model_len),
                       enforce_eager=t.enforce_eager, seed=cfg.capture.seed)


class _VllmEngine:
    """Common start/close of one `vllm.LLM`."""

    name = "vllm"

    def __init__(self, options: VllmOptions, **extra):
        from vllm import LLM

        kw = options.llm_kwargs()
        kw.update(extra)
        log.info("starting vLLM (%s) for %s, its engine %s", self.name, options.model,
                 "in this process" if engine_in_process(options.tensor_parallel_size) else "in processes of its own")
        with guard_children():  # a killed dump must not leave its engine holding the device
            self.llm = LLM(**kw)
        self.options = options
        self.pacer = CallPacer()

    def run(self, windows: list[np.ndarray], done: Callable[[Sequence[int], list], None] | None = None) -> list:
        """The outputs of each window, in order: in one call, or with `done`, in paced calls, each
        followed by `done(indices, outputs)` of its windows."""
        if done is None:
            return self.call(windows)
        return self.pacer.run(windows, self.call, done)

    def call(self, windows: list[np.ndarray]) -> list:
        raise NotImplementedError

    def model_runner(self) -> str:
        """'v1' or 'v2': the model runner this engine's workers use."""
        return "v2" if self.llm.llm_engine.vllm_config.use_v2_model_runner else "v1"

    def close(self) -> None:
        """Shut the engine's processes down (idempotent)."""
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        self.llm = None
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception as e:  # a dead engine has nothing left to shut down
            log.debug("vLLM shutdown: %s", e)
        del llm
        gc.collect()
        import torch

        if torch.cuda.is_initialized():  # the head or a check's logits may hold cached blocks
            torch.cuda.empty_cache()


class VllmHiddenEngine(_VllmEngine):
    """Final hidden states [T, H] of every window position from vLLM's pooling runner."""

    name = "vllm-hidden"
    produces = "hidden"

    def __init__(self, options: VllmOptions):
        from vllm.config import PoolerConfig

        # head_dtype "model": the pooler hands the hidden states over in the model's dtype (vLLM's
        # default casts them to fp32: twice the bytes through the engine's transport for a bf16
        # teacher, and no information, since the model computed them in its dtype)
        super().__init__(options, runner="pooling", hf_overrides={"head_dtype": "model"}, pooler_config=PoolerConfig(
            task="token_embed", tok_pooling_type="ALL", use_activation=False))

    def call(self, windows: list[np.ndarray]) -> list:
        prompts = [{"prompt_token_ids": w.tolist()} for w in windows]
        outs = self.llm.encode(prompts, pooling_task="token_embed", use_tqdm=False)
        result = []
        for w, o in zip(windows, outs):
            data = o.outputs.data
            if data.shape[0] != len(w):
                raise CaptureError(f"vLLM pooling returned {data.shape[0]} hidden states for a window of "
                                   f"{len(w)} tokens; the pooling runner must return every position")
            result.append(data)
        return result


@dataclass
class PromptLogprobs:
    """Prompt log-probs of one window: rows predict tokens 1..L-1."""

    ids: np.ndarray  # int64 [L-1, k] top-k ids (model columns)
    logprobs: np.ndarray  # float32 [L-1, k]
    realized: np.ndarray  # float32 [L-1]


class VllmPromptLogprobEngine(_VllmEngine):
    """Top-`k` prompt log-probs (k = -1: whole vocabulary) plus the realized token's log-prob."""

    name = "vllm-prompt-logprobs"
    produces = "logprobs"

    def __init__(self, options: VllmOptions, k: int):
        super().__init__(options, max_logprobs=k if k > 0 else -1)
        self.k = k

    def call(self, windows: list[np.ndarray]) -> list[PromptLogprobs]:
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, prompt_logprobs=self.k, flat_logprobs=True, detokenize=False,
                                temperature=1.0)
        prompts = [{"prompt_token_ids": w.tolist()} for w in windows]
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        return [parse_flat(o.prompt_logprobs, len(w)) for w, o in zip(windows, outs)]


def parse_flat(flat, n_tokens: int) -> PromptLogprobs:
    """Vectorized view of vLLM's FlatLogprobs: position p>0 holds [realized, top1..topk] entries."""
    starts = np.asarray(flat.start_indices[1:], dtype=np.int64)
    ends = np.asarray(flat.end_indices[1:], dtype=np.int64)
    if len(starts) != n_tokens - 1:
        raise CaptureError(f"vLLM returned prompt log-probs for {len(starts) + 1} positions of a "
                           f"{n_tokens}-token window")
    width = int(ends[0] - starts[0]) if len(starts) else 1
    if len(starts) and not np.all(ends - starts == width):
        raise AssertionError("vLLM prompt log-probs have a varying number of entries per position")
    tok = np.asarray(flat.token_ids[int(starts[0]) if len(starts) else 0:], dtype=np.int64)
    lp = np.asarray(flat.logprobs[int(starts[0]) if len(starts) else 0:], dtype=np.float32)
    tok = tok.reshape(-1, width)
    lp = lp.reshape(-1, width)
    return PromptLogprobs(ids=tok[:, 1:], logprobs=lp[:, 1:], realized=lp[:, 0].copy())


def main(argv: list[str]) -> None:
    """Start both engines on a teacher and print the largest log-prob gap on a few windows."""
    import json

    import torch
    from transformers import AutoTokenizer

    logging.basicConfig(level=logging.INFO)
    model = argv[0]
    tok = AutoTokenizer.from_pretrained(model)
    texts = ["def main(argv):\n    return 0\n", json.dumps({"a": [1, 2, 3]})]
    windows = [np.asarray(tok(t)["input_ids"], dtype=np.int64) for t in texts]
    ref = VllmPromptLogprobEngine(VllmOptions(model=model, dtype="float32"), 8)
    try:
        want = ref.run(windows)
    finally:
        ref.close()
    fast = VllmHiddenEngine(VllmOptions(model=model, dtype="float32"))
    try:
        hidden = fast.run(windows)
    finally:
        fast.close()

    head = TeacherHead.load(model, "cpu").to(compute_device())
    for w, h, r in zip(windows, hidden, want):
        lp = torch.log_softmax(head.logits(h), -1)[:-1].cpu().numpy()
        got = np.take_along_axis(lp, r.ids, 1)
        print(f"window of {len(w)} tokens: max |fast - reference| = {np.abs(got - r.logprobs).max():.2e}")


if __name__ == "__main__":
    main(sys.argv[1:])
