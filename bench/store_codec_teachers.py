"""The teachers of `bench/store_codec.py` and their held-out top-k distributions (cached).

- the toy teacher (`build_teacher`): a byte-level BPE tokenizer with a vocabulary above 65,536 trained on
  the standard library's source plus 30 MB of installed site-packages source, and a tiny Qwen2 trained on
  that text for a fixed number of steps (a fixed recipe, not a fixed teacher: the installed sources and the
  CPU's float arithmetic differ between machines; its final loss was 5.85 on an Intel Xeon on 2026-11-28 and
  5.91 on an AMD EPYC on 2026-12-01, the stamp of each docs block says which);
- the real teacher (`real_teacher`): SmolLM2-135M-Instruct of the real tier (xtcache.testing.real) and its
  held-out documentation topics.

`teacher_documents` runs either with transformers on held-out documents and keeps each position's top-k
ids and log-probs, cached as .npz under .xtcache_bench_cache/.

    .venv/bin/python bench/store_codec.py [--teacher real]
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np

from xtcache.testing import toy

REPO = Path(__file__).resolve().parents[1]
CACHE = REPO / ".xtcache_bench_cache"
TARGET_VOCAB = 80_000
log = logging.getLogger("bench.store_codec")


def corpus(extra_mb: float = 30.0) -> list[str]:
    """The standard library's source plus `extra_mb` of installed site-packages source, ~2,000 chars each.

    BPE on the stdlib alone stops near 61k tokens (every word already one token), short of the
    17-bit ids this bench is about; the site-packages sources (numpy, torch, transformers, ...)
    are more real Python text of the same kind.
    """
    import random
    import sysconfig

    docs = toy.stdlib_corpus(max_docs=100_000, doc_chars=2000, seed=0)
    site = Path(sysconfig.get_paths()["purelib"])
    budget = int(extra_mb * 1e6)
    extra: list[str] = []
    for path in sorted(site.rglob("*.py")):
        if budget <= 0:
            break
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        budget -= len(text)
        piece, size = [], 0
        for line in text.splitlines(keepends=True):
            piece.append(line)
            size += len(line)
            if size >= 2000:
                extra.append("".join(piece))
                piece, size = [], 0
    random.Random(0).shuffle(extra)
    return docs + extra


def build_teacher(steps: int) -> tuple[Path, list[str]]:
    """Tokenizer (vocab > 65,536) and a tiny teacher trained on it; cached between runs."""
    docs = corpus()
    held, train = docs[:200], docs[200:]  # held-out: stdlib documents never seen in training
    root = CACHE / f"teacher-v{TARGET_VOCAB}-s{steps}"
    toy.build_once(root, lambda: _train_teacher(root, train, steps))
    return root / "model", held


def _train_teacher(root: Path, train: list[str], steps: int) -> str:
    tok_dir = root / "tokenizer"
    tok = toy.train_bpe_tokenizer(train, TARGET_VOCAB, "teacher", tok_dir)
    vocab = len(tok)
    log.info("BPE tokenizer: %d tokens from %d documents (%.1f MB)", vocab, len(train),
             sum(map(len, train)) / 1e6)
    if vocab <= 65_536:
        raise SystemExit(f"BPE reached only {vocab} tokens on the stdlib text; ids would fit 16 bits. "
                         "Add more text (e.g. site-packages sources) before trusting this bench.")
    toy.build_tiny_model("qwen2", tok_dir, root / "model", hidden=128, layers=2, heads=4, kv_heads=2,
                         intermediate=384, seed=0)
    log.info("training the teacher for %d steps", steps)
    losses = toy.train_tiny_lm(root / "model", train, steps=steps, seq_len=128, batch_size=8, lr=3e-3)
    return json.dumps({"vocab": vocab, "steps": steps, "first_loss": losses[0],
                       "last_loss": float(np.mean(losses[-20:]))})


def real_teacher() -> tuple[Path, list[str], Path]:
    """(teacher directory, held-out documents, cache directory) of the real tier (xtcache.testing.real):
    SmolLM2-135M-Instruct, 49,152 ids, on documentation topics it was never given here."""
    from xtcache.testing.real import build_real_models

    models = build_real_models()
    return models.teacher, _texts(models.heldout_jsonl), CACHE / "real-smollm2"


def real_training_texts() -> list[str]:
    """The real tier's training documents (about 88k positions of the real teacher: one store part's worth)."""
    from xtcache.testing.real import build_real_models

    return _texts(build_real_models().train_jsonl)


def _texts(path: Path) -> list[str]:
    """The documents of a JSONL file of {"text": ...} lines."""
    return [json.loads(line)["text"] for line in path.read_text(encoding="utf-8").splitlines()]


def teacher_documents(model_dir: Path, held: list[str], positions: int, k_max: int, *, cache_dir: Path | None = None,
                      max_tokens: int = 256, corpus: str = "heldout") -> list[dict]:
    """Held-out documents with the teacher's real T=1 top-k_max distributions (cached as .npz in `cache_dir`,
    default beside the model), each cut to its first `max_tokens` tokens. `corpus` names the documents in
    the cache's file name when they are not the held-out ones.

    Each dict: text, ids int32 [T], offsets int32 [T, 2], topk_ids int32 [T, k_max],
    topk_logprobs float32 [T, k_max], realized float32 [T]; row 0 has no prediction (zeros / NaN).
    """
    cache_dir = cache_dir or model_dir.parent
    cache_dir.mkdir(parents=True, exist_ok=True)
    name = f"dists-{positions}-{k_max}" if corpus == "heldout" else f"dists-{corpus}-{positions}-{k_max}"
    cache = cache_dir / (f"{name}.npz" if max_tokens == 256 else f"{name}-t{max_tokens}.npz")
    if not cache.exists():
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(model_dir))
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        arrays: dict[str, np.ndarray] = {}
        texts, total = [], 0
        with torch.inference_mode():
            for text in held:
                enc = tok(text, return_offsets_mapping=True)
                ids, offs = enc["input_ids"][:max_tokens], enc["offset_mapping"][:max_tokens]
                if len(ids) < 2:
                    continue
                text = text[: offs[-1][1]]
                logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)  # [T, V]
                top = torch.topk(logp[:-1], k_max, dim=-1)  # row t predicts token t+1
                T = len(ids)
                top_ids = np.zeros((T, k_max), np.int32)
                top_lp = np.zeros((T, k_max), np.float32)
                top_ids[1:], top_lp[1:] = top.indices.numpy(), top.values.numpy()
                realized = np.full(T, np.nan, np.float32)
                realized[1:] = logp[torch.arange(T - 1), torch.tensor(ids[1:])].numpy()
                n = len(texts)
                arrays.update({f"ids{n}": np.array(ids, np.int32), f"offsets{n}": np.array(offs, np.int32),
                               f"topk_ids{n}": top_ids, f"topk_logprobs{n}": top_lp, f"realized{n}": realized})
                texts.append(text)
                total += T - 1
                if total >= positions:
                    break
        arrays["texts"] = np.array(texts)
        np.savez(cache, **arrays)
    data = np.load(cache, allow_pickle=False)
    return [{"text": str(t), "ids": data[f"ids{n}"], "offsets": data[f"offsets{n}"],
             "topk_ids": data[f"topk_ids{n}"], "topk_logprobs": data[f"topk_logprobs{n}"],
             "realized": data[f"realized{n}"]} for n, t in enumerate(data["texts"])]
