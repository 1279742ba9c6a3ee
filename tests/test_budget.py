"""The device memory budget of teacher-dump (stage1_teacher/capture/budget.py) on realistic teachers and cards.

Every expected number is written out here from the teachers' published configs (a second
construction), not taken from the function under test. No GPU: NVML and CUDA are faked.
"""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest

from stage1_teacher.capture import budget as b
from stage1_teacher.capture.budget import Run, TeacherShape, device_budget, refusal
from xtcache.errors import CaptureError, ConfigError

MiB, GiB = 1 << 20, 1 << 30
H100 = 81559 * MiB  # NVML total of an H100 80GB
RTX4090 = 24564 * MiB  # NVML total of a 24 GB card
CTX = GiB // 2  # the assumed CUDA context of one process


def usable(nvml_total: int) -> int:
    """The CUDA runtime's total that vLLM's share is a fraction of: NVML's less max(320 MiB, 1.1%) (budget.py's
    public pairs: 881 MiB of an A100 80GB's 81,920, 316 of a 24 GB card's 24,564, 256 of a T4's 15,360)."""
    return nvml_total - max(320 * MiB, math.ceil(0.011 * nvml_total))

LLAMA3_70B = TeacherShape(hidden=8192, vocab=128256, layers=80, heads=64, kv_heads=8, head_dim=128,
                          intermediate=28672, float_params=70_553_706_496)
LLAMA3_8B = TeacherShape(hidden=4096, vocab=128256, layers=32, heads=32, kv_heads=8, head_dim=128,
                         intermediate=14336, float_params=8_030_261_248)
QWEN25_7B = TeacherShape(hidden=3584, vocab=152064, layers=28, heads=28, kv_heads=4, head_dim=128,
                         intermediate=18944, float_params=7_615_616_512)
QWEN25_72B = TeacherShape(hidden=8192, vocab=152064, layers=80, heads=64, kv_heads=8, head_dim=128,
                          intermediate=29568, float_params=72_706_203_648)


