"""Loading tokenizers exactly as their `tokenizer.json` defines them, the same way everywhere.

Stage 1 tokenizes the corpus, the projection builder maps vocabularies and stage 2 tokenizes the
student's side; all three must see the same tokens, or fingerprints and alignments disagree. With
transformers 5, `AutoTokenizer` on a model directory may rebuild the tokenizer for the model type
(a Qwen2 directory gets Qwen's own normalizer and pre-tokenizer), so a directory holding a
`tokenizer.json` is loaded as `PreTrainedTokenizerFast` from that file, as is. Truncation and
padding are turned off: alignment needs every token. Slow (Python) tokenizers have no offsets and
are refused.
"""

from __future__ import annotations

import os

from xtcache.align.tokenizer import require_fast
from xtcache.errors import ConfigError


def load_tokenizer(path: str | os.PathLike, side: str = "tokenizer"):
    """The fast tokenizer at `path` (a local directory), as its tokenizer.json defines it.

    `side` names it in error messages ("teacher tokenizer", "student tokenizer", ...).
    """
    from transformers import PreTrainedTokenizerFast  # AutoTokenizer's import pulls torch in: 5 s on 2 cores

    path = str(path)
    try:
        if os.path.isfile(os.path.join(path, "tokenizer.json")):
            tok = PreTrainedTokenizerFast.from_pretrained(path)
        else:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(path, use_fast=True, trust_remote_code=False)
    except (OSError, ValueError, TypeError) as e:
        raise ConfigError(f"{side} {path}: cannot load a tokenizer ({e})") from None
    backend = require_fast(tok, side)
    backend.no_truncation()
    backend.no_padding()
    return tok
