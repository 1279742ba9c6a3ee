"""`xtcache demo --chat` at its reduced size: conversations in two chat templates, distilled from the cache.

Runs the demo exactly as a user would (a subprocess of the `xtcache` CLI, real DeepSpeed), then reads
the numbers it reported. It captures with `--engine hf`: conversations scored on vLLM, cross-tokenizer, are
what tests/test_rounds.py's vLLM rounds run (generate and teacher-dump on vLLM), and the demo's engine
choice is the plain demo's; this saves the demo's vLLM engine starts.
"""

from __future__ import annotations

import json

import pytest

from tests.test_demo import WORKDIR, run_small_demo
from xtcache.app.demo.setup import SIZES

pytestmark = pytest.mark.slow


def test_small_chat_demo_distils_assistant_turns_across_two_templates():
    proc = run_small_demo("--chat", "--engine", "hf")
    result = json.loads((WORKDIR / "chat" / "demo_result.json").read_text())
    kd, ce = result["distilled"], result["baseline"]
    assert result["chat"] and kd["steps"] == ce["steps"] > 0
    assert kd["first_eval"]["kl"] == pytest.approx(ce["first_eval"]["kl"])
    # KD and CE on the assistant turns of conversations rendered in two different templates, 40 steps each:
    # distillation leads on held-out KL by 0.137, 0.187 and 0.172 nats with seeds 0, 1, 2 (the demo runs seed 0;
    # one run's KL moves by up to 0.06 between seeds), so a KD term that does not teach stays below this margin
    assert kd["steps"] == SIZES["small"].steps(chat=True) < SIZES["small"].student_steps
    assert kd["final_eval_kl"] < ce["final_eval_kl"] - 0.05
    assert "--chat: conversations" in proc.stdout
    assert result["engine"] == "transformers" and result["teacher_positions_per_s"] > 0
