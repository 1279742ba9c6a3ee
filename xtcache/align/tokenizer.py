"""The aligner's view of a tokenizer: each token's bytes and special-token role, and encoding with offsets.

`tokenizer_info` builds a `TokenizerInfo` once per fast tokenizer (the UTF-8 bytes each token
stands for, its role bits, which tokens are special or added); `encode_flat` encodes a batch with
the Rust backend, keeping whitespace in offsets where the tokenizer's post-processor would trim it.
The chunk walk (`xtcache.align.chunks`) and the byte check (`xtcache.align.bytes`) read these tables.

    python -c "from xtcache.align.tokenizer import tokenizer_info; help(tokenizer_info)"
"""

from __future__ import annotations

import json
import logging
import weakref
from dataclasses import dataclass
from itertools import chain

import numpy as np

from xtcache.errors import AlignmentError
from xtcache.fingerprint import tokenizer_fingerprint

log = logging.getLogger(__name__)

# Role bits of special tokens; two specials pair when their role bits intersect.
ROLE_BOS, ROLE_EOS, ROLE_PAD, ROLE_UNK, ROLE_SEP, ROLE_CLS, ROLE_OTHER = 1, 2, 4, 8, 16, 32, 64
_ROLE_ATTRS = (("bos_token_id", ROLE_BOS), ("eos_token_id", ROLE_EOS), ("pad_token_id", ROLE_PAD),
               ("unk_token_id", ROLE_UNK), ("sep_token_id", ROLE_SEP), ("cls_token_id", ROLE_CLS))


@dataclass(frozen=True, eq=False)
class TokenizerInfo:
    """Per-vocabulary tables the aligner needs, built once per tokenizer by `tokenizer_info`.

    `piece_data[piece_start[i]:piece_start[i+1]]` are the UTF-8 bytes token `i` stands for in the
    text (byte-level and `<0xNN>` byte-fallback pieces decoded, `▁` turned into a space). Entry `V`
    (one past the vocabulary) is the aligner's document separator, spelled "\\x00".
    """

    fingerprint: str
    piece_data: np.ndarray  # uint8 [total bytes + 8 zero bytes of padding]
    piece_start: np.ndarray  # int64 [V + 2]
    role: np.ndarray  # int32 [V + 1]: role bits, 0 for ordinary tokens
    control: np.ndarray  # bool [V + 1]: what a decode with skip_special_tokens leaves out: the special ids (but unk)
    # and every added token marked special (Llama-3's <|reserved_special_token_N|>, `<s>` of a tokenizer whose bos is
    # another): never the text its name spells
    added: np.ndarray  # bool [V + 1]: added tokens (matched literally in the text)
    unk_id: int  # -1 when the tokenizer has no unknown token
    metaspace: bool = False  # SentencePiece style: a literal "▁" in the text reads as a space
    trims_offsets: bool = False  # post-processor trims whitespace off offsets (trim_offsets=True)

    @property
    def vocab_size(self) -> int:
        return int(self.piece_start.shape[0] - 2)


def _byte_decoder() -> dict[str, int]:
    """Inverse of the byte-level BPE alphabet: printable bytes stand for themselves, the other 68
    byte values for the characters 256, 257, ... in byte order."""
    printable = [b for b in range(256) if 0x21 <= b <= 0x7E or 0xA1 <= b <= 0xAC or 0xAE <= b <= 0xFF]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(others)}}


def _decoder_kinds(decoder: dict | None) -> set[str]:
    """Decoder types in a spec; a Replace of "▁" (the Llama-2 conversion) counts as Metaspace."""
    if decoder is None or decoder.get("type") == "Sequence":
        return {k for d in (decoder or {}).get("decoders", []) for k in _decoder_kinds(d)}
    is_meta = decoder.get("type") == "Replace" and decoder.get("pattern", {}).get("String") == "▁"
    return {"Metaspace" if is_meta else decoder.get("type", "")}


_INFO_CACHE: "weakref.WeakKeyDictionary[object, TokenizerInfo]" = weakref.WeakKeyDictionary()
_UNTRIMMED: "weakref.WeakKeyDictionary[object, object]" = weakref.WeakKeyDictionary()


def _cached(cache: weakref.WeakKeyDictionary, tokenizer, build):
    """cache[tokenizer], built on first use (tokenizers that cannot be weakly referenced: uncached)."""
    try:
        return cache[tokenizer]
    except (KeyError, TypeError):
        value = build()
    try:
        cache[tokenizer] = value
    except TypeError:
        pass
    return value


def _untrim(node):
    """A post-processor spec with every `trim_offsets` turned off (equal to `node` if none was on)."""
    if isinstance(node, dict):
        return {k: (False if k == "trim_offsets" else _untrim(v)) for k, v in node.items()}
    if isinstance(node, list):
        return [_untrim(v) for v in node]
    return node


def _offsets_backend(tokenizer, backend):
    """The backend to encode with: a copy that keeps whitespace in offsets when the tokenizer's
    post-processor trims it (token ids are the same; only offsets differ). Cached per tokenizer."""
    def build():
        from tokenizers import Tokenizer

        spec = json.loads(backend.to_str())
        if _untrim(spec.get("post_processor")) == spec.get("post_processor"):
            return backend
        log.info("tokenizer trims whitespace off offsets (trim_offsets=True): encoding with an untrimmed copy")
        return Tokenizer.from_str(json.dumps({**spec, "post_processor": _untrim(spec["post_processor"])}))

    return _cached(_UNTRIMMED, tokenizer, build)


