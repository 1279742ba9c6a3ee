"""A toy teacher with a padded lm_head, built next to a `xtcache.toy` setup, for stage 1 tests.

Real checkpoints pad the lm_head beyond the tokenizer (Qwen3: 151,936 columns for 151,669
tokens); the toy teacher does not. This builds a Qwen2 teacher with the toy teacher tokenizer,
head size 32 (vLLM's CPU attention has no kernel below 32), `VOCAB_PAD` unused lm_head columns,
and trains it briefly on the toy corpus so its distributions have real structure. A `DONE`
marker makes the build reusable across test sessions. The tied-embedding Llama variant covers
teachers without their own lm_head.

    python -m stage1_teacher.toy_teacher .xtcache_test_cache/toy-XXXX
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

VOCAB_PAD = 16


def build_vllm_teacher(toy_root: str | Path, *, tied: bool = False, steps: int = 120, seed: int = 0) -> Path:
    """Directory of a vLLM-servable teacher next to the toy setup at `toy_root` (built once)."""
    from xtcache import toy

    root = Path(toy_root)
    out = root / ("vllm_teacher_tied" if tied else "vllm_teacher")
    if (out / "DONE").exists():
        return out
    arch = "llama" if tied else "qwen2"
    model = toy.build_tiny_model(arch, root / "teacher_tokenizer", out, hidden=64, layers=2, heads=2, kv_heads=1,
                                 intermediate=192, seed=seed, vocab_pad=VOCAB_PAD)
    if tied:
        import torch

        model.config.tie_word_embeddings = True
        with torch.no_grad():
            model.lm_head.weight = model.model.embed_tokens.weight
        model.save_pretrained(str(out), safe_serialization=True)
    texts = [json.loads(line)["text"] for line in open(root / "corpus" / "train.jsonl", encoding="utf-8")]
    if steps:
        toy.train_tiny_lm(out, texts, steps=steps, seq_len=128, seed=seed, log_every=0)
    (out / "DONE").write_text("ok")
    return out


if __name__ == "__main__":
    print(build_vllm_teacher(sys.argv[1]))
