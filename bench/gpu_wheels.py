"""The wheels `make gpu-check` needs on a bare PyTorch GPU machine without network, and how to install them.

A bare GPU image (this project's first GPU machine: PyTorch 2.11, transformers, Triton, pyarrow, typer,
safetensors, tokenizers, accelerate, pytest and about 200 more; `BARE_IMAGE` below, read from its
package list on 2026-11-17) lacks DeepSpeed, zarr, numcodecs, pydantic and google-crc32c. Those
and their missing needs are `WHEELS`, pinned to the versions xtcache is tested with: 14 MiB for
CPython 3.12 on x86-64, within the 64 MiB a command may bring along. vLLM (517 MB) is not among
them: on a machine without it `bench/gpu_check.py` skips its vLLM steps and says so.

    python3 bench/gpu_wheels.py                                      # the list, and the steps below
    python3 bench/gpu_wheels.py download --dest .whl [--python-version 3.12]   # on a machine with network
    python3 bench/gpu_wheels.py install --wheels .whl --target .gpu-site       # on the GPU machine, offline
    make gpu-check                                                   # uses .whl when it holds wheels

Only the standard library and pip: it runs on the bare machine before anything is installed.
DeepSpeed publishes no wheel (its sdist builds one here, pure Python, `DS_BUILD_OPS=0`: no ops are
compiled ahead; ZeRO-2 and ZeRO-3 need none).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

LIMIT_BYTES = 64 * 2**20  # what one command on the GPU machine may bring along
WHEELS = [  # name==version: pinned to the tested versions (tests/test_gpu_check.py compares them with .venv)
    "deepspeed==0.19.7", "hjson==3.1.0", "pydantic==2.14.4", "pydantic-core==2.50.5", "annotated-types==0.8.0",
    "typing-inspection==0.4.5", "typing-extensions==4.16.0", "zarr==3.1.6", "numcodecs==0.16.6",
    "donfig==0.8.1.post1", "google-crc32c==1.9.0",
]
SDIST_ONLY = {"deepspeed"}  # built into a wheel here (pip wheel --no-deps --no-build-isolation)
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64"]
BARE_IMAGE = """absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin
jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite
lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict
multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-cublas
nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand
nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink
nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum
opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker
prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks
pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil
pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image scikit-learn scipy
seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers statsmodels sympy
tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch
torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton typer
typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp""".split()

# modules whose distribution is not installed where the check runs (the CPU .venv) but is on the image
MODULE_DISTRIBUTIONS = {"pynvml": "nvidia-ml-py"}


def canonical(name: str) -> str:
    """A distribution's name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command")
    d = sub.add_parser("download", help="fetch (and for sdist-only packages build) the wheels into --dest")
    d.add_argument("--dest", default=".whl")
    d.add_argument("--python-version", default="3.12", help="the GPU machine's CPython (3.12 on the bare image)")
    i = sub.add_parser("install", help="install the wheels offline into --target (then PYTHONPATH=<target>)")
    i.add_argument("--wheels", default=".whl")
    i.add_argument("--target", default=".gpu-site")
    return p.parse_args(argv)


def wheel_files(folder: Path) -> list[Path]:
    """The wheels of `WHEELS` in `folder`; refuses a missing one, a second version, or a total over the limit."""
    files = sorted(folder.glob("*.whl"))
    by_name: dict[str, list[Path]] = {}
    for f in files:
        by_name.setdefault(canonical(f.name.split("-")[0]), []).append(f)
    problems = []
    for spec in WHEELS:
        name, version = spec.split("==")
        found = by_name.get(canonical(name), [])
        if len(found) != 1 or f"-{version}-" not in found[0].name:
            problems.append(f"{spec}: found {[f.name for f in found] or 'none'}")
    total = sum(f.stat().st_size for f in files)
    if total > LIMIT_BYTES:
        problems.append(f"{total / 2**20:.1f} MiB in {folder}, over the {LIMIT_BYTES // 2**20} MiB a command may bring")
    if problems:
        raise SystemExit(f"gpu_wheels: {folder}: " + "; ".join(problems))
    return files


def download(dest: Path, python_version: str) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    binary = [w for w in WHEELS if canonical(w.split("==")[0]) not in SDIST_ONLY]
    plats = [a for p in PLATFORMS for a in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", python_version, "--implementation", "cp", *plats, "-d", str(dest), *binary],
                   check=True)
    built = [w for w in WHEELS if canonical(w.split("==")[0]) in SDIST_ONLY]
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dest),
                    *built], check=True, env={**os.environ, "DS_BUILD_OPS": "0"})
    files = wheel_files(dest)
    print(f"{len(files)} wheels, {sum(f.stat().st_size for f in files) / 2**20:.1f} MiB in {dest}")


def install(wheels: Path, target: Path) -> None:
    files = wheel_files(wheels)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--no-cache-dir", "--upgrade", "--target", str(target), *map(str, files)], check=True)
    print(f"installed {len(files)} wheels into {target}: run with PYTHONPATH={target}")


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.command == "download":
        download(Path(args.dest), args.python_version)
    elif args.command == "install":
        install(Path(args.wheels), Path(args.target))
    else:
        print("wheels a bare PyTorch GPU machine needs for bench/gpu_check.py (vLLM steps skipped without vLLM):")
        print("\n".join(f"  {w}" for w in WHEELS))
        print(f"\n1. with network:      python3 bench/gpu_wheels.py download --dest .whl   (at most "
              f"{LIMIT_BYTES // 2**20} MiB; 14 MiB for CPython 3.12 x86-64)\n"
              "2. bring .whl to the GPU machine, then, offline: make gpu-check   (= python3 bench/gpu_wheels.py "
              "install --wheels .whl --target .gpu-site; PYTHONPATH=.gpu-site python3 bench/gpu_check.py)")


if __name__ == "__main__":
    main()