def test_llama3_70b_on_8x80gb_fits_at_the_default():
    run = Run(tensor_parallel_size=8)
    got = device_budget(LLAMA3_70B, run, H100)
    share = math.ceil(0.8 * usable(H100))
    weights = 70_553_706_496 * 2 // 8  # bf16, split 8 ways: 16.4 GiB per device
    kv = 2 * 80 * 1 * 128 * 2 * 2064  # K and V, 80 layers, one KV head per device, 2049 tokens -> 129 blocks of 16
    act = 8192 * (2 * 8192 + (64 + 16) * 128 // 8 + 2 * 28672 // 8) * 2 + 8192 * 8192 * 4
    assert got.share == share
    assert [t.bytes for t in got.inside] == [weights, act, kv]
    head = 128256 * 8192 * 2  # --dtype auto on CUDA: a bf16 lm_head, 2.0 GiB
    blocks = 3 * 1024 * 128256 * 4 + 1024 * 8192 * 2  # 1024 rows (2^27 // 128256 = 1046, capped)
    assert got.need_outside() == CTX + CTX + head + blocks
    assert got.need_outside() < 5 * GiB < got.rest == usable(H100) - share
    assert refusal(LLAMA3_70B, run, got) is None


def test_llama3_70b_on_one_80gb_card_is_refused_with_tensor_parallelism_as_the_fix():
    run = Run()
    msg = refusal(LLAMA3_70B, run, device_budget(LLAMA3_70B, run, H100))
    assert msg.startswith(f"--gpu-memory-utilization 0.8 gives vLLM {math.ceil(0.8 * usable(H100)) / GiB:.1f} GiB "
                          "of cuda:0")  # 63.0 GiB
    assert "weights per device at --tensor-parallel-size 1 (131.4 GiB)" in msg and "raise --tensor-parallel-size" in msg


def _llama8b_outside(temporaries: int, head_bytes: int) -> int:
    head = 128256 * 4096 * head_bytes
    blocks = temporaries * 1024 * 128256 * 4 + 1024 * 4096 * head_bytes
    return CTX + CTX + head + blocks  # worker + xtcache contexts, lm_head, logit blocks


def test_llama3_8b_on_a_24gb_card_fits_topk_at_the_default():
    run = Run()
    got = device_budget(LLAMA3_8B, run, RTX4090)
    inside = 8_030_261_248 * 2 + 8192 * (8192 + 48 * 128 + 2 * 14336) * 2 + 256 * 128256 * 8 + 2 * 32 * 8 * 128 * 2 * 2064
    assert got.need_inside() == inside  # 16.1 GiB of a 19.2 GiB share
    assert got.need_outside() == _llama8b_outside(3, 2) == 3_708_813_312  # 3.45 GiB of 4.80
    assert got.rest == usable(RTX4090) - math.ceil(0.8 * usable(RTX4090))
    assert refusal(LLAMA3_8B, run, got) is None


def test_llama3_8b_sampled_on_a_24gb_card_fits_with_the_half_head_and_is_refused_above_its_utilization():
    run = Run(mode="sampled")
    got = device_budget(LLAMA3_8B, run, RTX4090)
    need = _llama8b_outside(5, 2)  # multinomial's three [rows, V] copies on top of real and exp
    assert got.need_outside() == need <= got.rest  # 4.43 GiB of 4.80
    assert refusal(LLAMA3_8B, run, got) is None
    high = Run(mode="sampled", gpu_memory_utilization=0.82)
    msg = refusal(LLAMA3_8B, high, device_budget(LLAMA3_8B, high, RTX4090))
    rest = usable(RTX4090) - math.ceil(0.82 * usable(RTX4090))
    assert msg.startswith(f"--gpu-memory-utilization 0.82 leaves {rest / GiB:.1f} GiB on cuda:0 outside vLLM; the ")
    assert "half lm_head (1.0 GiB)" in msg and f"need {need / GiB:.1f} GiB" in msg
    assert msg.endswith(f"lower --gpu-memory-utilization to {math.floor((1 - need / usable(RTX4090)) * 100) / 100:.2f}")


def test_a_float32_head_is_refused_with_the_numbers_and_two_fixes():
    run = Run(dtype="float32", gpu_memory_utilization=0.95)
    got = device_budget(LLAMA3_8B, run, H100)
    need = _llama8b_outside(3, 4)
    assert got.need_outside() == need > got.rest
    msg = refusal(LLAMA3_8B, run, got)
    rest = usable(H100) - math.ceil(0.95 * usable(H100))
    assert msg.startswith(f"--gpu-memory-utilization 0.95 leaves {rest / GiB:.1f} GiB on cuda:0 outside vLLM; the ")
    assert "float32 lm_head (2.0 GiB)" in msg
    highest = math.floor((1 - need / usable(H100)) * 100) / 100  # 0.94
    assert msg.endswith(f"lower --gpu-memory-utilization to {highest:.2f} or pass --dtype bfloat16 (a half-precision "
                        "lm_head)")
    half = Run(dtype="bfloat16", gpu_memory_utilization=0.95)
    assert refusal(LLAMA3_8B, half, device_budget(LLAMA3_8B, half, H100)) is None


def test_llama3_8b_at_util_0_9_on_a_24gb_card_is_refused():
    run = Run(gpu_memory_utilization=0.9)
    msg = refusal(LLAMA3_8B, run, device_budget(LLAMA3_8B, run, RTX4090))
    rest = usable(RTX4090) - math.ceil(0.9 * usable(RTX4090))
    assert msg.startswith(f"--gpu-memory-utilization 0.9 leaves {rest / GiB:.1f} GiB on cuda:0 outside vLLM")
    highest = math.floor((1 - _llama8b_outside(3, 2) / usable(RTX4090)) * 100) / 100  # 1 - 3.45 / 23.68 = 0.854
    assert f"lower --gpu-memory-utilization to {highest:.2f}" in msg


def test_other_processes_on_the_device_count_against_the_rest():
    run = Run()
    assert refusal(LLAMA3_8B, run, device_budget(LLAMA3_8B, run, RTX4090, in_use=0)) is None
    msg = refusal(LLAMA3_8B, run, device_budget(LLAMA3_8B, run, RTX4090, in_use=2 * GiB))
    assert "in use by other processes (2.0 GiB)" in msg


def test_qwen_152k_vocabulary_blocks_and_head():
    run = Run()
    got = device_budget(QWEN25_7B, run, RTX4090)
    rows = 882  # 2^27 // 152064
    head = 152064 * 3584 * 2
    blocks = 3 * rows * 152064 * 4 + rows * 3584 * 2
    assert got.need_outside() == CTX + CTX + head + blocks  # 3.52 GiB of 4.80
    assert refusal(QWEN25_7B, run, got) is None
    sampled = Run(mode="sampled", gpu_memory_utilization=0.82)
    msg = refusal(QWEN25_7B, sampled, device_budget(QWEN25_7B, sampled, RTX4090))
    need = CTX + CTX + head + 5 * rows * 152064 * 4 + rows * 3584 * 2
    assert f"lower --gpu-memory-utilization to {math.floor((1 - need / usable(RTX4090)) * 100) / 100:.2f}" in msg


def test_qwen_72b_fits_on_4x80gb_and_its_reference_phase_is_smaller_than_its_capture():
    run = Run(tensor_parallel_size=4)
    got = device_budget(QWEN25_72B, run, H100)
    assert got.inside[0].bytes == 72_706_203_648 * 2 // 4
    reference = CTX + 2048 * 152064 * (2 + 4 + 1)  # bf16 logits, fp32 log-probs, rank mask of one window
    assert sum(t.bytes for t in got.fixed + got.phases["reference engine"]) == reference
    assert got.peak_phase() == "capture"
    assert refusal(QWEN25_72B, run, got) is None


def test_a_trusted_check_skips_the_reference_phase_and_the_fallback_has_no_head():
    assert "reference engine" not in device_budget(LLAMA3_8B, Run(reference_check=False), RTX4090).phases
    fallback = device_budget(LLAMA3_8B, Run(fast_path=False, mode="full"), RTX4090)
    assert list(fallback.phases) == ["prompt log-probs"]
    assert fallback.need_outside() == CTX + 2048 * 128256 * (2 + 4 + 1 + 12)
    # a 152k vocabulary: vLLM's V1 runner (pinned) makes one request's prompt log-probs at a time, 5.5 GiB
    qwen = device_budget(QWEN25_7B, Run(fast_path=False, mode="sampled"), H100)
    assert qwen.need_outside() == CTX + 2048 * 152064 * (2 + 4 + 1 + 12)


def test_teacher_shape_reads_sizes_from_config_and_safetensors_headers(tmp_path):
    from safetensors.numpy import save_file

    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_hidden_layers": 2, "vocab_size": 1000, "intermediate_size": 128, "torch_dtype": "float32"}))
    save_file({"lm_head.weight": np.zeros((1000, 64), np.float32), "q.qweight": np.zeros((64, 8), np.int32)},
              str(tmp_path / "model-1.safetensors"))
    save_file({"model.norm.weight": np.zeros(64, np.float16)}, str(tmp_path / "model-2.safetensors"))
    s = TeacherShape.read(str(tmp_path))
    assert (s.hidden, s.vocab, s.layers, s.heads, s.kv_heads, s.head_dim) == (64, 1000, 2, 4, 2, 16)
    assert (s.float_params, s.other_bytes) == (1000 * 64 + 64, 64 * 8 * 4)
    assert Run().compute_bytes(s) == 2  # vLLM runs a float32 checkpoint in 16 bits under --dtype auto
    assert s.weight_bytes(2) == (1000 * 64 + 64) * 2 + 64 * 8 * 4


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t

    def sleep(self, s):
        self.t += s


def test_wait_for_release_returns_once_every_device_is_back_within_the_margin():
    clock = FakeClock()
    before = [2 * GiB, 1 * GiB]
    trace = iter([[70 * GiB, 60 * GiB], [30 * GiB, 60 * GiB], [2 * GiB + 100 * MiB, 1 * GiB + 300 * MiB],
                  [2 * GiB, 1 * GiB + 200 * MiB]])
    waited = b.wait_for_release(before, lambda: next(trace), sleep=clock.sleep, clock=clock, poll_s=0.5)
    assert waited == 1.5  # the fourth reading: device 1 was 300 MiB over the 256 MiB margin before
    assert b.wait_for_release(None, lambda: pytest.fail("probed off CUDA")) == 0.0


def test_wait_for_release_times_out_naming_the_device_still_held():
    clock = FakeClock()
    with pytest.raises(CaptureError, match=r"cuda:1 still holds 40.0 GiB more than before .* after 120 s"):
        b.wait_for_release([2 * GiB, GiB], lambda: [2 * GiB, 41 * GiB], sleep=clock.sleep, clock=clock)
    assert clock.t == 120.0


def _tiny_teacher(path):
    from safetensors.numpy import save_file

    path.mkdir()
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
        "num_hidden_layers": 2, "vocab_size": 1000, "intermediate_size": 128, "torch_dtype": "bfloat16"}))
    save_file({"lm_head.weight": np.zeros((1000, 64), np.float32)}, str(path / "model.safetensors"))
    return str(path)


