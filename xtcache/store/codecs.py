"""Transforms that make teacher top-k data small, and the Zarr compressors that follow them.

Every codec is a small frozen dataclass with `to_config()` -> `{"name": ..., "configuration": {...}}`
and `codec_from_config()` to read it back; the configuration is recorded in the store (array specs
in each part's index and the manifest), so a reader never guesses how bytes were produced.

- `SortedDeltaIds`: each row of top-k ids is sorted by id and delta coded (first id absolute, then
  differences). Deltas are small, so the compressor squeezes them; in full mode (k = V) every delta
  after the first is 1. The row permutation is returned so values can follow their ids.
- `DictDeltaIds` (format version 4, topk mode): the same, over codes into a per-part dictionary of the
  part's distinct ids, the most frequent first, so that the ids most rows share get small codes and
  small deltas (a real teacher's top-k ids spread over its whole vocabulary).
- `QuantizedLogProbs`: uniform quantization of log-probs over [-L, 0] to `bits`-bit codes with a
  stated maximum absolute error `step / 2` for values in [-L, 0]; values below -L are clamped to -L.
- `SqrtProbs` (format version 3): uniform quantization of sqrt(p) to `levels` + 1 codes, i.e. uniform
  in the Fisher metric: every entry carries the same KL error, about 1 / (6 levels^2) nats, whatever
  its probability (a log-prob code spends its levels on log-probs below -10 that carry no mass).
- `FloatLogProbs`: lossless float32, or float16 (relative error <= 2^-11).
- `DeltaCharOffsets` (format version 3): each token's (start, end) character offsets stored as (start
  minus the previous token's end in its document, end minus start): small numbers, lossless.
- `Compression`: the Zarr v3 bytes-to-bytes codecs (zstd, optionally inside blosc with byte/bit
  shuffle) applied to the transformed arrays.

    python bench/store_codec.py     # sizes, KL error and speed of these codecs on a real teacher
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from schemas.arrays import entry_widths
from schemas.models import FORMAT_VERSION
from xtcache.errors import CorruptionError, StoreError, XtcacheError

IDS_NAME = "xtcache.sorted_delta_ids"
QUANT_NAME = "xtcache.quantized_logprobs"
FLOAT_NAME = "xtcache.float_logprobs"
SQRT_NAME = "xtcache.sqrt_probs"
OFFSETS_NAME = "xtcache.delta_char_offsets"
DICT_IDS_NAME = "xtcache.dict_delta_ids"


def check_ids(ids: np.ndarray, vocab_size: int, what: str = "top-k ids") -> None:
    """Raise XtcacheError unless every id is in [0, vocab_size)."""
    if ids.size == 0:
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise XtcacheError(
            f"{what}: id {bad} is outside the teacher vocabulary [0, {vocab_size}); "
            "check that the teacher vocab size (lm_head columns minus padding) matches the tokenizer")


@dataclass(frozen=True)
class SortedDeltaIds:
    """Sort each row of ids ascending and store first id + successive differences.

    `head` > 0 (headtail stores): the first `head` ids of a row and the others are two runs, each sorted
    and delta coded on its own (the second run's first id absolute), so that a reader knows an entry
    of the head from one of the tail by its position. `head` 0 (every other mode) leaves the config as
    it always was.
    """

    dtype: str = "uint32"
    head: int = 0

    def to_config(self) -> dict[str, Any]:
        cfg = asdict(self)
        if not self.head:
            del cfg["head"]
        return {"name": IDS_NAME, "configuration": cfg}

    def runs(self, k: int) -> list[slice]:
        """The column ranges of a row of width `k` that are sorted and delta coded apart."""
        return [slice(0, k)] if not self.head else [slice(0, self.head), slice(self.head, k)]

    def encode(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """ids int [P, k] -> (deltas [P, k] of self.dtype, order [P, k] row permutation applied)."""
        order = np.empty(ids.shape, dtype=np.intp)
        deltas = np.empty(ids.shape, dtype=np.int64)
        for run in self.runs(ids.shape[1]):
            o = np.argsort(ids[:, run], axis=1, kind="stable")
            s = np.take_along_axis(ids[:, run], o, axis=1).astype(np.int64)  # [P, run] ascending
            order[:, run] = o + run.start
            deltas[:, run] = s
            deltas[:, run][:, 1:] = s[:, 1:] - s[:, :-1]
        if deltas.size and int(deltas.max()) > np.iinfo(self.dtype).max:
            raise XtcacheError(f"id delta {int(deltas.max())} does not fit {self.dtype}; use dtype uint32")
        return deltas.astype(self.dtype), order

    def decode(self, deltas: np.ndarray, *, overwrite: bool = False) -> np.ndarray:
        """deltas [P, k] -> ids int32 [P, k], each row (each run of a row) ascending.

        `overwrite`: the caller no longer needs `deltas`, so uint32 deltas are summed in their own memory
        (the same bits as int32) instead of into a new P x k array (a read of a part at k=64 spends
        about as long faulting in that array's pages as summing it).
        """
        if overwrite and deltas.dtype == np.uint32 and deltas.flags.c_contiguous and deltas.flags.writeable:
            ids = deltas.view(np.int32)
            for run in self.runs(deltas.shape[1]):
                np.cumsum(ids[:, run], axis=1, out=ids[:, run])
            return ids
        if not self.head:
            return np.cumsum(deltas, axis=1, dtype=np.int32)
        ids = np.empty(deltas.shape, dtype=np.int32)
        for run in self.runs(deltas.shape[1]):
            np.cumsum(deltas[:, run], axis=1, dtype=np.int32, out=ids[:, run])
        return ids


@dataclass(frozen=True)
class DictDeltaIds:
    """Top-k ids as codes into a dictionary of the part's distinct ids; each row sorted by code and delta coded.

    The dictionary (`dictionary`, stored as the part's `topk_id_dict`) lists the ids in groups of equal
    floor(log2(count)), their count being the entries of the part that hold them, larger counts first and
    ascending by id within a group: the few thousand ids that fill most rows of a real teacher get codes
    below a few thousand, and a row sorted by code has small gaps. Any order of distinct ids decodes; this
    one measured smallest with the codes (bench/store_codec.py). Decoded rows are ascending by code, so in
    no fixed id order: a row is a set of ids, each with its value.
    """

    dtype: str = "uint32"

    def to_config(self) -> dict[str, Any]:
        return {"name": DICT_IDS_NAME, "configuration": asdict(self)}

    @staticmethod
    def dictionary(ids: np.ndarray) -> np.ndarray:
        """int32 [U]: the distinct ids of `ids` (int [P, k]), in the order described above."""
        counts = np.bincount(np.asarray(ids, dtype=np.int64).reshape(-1), minlength=1)
        used = np.flatnonzero(counts)
        group = np.frexp(counts[used].astype(np.float64))[1]  # floor(log2(count)) + 1, exact for any count
        return used[np.lexsort((used, -group))].astype(np.int32)

    def encode(self, ids: np.ndarray, dictionary: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """ids int [P, k] (each in `dictionary`) -> (code deltas [P, k] of self.dtype, order [P, k] row permutation)."""
        code_of = np.zeros(int(dictionary.max(initial=0)) + 1, np.int64)
        code_of[dictionary] = np.arange(dictionary.size)
        codes = code_of[ids]  # [P, k]
        order = np.argsort(codes, axis=1, kind="stable")
        s = np.take_along_axis(codes, order, axis=1)  # [P, k] ascending codes
        deltas = s.copy()
        deltas[:, 1:] = s[:, 1:] - s[:, :-1]
        if deltas.size and int(deltas.max()) > np.iinfo(self.dtype).max:
            raise XtcacheError(f"id code delta {int(deltas.max())} does not fit {self.dtype}; use dtype uint32")
        return deltas.astype(self.dtype), order

    def decode(self, deltas: np.ndarray, dictionary: np.ndarray) -> np.ndarray:
        """Code deltas [P, k] and the decoded dictionary [U] -> ids int32 [P, k]; CorruptionError when a row's
        codes leave the dictionary (damaged deltas or dictionary).

        Rows are summed and looked up in blocks of 64k entries, whose intp codes stay in cache (one pass
        over the part, 2x faster on one core than a cumulative sum and a lookup over the whole part). The
        deltas are unsigned, so each row's codes ascend and its last is its largest: the only one checked.
        """
        P, k = deltas.shape
        if deltas.size and not dictionary.size:
            raise CorruptionError("array 'topk_ids' holds codes but its dictionary ('topk_id_dict') is empty")
        out = np.empty((P, k), np.int32)
        rows = max(1, _IDS_BLOCK // max(k, 1))
        codes = np.empty((min(rows, P), k), np.intp)
        largest = -1
        for lo in range(0, P, rows):
            block = codes[:min(rows, P - lo)]
            np.cumsum(deltas[lo:lo + rows], axis=1, out=block)
            if k:
                largest = max(largest, int(block[:, -1].max()))
            np.take(dictionary, block, out=out[lo:lo + rows], mode="clip")  # never clips: checked below
        if largest >= dictionary.size:
            raise CorruptionError(f"array 'topk_ids' decodes to code {largest}, outside its dictionary of "
                                  f"{dictionary.size} ids ('topk_id_dict')")
        return out

    @staticmethod
    def encode_dictionary(dictionary: np.ndarray) -> np.ndarray:
        """int32 [U] -> int32 [U] stored: the first id, then each id minus the one before (negative where a group
        starts), small numbers within a group."""
        return np.diff(dictionary.astype(np.int32), prepend=np.int32(0))

    @staticmethod
    def decode_dictionary(stored: np.ndarray) -> np.ndarray:
        return np.cumsum(stored, dtype=np.int32)


def id_runs_problem(codec, mode: str, top_k: int | None, format_version: int = FORMAT_VERSION) -> str | None:
    """What is wrong with a store's id transform for its mode (None: nothing): a headtail store's ids
    are two runs split after the manifest's `top_k`; every other mode's are one run; dictionary coded ids
    are those of topk stores of format version 4 and later only."""
    if isinstance(codec, DictDeltaIds):
        if mode != "topk" or format_version < 4:
            return (f"the transform of 'topk_ids' is {DICT_IDS_NAME}, which only topk stores of format version 4 "
                    f"and later use (this one: mode {mode}, format version {format_version})")
        return None
    if not isinstance(codec, SortedDeltaIds):
        return f"the transform of 'topk_ids' is {codec.to_config()['name']}, which codes no ids"
    want = top_k if mode == "headtail" else 0
    if codec.head != want:
        return f"the transform of 'topk_ids' splits rows after {codec.head} ids, mode {mode} needs {want}"
    return None


@dataclass(frozen=True)
class QuantizedLogProbs:
    """code = round(-x / step) clipped to [0, 2^bits - 1], step = min_logprob_abs / (2^bits - 1)."""

    bits: int = 8
    min_logprob: float = -24.0

    def __post_init__(self):
        if self.bits not in (8, 16):
            raise XtcacheError(f"quantized log-probs: bits={self.bits}: use 8 or 16")
        if not self.min_logprob < 0:
            raise XtcacheError(f"quantized log-probs: min_logprob={self.min_logprob}: must be negative")

    @property
    def dtype(self) -> str:
        return "uint8" if self.bits == 8 else "uint16"

    @property
    def levels(self) -> int:
        return (1 << self.bits) - 1

    @property
    def step(self) -> float:
        return -self.min_logprob / self.levels

    @property
    def max_abs_error(self) -> float:
        """Bound on |decoded - original| for originals in [min_logprob, 0].

        Exact-arithmetic bound step / 2; the float32 decoded value adds at most |min_logprob| * 2^-24.
        """
        return self.step / 2

    def to_config(self) -> dict[str, Any]:
        cfg = asdict(self)
        cfg["step"] = self.step
        cfg["max_abs_error"] = self.max_abs_error
        return {"name": QUANT_NAME, "configuration": cfg}

    def encode(self, logprobs: np.ndarray) -> np.ndarray:
        x = np.nan_to_num(np.asarray(logprobs, dtype=np.float64), nan=self.min_logprob,
                          neginf=self.min_logprob, posinf=0.0)
        codes = np.rint(x * (-1.0 / self.step))  # float64: the nearest code exactly
        np.clip(codes, 0, self.levels, out=codes)
        return codes.astype(self.dtype)

    def decode(self, codes: np.ndarray) -> np.ndarray:
        out = codes.astype(np.float32)
        out *= np.float32(-self.step)
        return out


@dataclass(frozen=True)
class SqrtProbs:
    """code = round(sqrt(exp(x)) * levels) in uint8; decoded log-prob 2 * log(code / levels).

    Code 0 (p < 1 / (2 levels)^2) decodes to sqrt(p) = 1 / (4 levels), the middle of its bin, so
    every decoded log-prob is finite. Error per entry, stated in the codec config: |sqrt(p') - sqrt(p)|
    <= 1 / (2 levels) (`max_sqrt_error`); its KL contribution is 2 (sqrt(p') - sqrt(p))^2 to second
    order, at most 1 / (2 levels^2) and on average 1 / (6 levels^2) (`mean_kl_per_entry`).
    """

    levels: int = 127
    dtype = "uint8"  # the stored dtype (a class constant, not a field)

    def __post_init__(self):
        if not 1 <= self.levels <= 255:
            raise XtcacheError(f"sqrt-prob codes: levels={self.levels}: use 1..255 (uint8 codes)")

    @property
    def max_sqrt_error(self) -> float:
        return 0.5 / self.levels

    @property
    def mean_kl_per_entry(self) -> float:
        return 1.0 / (6.0 * self.levels**2)

    def to_config(self) -> dict[str, Any]:
        return {"name": SQRT_NAME, "configuration": {
            "levels": self.levels, "max_sqrt_error": self.max_sqrt_error, "mean_kl_per_entry": self.mean_kl_per_entry}}

    def encode(self, logprobs: np.ndarray) -> np.ndarray:
        """log-probs float [...] -> uint8 codes [...]; NaN and -inf encode as 0, +inf as `levels`."""
        x = np.nan_to_num(np.asarray(logprobs, dtype=np.float64), nan=-np.inf, posinf=0.0)
        codes = np.rint(np.exp(0.5 * np.minimum(x, 0.0)) * self.levels)
        return codes.astype(np.uint8)

    def table(self) -> np.ndarray:
        """float32 [256]: the decoded log-prob of each code (codes above `levels` decode as `levels`)."""
        s = np.minimum(np.arange(256, dtype=np.float64), self.levels) / self.levels
        s[0] = 0.25 / self.levels
        return (2.0 * np.log(s)).astype(np.float32)

    def decode(self, codes: np.ndarray) -> np.ndarray:
        """uint8 codes [...] -> float32 log-probs [...]: a table lookup, two entries at a time.

        A pair of codes read as one little-endian uint16 indexes a table of 65,536 float32 pairs (512 KiB),
        so the gather moves 8 bytes per index: 3-4x faster than one lookup per entry on one core. The
        indices are widened to intp in blocks that stay in cache rather than in one array as large as the output.
        """
        codes = np.ascontiguousarray(codes, dtype=np.uint8)
        if codes.size % 2:
            return self.table()[codes]
        table, index = _pair_table(self.levels), codes.reshape(-1).view("<u2")
        pairs = np.empty(index.size, np.float64)  # [size / 2]
        # mode "clip" never clips (a uint16 indexes all 65,536 entries); the default "raise" would buffer `out`
        for lo in range(0, index.size, _DECODE_BLOCK):
            block = slice(lo, lo + _DECODE_BLOCK)
            np.take(table, index[block].astype(np.intp), out=pairs[block], mode="clip")
        return pairs.view(np.float32).reshape(codes.shape)


_DECODE_BLOCK = 1 << 16  # code pairs per block of `SqrtProbs.decode` (512 KiB of intp indices)
_IDS_BLOCK = 1 << 16  # entries per block of `DictDeltaIds.decode` (512 KiB of intp codes)


@functools.lru_cache(maxsize=4)
def _pair_table(levels: int) -> np.ndarray:
    """float64 [65536] whose bytes are the float32 pair (table[lo], table[hi]) of index lo + 256 hi."""
    one = SqrtProbs(levels).table()
    pair = np.empty((256, 256, 2), "<f4")  # [hi, lo, (first, second)]
    pair[..., 0] = one[None, :]
    pair[..., 1] = one[:, None]
    return pair.reshape(-1).view("<f8")


@dataclass(frozen=True)
class FloatLogProbs:
    """Log-probs stored as float32 (lossless) or float16."""

    dtype: str = "float32"

    def __post_init__(self):
        if self.dtype not in ("float16", "float32"):
            raise XtcacheError(f"float log-probs: dtype={self.dtype!r}: use 'float16' or 'float32'")

    def to_config(self) -> dict[str, Any]:
        return {"name": FLOAT_NAME, "configuration": asdict(self)}

    def encode(self, logprobs: np.ndarray) -> np.ndarray:
        return np.asarray(logprobs).astype(self.dtype)

    def decode(self, stored: np.ndarray) -> np.ndarray:
        return stored.astype(np.float32)


@dataclass(frozen=True)
class DeltaCharOffsets:
    """(start, end) [P, 2] -> (start - previous end, end - start) int32 [P, 2]; each document's first token
    counts from 0. Lossless; decoding needs the part's `doc_pos_offsets`."""

    dtype = "int32"  # the stored dtype (a class constant, not a field)

    def to_config(self) -> dict[str, Any]:
        return {"name": OFFSETS_NAME, "configuration": {}}

    def encode(self, offsets: np.ndarray, doc_pos_offsets: np.ndarray) -> np.ndarray:
        offsets = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
        prev_end = np.zeros(len(offsets), np.int64)
        prev_end[1:] = offsets[:-1, 1]
        prev_end[doc_pos_offsets[:-1][np.diff(doc_pos_offsets) > 0]] = 0  # a document's first token
        return np.stack([offsets[:, 0] - prev_end, offsets[:, 1] - offsets[:, 0]], 1).astype(np.int32)

    def decode(self, stored: np.ndarray, doc_pos_offsets: np.ndarray) -> np.ndarray:
        """int32 [P, 2] -> int32 [P, 2] (start, end): a cumulative sum restarted at each document."""
        ends = stored[:, 0].astype(np.int64)  # [P] end_t - end_{t-1}: the gap before the token plus its length
        ends += stored[:, 1]
        np.cumsum(ends, out=ends)
        starts_at = doc_pos_offsets[:-1]
        before = np.where(starts_at > 0, ends[np.maximum(starts_at - 1, 0)] if len(ends) else 0, 0)
        ends -= np.repeat(before, np.diff(doc_pos_offsets))
        out = np.empty(stored.shape, np.int32)  # filled column by column (a [P, 2] reduction or stack is slow)
        out[:, 1] = ends
        np.subtract(ends, stored[:, 1], out=out[:, 0], casting="unsafe")
        return out


@dataclass(frozen=True)
class Compression:
    """Zarr v3 bytes-to-bytes codecs: zstd at `level`, optionally behind a blosc shuffle over blocks of
    `blocksize` bytes (0: blosc's choice, smaller than a 1 MiB inner chunk)."""

    level: int = 3
    shuffle: str = "none"  # "none" | "byte" | "bit"
    blocksize: int = 0

    def __post_init__(self):
        if self.shuffle not in ("none", "byte", "bit"):
            raise XtcacheError(f"compression shuffle={self.shuffle!r}: use 'none', 'byte' or 'bit'")
        if self.blocksize < 0 or (self.blocksize and self.shuffle == "none"):
            raise XtcacheError(f"compression blocksize={self.blocksize}: a byte count >= 0, with a shuffle")

    def zarr_codecs(self, itemsize: int) -> list:
        import zarr.codecs as zc

        if self.shuffle == "none":
            return [zc.ZstdCodec(level=self.level)]
        shuffle = "shuffle" if self.shuffle == "byte" else "bitshuffle"
        return [zc.BloscCodec(cname="zstd", clevel=self.level, shuffle=shuffle, typesize=itemsize,
                              blocksize=self.blocksize)]

    def to_config(self) -> dict[str, Any]:
        return {"name": "xtcache.compression", "configuration": asdict(self)}


LogProbCodec = QuantizedLogProbs | SqrtProbs | FloatLogProbs


def codec_from_config(cfg: dict[str, Any] | Any):
    """Rebuild a transform codec from its `{"name", "configuration"}` form (dict or CodecConfig)."""
    if not isinstance(cfg, dict):
        cfg = cfg.model_dump()
    name, conf = cfg["name"], dict(cfg.get("configuration", {}))
    if name == IDS_NAME:
        return SortedDeltaIds(**conf)
    if name == QUANT_NAME:
        return QuantizedLogProbs(bits=conf["bits"], min_logprob=conf["min_logprob"])
    if name == FLOAT_NAME:
        return FloatLogProbs(**conf)
    if name == SQRT_NAME:
        return SqrtProbs(levels=conf["levels"])
    if name == OFFSETS_NAME:
        return DeltaCharOffsets()
    if name == DICT_IDS_NAME:
        return DictDeltaIds(**conf)
    if name == "xtcache.compression":
        return Compression(**conf)
    raise StoreError(f"unknown codec {name!r}: this store was written by a newer xtcache; upgrade xtcache")


def default_codecs(mode: str, vocab_size: int, format_version: int = FORMAT_VERSION,
                   k: int = 64, top_k: int | None = None) -> dict[str, dict[str, Any]]:
    """The transforms a store of `format_version` uses unless the manifest names others (headtail
    mode: `top_k`, the head's width, which the ids' two runs and the log-probs' width are).

    Top-k ids from version 4 in topk mode: dictionary codes (`DictDeltaIds`), 69 -> 51 B/position on a real
    teacher at k=64 (bench/store_codec.py --teacher real). Full mode (every id, deltas all 1), sampled mode
    (padding repeats an id) and headtail mode (two runs) keep ids sorted by id.

    Top-k (and headtail heads') log-probs from version 3: sqrt(p) in 127 levels up to 64 entries and 255 above, so that the mean
    KL error, k / (6 levels^2), stays under 1e-3 nats (6.6e-4 at k=64 and at k=256; bench/store_codec.py).
    Full mode and stores before version 3 keep 8-bit log-probs: code 0 of the sqrt code decodes to a
    probability of 1 / (16 levels^2), which over a whole vocabulary of near-zero entries would add
    mass (0.12 over 32k ids at 127 levels), while -24 adds 3.8e-11 per id.
    """
    widths = entry_widths(mode, k, top_k)
    id_dtype = "uint16" if vocab_size <= 65536 else "uint32"
    ids = SortedDeltaIds(dtype=id_dtype, head=widths["k_head"] if mode == "headtail" else 0)
    if format_version >= 4 and mode == "topk":
        ids = DictDeltaIds(dtype=id_dtype)
    out = {"topk_ids": ids.to_config()}
    if mode != "sampled":
        values = QuantizedLogProbs(bits=8, min_logprob=-24.0)
        if format_version >= 3 and mode in ("topk", "headtail"):  # headtail: the head's values
            values = SqrtProbs(127 if widths["k_head"] <= 64 else 255)
        out["topk_logprobs"] = values.to_config()
    if format_version >= 3:
        out["char_offsets"] = DeltaCharOffsets().to_config()
    return out


def side_dtype(format_version: int = FORMAT_VERSION) -> str:
    """Stored dtype of `residual` and `realized_logprob`: float16 from format version 3 (relative error
    at most 2^-11, NaN kept), float32 before. Readers cast either to float32."""
    return "float16" if format_version >= 3 else "float32"
