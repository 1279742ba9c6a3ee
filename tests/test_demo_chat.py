"""`xtcache demo --chat` at its reduced size: conversations in two chat templates, distilled from the cache.

Runs the demo exactly as a user would (a subprocess of the `xtcache` CLI, real vLLM, real DeepSpeed),
then reads the numbers it reported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from xtcache.testing.suite import TEST_CACHE

pytestmark = pytest.mark.slow


def test_small_chat_demo_distils_assistant_turns_across_two_templates():
    workdir = TEST_CACHE / "demo-small"
    proc = subprocess.run([sys.executable, "-m", "xtcache.cli", "demo", "--chat", "--size", "small", "--workdir",
                           str(workdir)], capture_output=True, text=True, timeout=1500,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    result = json.loads((workdir / "chat" / "demo_result.json").read_text())
    kd, ce = result["distilled"], result["baseline"]
    assert result["chat"] and kd["steps"] == ce["steps"] > 0
    assert kd["first_eval"]["kl"] == pytest.approx(ce["first_eval"]["kl"])
    # KD and CE on the assistant turns of conversations rendered in two different templates
    assert kd["final_eval_kl"] < ce["final_eval_kl"]
    assert "--chat: conversations" in proc.stdout