def _cfg(teacher: str, util: float = 0.8):
    t = SimpleNamespace(engine="vllm", teacher=teacher, dtype="auto", tensor_parallel_size=1, fast_path=True,
                        gpu_memory_utilization=util, max_num_batched_tokens=None, enforce_eager=None,
                        check_tolerance=None, memory_check=True)
    return SimpleNamespace(teacher=t, capture=SimpleNamespace(mode="topk", num_samples=64, seed=0, batch_tokens=4096))


@pytest.fixture
def fake_gpu(monkeypatch):
    """A CUDA host as NVML sees it: one device of `fake_gpu.total` bytes, `fake_gpu.used` in use."""
    import xtcache.devices

    dev = SimpleNamespace(total=2 * GiB, used=0, reserved=None)  # NVML version 1: no reserve of its own
    monkeypatch.setattr(xtcache.devices, "cuda_present", lambda: True)
    monkeypatch.setattr(b, "nvml_memory", lambda idx: [(dev.total, dev.used, dev.reserved) for _ in idx])
    return dev


def test_preflight_refuses_before_any_engine_starts(tmp_path, fake_gpu, monkeypatch):
    from stage1_teacher.capture import run as capture

    def no_engine(*a, **k):
        raise AssertionError("an engine started")

    monkeypatch.setattr(capture, "VllmPromptLogprobEngine", no_engine)
    monkeypatch.setattr(capture, "VllmHiddenEngine", no_engine)
    cfg = _cfg(_tiny_teacher(tmp_path / "t"))
    room = usable(2 * GiB)  # 1,728 MiB: the 2 GiB device less the 320 MiB runtime gap
    need = CTX + CTX + 1000 * 64 * 2 + 3 * 1024 * 1000 * 4 + 1024 * 64 * 2
    rest, highest = room - math.ceil(0.8 * room), math.floor((1 - need / room) * 100) / 100  # 0.3 GiB, 0.40
    with pytest.raises(ConfigError, match=rf"^--gpu-memory-utilization 0.8 leaves {rest / GiB:.1f} GiB on cuda:0 "
                                          rf"outside vLLM; .*need 1.0 GiB: lower --gpu-memory-utilization to "
                                          rf"{highest:.2f} \(or --no-memory-check to start anyway: the budget is an "
                                          r"estimate\)$"):
        capture.open_capture(cfg, vocab_size=1000, k=8, window_len=64, max_model_len=65,
                             first_batch=[np.arange(10)])
    cfg.teacher.memory_check = False  # the user's override: the engine starts
    with pytest.raises(AssertionError, match="an engine started"):
        capture.open_capture(cfg, vocab_size=1000, k=8, window_len=64, max_model_len=65,
                             first_batch=[np.arange(10)])


