"""Asking whether a CUDA device is there without initialising CUDA in this process.

vLLM starts its engine's workers by forking this process unless CUDA is already initialised here.
A plain `torch.cuda.is_available()` calls `cuInit` through the CUDA runtime: torch does not count
that as "initialised", so vLLM still forks, and every forked worker then fails on its first CUDA
call. With `PYTORCH_NVML_BASED_CUDA_CHECK=1` torch answers through NVML instead and leaves the
driver alone (vLLM sets the same variable when it is imported; xtcache may ask before that).

Every place in xtcache that decides between the CPU and a CUDA device asks `cuda_present()`;
nothing touches a CUDA device before the capture engine has started (tests/test_gpu_discipline.py
guards the order).

    python -m xtcache.devices        # prints what cuda_present() sees
"""

from __future__ import annotations

import os

NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"


def cuda_present() -> bool:
    """True when torch can see a CUDA device, asked through NVML (CUDA stays uninitialised)."""
    os.environ[NVML_CHECK] = "1"
    import torch

    return torch.cuda.is_available()


def compute_device(index: int = 0):
    """cuda:<index> when a CUDA device is present, else the CPU (nothing is initialised)."""
    import torch

    return torch.device("cuda", index) if cuda_present() else torch.device("cpu")


if __name__ == "__main__":
    print(f"cuda_present() = {cuda_present()}; compute device: {compute_device()}")
