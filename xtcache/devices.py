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

from xtcache.errors import ConfigError

NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"


def cuda_present() -> bool:
    """True when torch can see a CUDA device, asked through NVML (CUDA stays uninitialised)."""
    os.environ[NVML_CHECK] = "1"
    import torch

    return torch.cuda.is_available()


def cuda_device_count() -> int:
    """The CUDA devices torch can see (CUDA_VISIBLE_DEVICES applies), counted through NVML: 0 without CUDA."""
    return _nvml_count() if cuda_present() else 0


def compute_device(index: int = 0):
    """cuda:<index> when a CUDA device is present, else the CPU (nothing is initialised)."""
    import torch

    return torch.device("cuda", index) if cuda_present() else torch.device("cpu")


def job_devices(tensor_parallel_size: int, env=None, device_count=None) -> str | None:
    """CUDA_VISIBLE_DEVICES for one of several jobs a launcher started on one node, or None.

    torchrun (and the deepspeed launcher) start LOCAL_WORLD_SIZE processes per node and tell each
    its LOCAL_RANK, but every process sees every GPU, and vLLM places its workers on the first
    `tensor_parallel_size` visible devices: without this all jobs of a node would share GPU 0.
    Job LOCAL_RANK takes devices [LOCAL_RANK x TP, (LOCAL_RANK + 1) x TP) of those visible (an
    existing CUDA_VISIBLE_DEVICES list is sliced). One job per node, or no launcher: None (the
    job keeps every visible device). Too few devices for the node's jobs: ConfigError.
    """
    env = os.environ if env is None else env
    local_world = int(env.get("LOCAL_WORLD_SIZE") or 1)
    if "LOCAL_RANK" not in env or local_world <= 1:
        return None
    rank = int(env["LOCAL_RANK"])
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() == "":
        return None  # every device hidden on purpose: the job runs on the CPU
    devices = visible.split(",") if visible else [str(i) for i in range((device_count or _nvml_count)())]
    need = local_world * tensor_parallel_size
    if len(devices) < need:
        raise ConfigError(f"{local_world} jobs on this node (LOCAL_WORLD_SIZE) x --tensor-parallel-size "
                          f"{tensor_parallel_size} need {need} GPUs, and {len(devices)} are visible: start fewer "
                          "jobs per node (--nproc-per-node) or lower --tensor-parallel-size")
    return ",".join(devices[rank * tensor_parallel_size:(rank + 1) * tensor_parallel_size])


def _nvml_count() -> int:
    os.environ[NVML_CHECK] = "1"
    import torch

    return torch.cuda.device_count()


if __name__ == "__main__":
    print(f"cuda_present() = {cuda_present()}; compute device: {compute_device()}")
