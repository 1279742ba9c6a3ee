"""`bench/gpu_check.py --device cpu`: the GPU smoke check's own steps, run on the CPU in the suite.

On a GPU machine `make gpu-check` runs the same script on CUDA; here it proves that the script
itself works end to end (vLLM forward only, teacher-dump on the fast path with its first-batch
check, train-student with P-KL) and prints every row of its table. Its vLLM engines run in process
(tests/conftest.py); the production process model is tests/test_stage1_vllm.py's.

    .venv/bin/python -m pytest -q tests/test_gpu_check.py
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from xtcache.testing.suite import REPO

pytestmark = pytest.mark.slow


def test_gpu_check_runs_both_stages_on_the_cpu(toy_setup, teacher, tmp_path):
    proc = subprocess.run([sys.executable, "bench/gpu_check.py", "--device", "cpu", "--docs", "4", "--steps", "2",
                           "--max-seq-len", "64", "--workdir", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = dict(re.findall(r"^\| (.+?) +\| (.+) \|$", proc.stdout, re.M))
    assert rows["device"] == "CPU" and rows["teacher dtype"] == "float32"
    assert float(rows["vLLM forward only, positions/s"].replace(",", "")) > 0
    assert float(rows["teacher-dump capture, positions/s"].replace(",", "")) > 0
    assert rows["capture path"] == "vLLM hidden states + teacher lm_head (exact)"
    max_gap, mean_gap = (float(x) for x in rows["first-batch check: max / mean |log-prob gap|"].split(" / "))
    assert max_gap < 1e-3 and mean_gap <= max_gap  # float32 on both paths
    assert rows["check platform, model runner"].startswith("cpu, v")
    assert float(rows["train-student step time, s (P-KL, ZeRO-2)"]) > 0
    assert rows["train-student peak memory, MiB"].endswith("(host resident)")
