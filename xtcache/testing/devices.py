"""Fake accelerator devices on a CPU-only torch: tests that prove device discipline without a GPU.

Inside `fake_cuda()` (or `fake_accelerator()`) tensors are `FakeTensor`s: they carry shape, dtype
and device but no data, and every operation whose tensor inputs sit on two devices raises
`FakeTensorDeviceMismatchError` (a 0-dim CPU tensor is allowed beside a device tensor, as on real
CUDA). Real CPU tensors created outside the mode may enter it (the host side of a batch); an
operation that mixes one of them with a device tensor fails the same way. Reading a value back
(`.item()`, a boolean mask, `nonzero`) raises too, so a call that passes also proves it never
syncs with the device.

    with fake_cuda() as mode:              # forward only: cuda:0
        head = to_fake(head, FAKE_CUDA)
        logits = head(hidden.to(FAKE_CUDA))

    with fake_accelerator():               # forward and backward: the meta device
        model = to_fake(model, FAKE_ACCELERATOR)
        loss = objective(model(...), batch.to(FAKE_ACCELERATOR)); loss.backward()

Host-side work that reads CPU tensor values (numpy planning) runs under `on_host()`, which
suspends the mode; a CPU tensor made there is real and enters the mode again as host data.

Two devices because autograd on a fake `cuda` tensor asks the CUDA device guard for a stream,
which a CPU-only build does not have: the process aborts (a C++ terminate, not an exception).
Some other operations need the CUDA runtime even on fake tensors (advanced indexing
`z[rows, cols]` raises "not linked with support for cuda devices"). So `fake_cuda()` disables
autograd and suits simple forward code (a matmul, a gather); `fake_accelerator()` runs the same
checks on the `meta` device, whose guard exists on every build, so backward works. Sparse x dense
matmuls have no meta kernel at all: a test replaces `torch.sparse.mm` with a device-checking
stand-in (tests/test_device_stage2.py). Use an indexed device
(`FAKE_CUDA`, never the string "cuda"): `.to("cuda")` resolves the current CUDA device and fails.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch._subclasses.fake_tensor import (  # noqa: PLC2701 (torch has no public name for them)
    FakeTensorDeviceMismatchError,
    FakeTensorMode,
    unset_fake_temporarily,
)

__all__ = ["FAKE_ACCELERATOR", "FAKE_CUDA", "FakeTensorDeviceMismatchError", "fake_accelerator",
           "fake_cuda", "on_host", "to_fake"]

FAKE_CUDA = torch.device("cuda", 0)
FAKE_ACCELERATOR = torch.device("meta")


@contextmanager
def fake_cuda() -> Iterator[FakeTensorMode]:
    """Fake-tensor mode for forward-only work on `FAKE_CUDA` (autograd off: see the module doc)."""
    with FakeTensorMode(allow_non_fake_inputs=True) as mode, torch.no_grad():
        yield mode


@contextmanager
def fake_accelerator() -> Iterator[FakeTensorMode]:
    """Fake-tensor mode for forward and backward on `FAKE_ACCELERATOR` (the meta device)."""
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        yield mode


@contextmanager
def on_host() -> Iterator[None]:
    """Suspend the fake mode: host work (numpy planning on CPU tensors) inside a fake-device test,
    as the real code does it on the CPU while the device runs."""
    with unset_fake_temporarily():
        yield


def to_fake(obj, device: torch.device):
    """Place a module (in place; its parameters and buffers) or a tensor on a fake `device`.

    Call inside `fake_cuda()`/`fake_accelerator()`. Parameters keep `requires_grad`; values are
    not copied (fake tensors hold none). Returns the module, or the new tensor.
    """
    if isinstance(obj, torch.Tensor):
        return _fake_like(obj, device)
    if not isinstance(obj, torch.nn.Module):
        raise TypeError(f"to_fake: expected a torch.nn.Module or a Tensor, got {type(obj).__name__}")
    for module in obj.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            fake = torch.nn.Parameter(_fake_like(param, device), requires_grad=param.requires_grad)
            setattr(module, name, fake)
        for name, buf in list(module.named_buffers(recurse=False)):
            module._buffers[name] = _fake_like(buf, device)
    return obj


def _fake_like(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    # a fresh fake tensor with t's shape, strides and dtype on `device` (no data is copied)
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