def require_fast(tokenizer, side: str = "tokenizer"):
    """The Rust backend of a transformers fast tokenizer; AlignmentError for slow ones."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not getattr(tokenizer, "is_fast", True):
        raise AlignmentError(
            f"the {side} ({type(tokenizer).__name__}) is a slow tokenizer without character offsets: "
            "load it with AutoTokenizer.from_pretrained(..., use_fast=True) from a directory with tokenizer.json")
    return backend


def tokenizer_info(tokenizer) -> TokenizerInfo:
    """The byte pieces and roles of a fast tokenizer (built once per tokenizer object)."""
    return _cached(_INFO_CACHE, tokenizer, lambda: _build_info(tokenizer))


def _build_info(tokenizer) -> TokenizerInfo:
    backend = require_fast(tokenizer)
    spec = json.loads(backend.to_str())
    kinds = _decoder_kinds(spec.get("decoder"))
    byte_level = "ByteLevel" in kinds
    metaspace = "Metaspace" in kinds
    if not (byte_level or metaspace):
        raise AlignmentError(
            f"tokenizer decoder {sorted(kinds) or 'none'} is not supported for alignment: xtcache aligns "
            "byte-level BPE (GPT-2/Llama-3/Qwen style) and SentencePiece-style (Metaspace, byte fallback) tokenizers")
    vocab_size = len(tokenizer)
    added = {int(i): t.content for i, t in tokenizer.added_tokens_decoder.items()}
    byte_map = _byte_decoder()
    pieces: list[bytes] = []
    for i, tok in enumerate(tokenizer.convert_ids_to_tokens(list(range(vocab_size)))):
        if i in added:
            pieces.append(added[i].encode("utf-8"))
        elif tok is None:
            pieces.append(b"")
        elif byte_level:
            pieces.append(bytes(byte_map.get(ch, 0x3F) for ch in tok) if all(ch in byte_map for ch in tok)
                          else tok.encode("utf-8"))
        elif len(tok) == 6 and tok.startswith("<0x") and tok.endswith(">"):
            pieces.append(bytes([int(tok[3:5], 16)]))
        else:
            pieces.append(tok.replace("▁", " ").encode("utf-8"))
    pieces.append(b"\x00")  # the separator between documents of a batch
    lengths = np.fromiter((len(p) for p in pieces), dtype=np.int64, count=vocab_size + 1)
    piece_start = np.zeros(vocab_size + 2, dtype=np.int64)
    np.cumsum(lengths, out=piece_start[1:])
    piece_data = np.frombuffer(b"".join(pieces) + bytes(8), dtype=np.uint8).copy()  # 8 bytes padding for _words
    role = np.zeros(vocab_size + 1, dtype=np.int32)
    for attr, bit in _ROLE_ATTRS:
        tid = getattr(tokenizer, attr, None)
        if tid is not None and 0 <= tid < vocab_size:
            role[tid] |= bit
    unk_id = tokenizer.unk_token_id if tokenizer.unk_token_id is not None else -1
    special = np.zeros(vocab_size + 1, dtype=bool)
    special[[i for i in tokenizer.all_special_ids if 0 <= i < vocab_size and i != unk_id]] = True
    role[special & (role == 0)] = ROLE_OTHER
    added_mask = np.zeros(vocab_size + 1, dtype=bool)
    added_mask[[i for i in added if i < vocab_size]] = True
    control = special.copy()
    control[[int(i) for i, t in tokenizer.added_tokens_decoder.items() if t.special and 0 <= int(i) < vocab_size]] = True
    return TokenizerInfo(fingerprint=tokenizer_fingerprint(tokenizer), piece_data=piece_data,
                         piece_start=piece_start, role=role, control=control, added=added_mask,
                         unk_id=unk_id,
                         metaspace=metaspace and not byte_level,
                         trims_offsets=_untrim(spec.get("post_processor")) != spec.get("post_processor"))


def encode_with_offsets(tokenizer, text: str, *, add_special_tokens: bool = True, side: str = "tokenizer"):
    """(ids int64 [N], offsets int64 [N, 2]) from a fast tokenizer's Rust backend, no truncation."""
    ids, offsets, _ = encode_flat(tokenizer, [text], add_special_tokens=add_special_tokens, side=side)
    return ids, offsets


def encode_flat(tokenizer, texts: list[str], *, add_special_tokens: bool, side: str):
    """Flat ids int64 [N], offsets int64 [N, 2] and per-document counts int64 [D] for a batch."""
    backend = _offsets_backend(tokenizer, require_fast(tokenizer, side))
    if backend.truncation is not None:
        raise AlignmentError(f"the {side} has truncation enabled ({backend.truncation}): alignment needs the "
                             "whole text; call tokenizer.backend_tokenizer.no_truncation() first")
    encs = backend.encode_batch(texts, add_special_tokens=add_special_tokens) if len(texts) > 1 else \
        [backend.encode(texts[0], add_special_tokens=add_special_tokens)]
    counts = np.fromiter((len(e.ids) for e in encs), dtype=np.int64, count=len(encs))
    total = int(counts.sum())
    ids = np.fromiter(chain.from_iterable(e.ids for e in encs), dtype=np.int64, count=total)
    offsets = np.fromiter(chain.from_iterable(chain.from_iterable(e.offsets for e in encs)), dtype=np.int64,
                          count=2 * total).reshape(-1, 2)
    return ids, offsets, counts
