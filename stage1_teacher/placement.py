"""Where a stage 1 job (`xtcache teacher-dump`, `xtcache generate`) runs: its GPUs under a multi-job
launcher, and its torch threads beside vLLM's CPU worker.

    python -c "from stage1_teacher.placement import place_job, share_cpu_with_vllm"
"""

from __future__ import annotations

import logging
import os

from xtcache import devices
from xtcache.devices import job_devices

log = logging.getLogger(__name__)


def place_job(tensor_parallel_size: int) -> None:
    """Under a launcher that starts several jobs per node, give this job its own GPUs, as many as its
    engine's `tensor_parallel_size` (before anything asks CUDA a question: the engine's workers, and
    the HF engine's model, inherit CUDA_VISIBLE_DEVICES)."""
    if not devices.cuda_present():
        return
    visible = job_devices(tensor_parallel_size)
    if visible is not None:
        log.info("job with LOCAL_RANK %s of %s on this node: CUDA_VISIBLE_DEVICES=%s", os.environ["LOCAL_RANK"],
                 os.environ["LOCAL_WORLD_SIZE"], visible)
        os.environ["CUDA_VISIBLE_DEVICES"] = visible


def share_cpu_with_vllm(cfg):
    """On a CPU host whose vLLM worker runs in a process of its own, use one torch thread while that
    worker holds the other cores.

    vLLM's CPU worker binds its OpenMP threads to all cores but the reserved one; two OpenMP
    teams contending for the same cores made our lm_head/top-k 4x slower (measured on 2 cores:
    10k vs 40k rows/s). An engine in this process (xtcache's default on a CPU host,
    `engine_in_process`) shares this process's threads, one call after the other: nothing to
    change. Returns the function that restores the previous setting.
    """
    import torch

    from stage1_teacher.capture.vllm_engine import engine_in_process

    if (cfg.teacher.engine != "vllm" or devices.cuda_present()
            or engine_in_process(cfg.teacher.tensor_parallel_size)):
        return lambda: None
    before = torch.get_num_threads()
    reserved = int(os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU") or 1)
    torch.set_num_threads(max(1, min(before, reserved)))
    return lambda: torch.set_num_threads(before)