def test_preflight_accepts_a_budget_that_fits_and_skips_the_cpu(tmp_path, fake_gpu, monkeypatch):
    from stage1_teacher.capture import preflight
    from stage1_teacher.capture.vllm_engine import vllm_options

    cfg = _cfg(_tiny_teacher(tmp_path / "t"), util=0.4)
    got = preflight.check_device_memory(cfg, vllm_options(cfg, 65), window_len=64, k=8, reference_check=True)
    assert got.rest == usable(2 * GiB) - math.ceil(0.4 * usable(2 * GiB))
    # a bfloat16 checkpoint under --dtype auto: the head in bfloat16 (2 bytes), its row blocks float32
    assert got.need_outside() == CTX + CTX + 1000 * 64 * 2 + 3 * 1024 * 1000 * 4 + 1024 * 64 * 2
    fake_gpu.used = GiB + 320 * MiB  # another process holds half the device; NVML version 1 adds the reserve
    with pytest.raises(ConfigError, match=r"in use by other processes \(1.0 GiB\)"):
        preflight.check_device_memory(cfg, vllm_options(cfg, 65), window_len=64, k=8, reference_check=True)
    # NVML version 2 reports the driver's reserve: the runtime's total is read, not estimated
    fake_gpu.used, fake_gpu.reserved = 0, 200 * MiB
    got = preflight.check_device_memory(cfg, vllm_options(cfg, 65), window_len=64, k=8, reference_check=True)
    room = 2 * GiB - 200 * MiB
    assert got.usable == room and got.rest == room - math.ceil(0.4 * room)
    import xtcache.devices

    monkeypatch.setattr(xtcache.devices, "cuda_present", lambda: False)
    monkeypatch.setattr(b, "nvml_memory", lambda idx: pytest.fail("NVML asked on a CPU host"))
    assert preflight.check_device_memory(cfg, vllm_options(cfg, 65), window_len=64, k=8,
                                         reference_check=True) is None
