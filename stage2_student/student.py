"""The student side of a stage 2 process: its process group, tokenizer, model and forward inputs.

Called by `stage2_student.trainer`; nothing here knows about the cache or the loss.
"""

from __future__ import annotations

import importlib
import os
import socket
from pathlib import Path

from xtcache.errors import ConfigError
from xtcache.tokenizer import load_tokenizer as load


def setup_distributed() -> tuple[int, int, int]:
    """Start (or join) the process group; returns (rank, local rank, world size).

    Plain `python`/`xtcache` runs get single-process defaults for the env variables
    `deepspeed.init_distributed()` reads (it would otherwise look for MPI). The CPU shared-memory
    communication op is never built: training does not use it and it costs a JIT compile.
    """
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    import deepspeed

    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("LOCAL_RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        # a free port for this single-process group, taken just before the group binds it (after the
        # seconds-long deepspeed import): another job on the machine could take it in between
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            os.environ.setdefault("MASTER_PORT", str(sock.getsockname()[1]))
    os.environ["LOCAL_RANK"] = str(local_rank(os.environ))
    deepspeed.init_distributed()
    import torch.distributed as dist

    # this rank's GPU before anything lands on "the" device (a no-op on CPU)
    deepspeed.get_accelerator().set_device(int(os.environ["LOCAL_RANK"]))
    return dist.get_rank(), int(os.environ["LOCAL_RANK"]), dist.get_world_size()


def local_rank(env) -> int:
    """This process's device index on its node, from the launcher's environment `env`.

    torchrun and deepspeed set LOCAL_RANK; without it, a one-process job is 0 and LOCAL_WORLD_SIZE
    (ranks per node, node-contiguous as torchrun numbers them) gives RANK % LOCAL_WORLD_SIZE. The
    global RANK alone is never taken for it: on a second node it names a GPU that does not exist.
    """
    if "LOCAL_RANK" in env:
        return int(env["LOCAL_RANK"])
    if int(env.get("WORLD_SIZE", "1")) == 1:
        return 0
    if "LOCAL_WORLD_SIZE" in env:
        return int(env["RANK"]) % int(env["LOCAL_WORLD_SIZE"])
    raise ConfigError(f"RANK={env.get('RANK')} WORLD_SIZE={env['WORLD_SIZE']} are set but LOCAL_RANK is not, so this "
                      "process cannot tell which GPU of its node is its own: launch with torchrun or deepspeed, or "
                      "set LOCAL_RANK (or LOCAL_WORLD_SIZE) for every process")


def set_deterministic(on: bool) -> None:
    """--deterministic: deterministic algorithms everywhere (what bit-identical resume needs on a GPU).

    Call before CUDA starts: cuBLAS reads CUBLAS_WORKSPACE_CONFIG when it creates its handle. An
    operation without a deterministic implementation then raises instead of running.
    """
    if not on:
        return
    if os.environ.get("CUBLAS_WORKSPACE_CONFIG") not in (":4096:8", ":16:8"):
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    import torch

    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def teardown_distributed() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def load_tokenizer(path: str | Path):
    """The student tokenizer exactly as stage 1 loaded it (see `xtcache.tokenizer`)."""
    return load(path, "student tokenizer")


def load_student(model_dir: str, ds_config: dict):
    """The student in fp32; under ZeRO-3 built inside deepspeed.zero.Init, so that each rank
    allocates only its partition, never the whole model."""
    import torch
    from transformers import AutoModelForCausalLM

    if ds_config["zero_optimization"]["stage"] != 3:
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    hf_zero3 = HfDeepSpeedConfig(ds_config)  # noqa: F841  (process-global while it lives)
    try:
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    finally:  # later from_pretrained/from_config calls in this process must not partition
        del hf_zero3
        unset_hf_deepspeed_config()


def count_parameters(model_dir: str) -> int:
    """Parameters of the student, counted on the meta device (no memory, no weights read)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    return sum(p.numel() for p in model.parameters())


def model_inputs(batch: dict) -> dict:
    """The student's forward arguments for a packed micro-batch.

    Each document packed into a window attends to itself only, as the teacher saw it: the
    position ids restart at 0 for every document (and for the padding after the last one), and
    with no 2D attention mask and no KV cache, transformers turns such position ids into a
    block-diagonal causal mask (sdpa, eager, flex) or variable-length flash attention.
    """
    if "position_ids" not in batch:
        return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    # use_cache=False: transformers only reads packed position ids when no KV cache is passed
    return {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"], "use_cache": False}


def to_device(batch: dict, device) -> dict:
    import torch

    return {k: (v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}


def dummy_batch(tokenizer) -> dict:
    """Two pad tokens and no labels: the forward a rank without held-out data runs in lockstep."""
    import torch

    ids = torch.full((1, 2), tokenizer.pad_token_id or 0, dtype=torch.long)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.full_like(ids, -100),
            "num_chunks": 0}
