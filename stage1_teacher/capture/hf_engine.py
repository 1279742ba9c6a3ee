"""Hugging Face transformers capture engine for `xtcache teacher-dump --engine hf`.

Runs the teacher with `AutoModelForCausalLM` (safetensors only, no remote code) on the CUDA device
when there is one, else on the CPU, and returns each window's logits; `stage1_teacher.capture.head` turns
them into the same top-k / full / sampled targets as the vLLM path. Windows are batched by
similar length and right-padded (with causal attention the padding never changes the real
positions' logits), at most `batch_tokens` padded tokens a forward, and the caller hears of each
forward's windows as it returns. Useful where vLLM is not installed, for architectures vLLM lacks,
and as the reference the vLLM path is tested against.

    python -c "from stage1_teacher.capture.hf_engine import HfEngine; HfEngine('teacher_dir')"
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence

import numpy as np

from stage1_teacher.capture.head import weight_files
from xtcache.devices import compute_device
from xtcache.errors import CaptureError

log = logging.getLogger(__name__)

# Padded tokens a forward takes at most: the forward's logits are [8192, V] (1.6 GB in fp32 for
# SmolLM2's 49k ids), and the caller hears of its windows when it returns. On SmolLM2-135M on a
# shared 2-core CPU (8.5k tokens, 2048-token windows, two rounds, 2026-11-28): 72 and 141 tokens/s
# in forwards of 8192 tokens, 48 and 76 in one forward of the whole batch.
FORWARD_TOKENS = 8192

DTYPES = {"auto": None, "float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16", "half": "float16"}


class HfEngine:
    """Logits [L, V_model] per window from a transformers forward (no grad, eval mode)."""

    name = "hf"
    produces = "logits"

    def __init__(self, model_dir: str, *, dtype: str = "auto", batch_tokens: int = FORWARD_TOKENS):
        import torch
        from transformers import AutoModelForCausalLM

        weight_files(model_dir)  # refuse teachers without safetensors before loading anything
        if dtype not in DTYPES:
            raise CaptureError(f"--dtype {dtype}: use one of {', '.join(DTYPES)}")

        self.device = compute_device()
        torch_dtype = getattr(torch, DTYPES[dtype]) if DTYPES[dtype] else torch.float32
        log.info("loading %s with transformers on %s (%s)", model_dir, self.device, torch_dtype)
        self.model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch_dtype, trust_remote_code=False, use_safetensors=True).to(self.device).eval()
        self.batch_tokens = batch_tokens

    def run(self, windows: list[np.ndarray], done: Callable[[Sequence[int], list], None] | None = None) -> list:
        """Logits of each window, in order; after each forward `done(indices, logits)` of the windows it ran."""
        import torch

        out: list = [None] * len(windows)
        order = sorted(range(len(windows)), key=lambda i: -len(windows[i]))
        i = 0
        with torch.inference_mode():
            while i < len(order):
                longest = len(windows[order[i]])
                n = max(1, self.batch_tokens // max(1, longest))
                group = order[i:i + n]
                ids = torch.zeros((len(group), longest), dtype=torch.long)
                mask = torch.zeros((len(group), longest), dtype=torch.long)
                for row, j in enumerate(group):
                    w = torch.as_tensor(windows[j], dtype=torch.long)
                    ids[row, :len(w)] = w
                    mask[row, :len(w)] = 1
                logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)).logits
                for row, j in enumerate(group):
                    out[j] = logits[row, :len(windows[j])].float()
                if done is not None:
                    done(group, [out[j] for j in group])
                i += n
        return out

    def close(self) -> None:
        self.model = None
