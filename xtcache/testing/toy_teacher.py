"""A toy teacher with a padded lm_head, built next to a `xtcache.testing.toy` setup, for stage 1 tests.

Real checkpoints pad the lm_head beyond the tokenizer (Qwen3: 151,936 columns for 151,669
tokens); the toy teacher does not. This builds a Qwen2 teacher with the toy teacher tokenizer,
head size 32 (vLLM's CPU attention has no kernel below 32), `VOCAB_PAD` unused lm_head columns,
and trains it briefly on the toy corpus so its distributions have real structure. A `DONE`
marker makes the build reusable across test sessions. The tied-embedding Llama variant covers
teachers without their own lm_head.

Two shapes. "toy" (2 layers, hidden 64) is what the tests use: fast, but its lm_head costs more
than its whole transformer body, which no real teacher does. "proportioned" (6 layers, hidden
256) gives the head the share of forward compute that 1.5B-8B teachers have (see
`head_share`), for benchmarks whose ratios should carry over to real teachers.

    python -m xtcache.testing.toy_teacher .xtcache_test_cache/toy-XXXX
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from xtcache.testing import toy

VOCAB_PAD = 16
SHAPES = {
    "toy": dict(hidden=64, layers=2, heads=2, kv_heads=1, intermediate=192),
    "proportioned": dict(hidden=256, layers=6, heads=4, kv_heads=2, intermediate=768),
}


def head_share(config: dict) -> float:
    """lm_head multiply-adds / transformer-body multiply-adds per position (attention scores aside).

    Qwen2.5-0.5B: 0.38, Qwen2.5-1.5B: 0.18, Qwen2.5-7B and Llama-3.1-8B: 0.08.
    """
    config = config.get("text_config", config)
    h, i, layers, v = (config[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size"))
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or h // heads
    kv = config.get("num_key_value_heads") or heads
    body = layers * (2 * h * heads * head_dim + 2 * h * kv * head_dim + 3 * h * i)
    return h * v / body


def build_vllm_teacher(toy_root: str | Path, *, tied: bool = False, steps: int = 120, seed: int = 0,
                       shape: str = "toy") -> Path:
    """Directory of a vLLM-servable teacher next to the toy setup at `toy_root` (built once)."""
    if shape not in SHAPES:
        raise ValueError(f"unknown toy teacher shape {shape!r}: use one of {', '.join(SHAPES)}")
    root = Path(toy_root)
    out = root / (("vllm_teacher_tied" if tied else "vllm_teacher") + ("" if shape == "toy" else f"_{shape}"))
    toy.build_once(out, lambda: _build(root, out, tied=tied, steps=steps, seed=seed, shape=shape))
    return out


def _build(root: Path, out: Path, *, tied: bool, steps: int, seed: int, shape: str) -> str:
    arch = "llama" if tied else "qwen2"
    model = toy.build_tiny_model(arch, root / "teacher_tokenizer", out, **SHAPES[shape], seed=seed,
                                 vocab_pad=VOCAB_PAD)
    if tied:
        import torch

        model.config.tie_word_embeddings = True
        with torch.no_grad():
            model.lm_head.weight = model.model.embed_tokens.weight
        model.save_pretrained(str(out), safe_serialization=True)
    texts = [json.loads(line)["text"] for line in open(root / "corpus" / "train.jsonl", encoding="utf-8")]
    if steps:
        toy.train_tiny_lm(out, texts, steps=steps, seq_len=128, seed=seed, log_every=0)
    return "ok"


if __name__ == "__main__":
    print(build_vllm_teacher(sys.argv[1]))
