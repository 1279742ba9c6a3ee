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

# the files a Hugging Face tokenizer directory loads from: the fast tokenizer's own file, its config, or a vocabulary
# that transformers converts (SentencePiece models, BPE vocab + merges, WordPiece vocab)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "spiece.model", "vocab.json",
                   "vocab.txt")


def require_tokenizer_files(path: str | os.PathLike, side: str = "tokenizer") -> None:
    """Refuse a local directory that holds none of TOKENIZER_FILES, in one line naming `side`, before anything
    loads (transformers would answer after seconds with advice to install sentencepiece or tiktoken)."""
    path = str(path)
    if os.path.isdir(path) and not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
        raise ConfigError(f"{side} {path}: the directory holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}); "
                          "pass a Hugging Face model or tokenizer directory")


def load_tokenizer(path: str | os.PathLike, side: str = "tokenizer"):
    """The fast tokenizer at `path` (a local directory), as its tokenizer.json defines it.

    `side` names it in error messages ("teacher tokenizer", "student tokenizer", ...).
    """
    require_tokenizer_files(path, side)
    from transformers import PreTrainedTokenizerFast  # AutoTokenizer's import pulls torch in: 5 s on 2 cores

    path = str(path)
    try:
        if os.path.isfile(os.path.join(path, "tokenizer.json")):
            tok = PreTrainedTokenizerFast.from_pretrained(path)
        else:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(path, use_fast=True, trust_remote_code=False)
    except (OSError, ValueError, TypeError) as e:
        raise ConfigError(f"{side} {path}: cannot load a tokenizer ({' '.join(str(e).split())})") from None
    backend = require_fast(tok, side)
    backend.no_truncation()
    backend.no_padding()
    return tok
