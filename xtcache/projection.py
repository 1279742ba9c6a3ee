"""Student->teacher sparse projection map W: build from two tokenizers, import, save, load, inspect.

Row `s` of W says which teacher tokens a student token stands for: `indices[s]` are up to k teacher
ids (-1 = padding) and `weights[s]` their weights, summing to 1 (0 for a row with no mapping).
W is built from the tokenizers alone:

1. exact matches: the student token spells exactly the bytes of a teacher token (byte-level `Ġ`,
   SentencePiece `▁` and `<0xNN>` pieces are compared as the bytes they stand for): weight 1;
2. the other tokens are decomposed both ways: the student token's text encoded by the teacher
   tokenizer, and every teacher token's text encoded by the student tokenizer, credited back to the
   student pieces (scaled by `reverse_scale`). With `pieces="first"` (the default) only the first
   piece counts: a student token stands for the first teacher token of its text, the event that
   P-KL's first rows compare (docs/losses.md); with `pieces="all"` piece j is weighted `decay**j`;
3. control tokens (special ids, and every added token marked special: Llama-3's 251 reserved tokens)
   map to the teacher's token of the same text, else by role (bos, eos, pad, unk), else nowhere (an
   empty row: their probability counts in the rest bucket). They are never decomposed: the text of
   their name (`<|reserved_special_token_0|>`) is not what they stand for, and a row on the teacher's
   `<` would let a student meet the teacher's `<` with probability on control tokens;
4. rows are cut to the top k and renormalized.

Vocabulary sizes are `len(tokenizer)`: lm_head columns beyond it (Qwen3 pads 151,669 tokens to
151,936 columns) are never targets. Files are safetensors with both tokenizer fingerprints in the
metadata; `load(expect_student=..., expect_teacher=...)` refuses a map built for other tokenizers.

    xtcache projection build --student-tokenizer S --teacher-tokenizer T --out w.safetensors
    xtcache projection inspect w.safetensors
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from xtcache.align.tokenizer import ROLE_BOS, ROLE_EOS, ROLE_PAD, ROLE_UNK, TokenizerInfo, tokenizer_info
from xtcache.errors import ProjectionError

log = logging.getLogger(__name__)

FORMAT = "xtcache-projection/2"
# /1: written before control tokens were kept out of decomposition (their rows could point at the teacher's `<`)
OLD_FORMATS = {"xtcache-projection/1": "its control-token rows may stand for the teacher's `<` (docs/losses.md, P-KL)"}
ROLE_NAMES = {ROLE_BOS: "bos", ROLE_EOS: "eos", ROLE_PAD: "pad", ROLE_UNK: "unk"}


@dataclass
class ProjectionMap:
    """Sparse student->teacher map; see the module docstring for the meaning of the rows."""

    indices: np.ndarray  # int64 [V_s, k] teacher ids, -1 = padding
    weights: np.ndarray  # float32 [V_s, k] rows sum to 1 (0 for padding)
    student_fingerprint: str
    teacher_fingerprint: str
    exact: np.ndarray | None = None  # bool [V_s]: row is an exact string match (weight 1 on one id)
    teacher_vocab_size: int = -1  # len(teacher tokenizer); -1 when unknown
    notes: dict = field(default_factory=dict)  # build report (not saved)

    def __post_init__(self):
        self.indices = np.asarray(self.indices, dtype=np.int64)
        self.weights = np.asarray(self.weights, dtype=np.float32)
        if self.exact is None:
            self.exact = np.zeros(self.indices.shape[0], dtype=bool)
        self.exact = np.asarray(self.exact, dtype=bool)
        validate(self.indices, self.weights, self.teacher_vocab_size, where="projection map")
        if self.exact.shape != (self.indices.shape[0],):
            raise ProjectionError(f"projection map: exact has shape {self.exact.shape}, expected ({self.indices.shape[0]},)")

    @property
    def student_vocab_size(self) -> int:
        return int(self.indices.shape[0])

    @property
    def top_k(self) -> int:
        return int(self.indices.shape[1])

    def save(self, path: str | Path) -> None:
        from safetensors.numpy import save_file

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        save_file({"indices": self.indices, "weights": self.weights, "exact": self.exact}, str(tmp), metadata={
            "format": FORMAT, "student_fingerprint": self.student_fingerprint,
            "teacher_fingerprint": self.teacher_fingerprint, "teacher_vocab_size": str(self.teacher_vocab_size)})
        tmp.replace(path)

    @classmethod
    def load(cls, path: str | Path, *, expect_student: str | None = None,
             expect_teacher: str | None = None) -> "ProjectionMap":
        """Read a map written by `save`; ProjectionError if it is malformed or for other tokenizers."""
        from safetensors import safe_open

        path = Path(path)
        if not path.is_file():
            raise ProjectionError(f"no projection map at {path}: build one with `xtcache projection build`")
        try:
            with safe_open(str(path), framework="numpy") as f:
                meta = f.metadata() or {}
                arrays = {k: f.get_tensor(k) for k in f.keys()}
        except Exception as e:  # safetensors raises its own error types for non-safetensors files
            raise ProjectionError(f"{path} is not a safetensors projection map ({e})") from None
        if meta.get("format") in OLD_FORMATS:
            raise ProjectionError(f"{path}: a projection map of format {meta['format']}, which this xtcache no longer "
                                  f"reads: {OLD_FORMATS[meta['format']]}; build it again with `xtcache projection "
                                  "build` (or `xtcache projection import` a NeMo-RL map again)")
        if meta.get("format") != FORMAT or not {"indices", "weights"} <= set(arrays):
            raise ProjectionError(f"{path} is not an xtcache projection map (format {meta.get('format')!r}, "
                                  f"arrays {sorted(arrays)}): build one with `xtcache projection build` or "
                                  "convert a NeMo-RL map with `xtcache projection import`")
        s_fp, t_fp = meta.get("student_fingerprint", ""), meta.get("teacher_fingerprint", "")
        wrong = []
        if expect_student is not None and expect_student != s_fp:
            wrong.append(f"student tokenizer {expect_student[:12]} but the map was built for {s_fp[:12]}")
        if expect_teacher is not None and expect_teacher != t_fp:
            wrong.append(f"teacher tokenizer {expect_teacher[:12]} but the map was built for {t_fp[:12]}")
        if wrong:
            raise ProjectionError(f"projection map {path} does not fit: expected " + "; expected ".join(wrong)
                                  + ": rebuild it for these tokenizers with `xtcache projection build`")
        try:
            return cls(indices=arrays["indices"], weights=arrays["weights"], exact=arrays.get("exact"),
                       student_fingerprint=s_fp, teacher_fingerprint=t_fp,
                       teacher_vocab_size=int(meta.get("teacher_vocab_size", "-1")))
        except ProjectionError as e:
            raise ProjectionError(f"{path}: {e}") from None

    def digest(self) -> str:
        """sha256 of what the map says (format, teacher vocabulary, rows, weights, exact flags): two maps of one
        digest project alike, wherever they were built or saved; a run's summary records it."""
        import hashlib

        h = hashlib.sha256(f"{FORMAT} {self.teacher_vocab_size} {self.indices.shape}".encode())
        for a in (self.indices.astype("<i8"), self.weights.astype("<f4"), self.exact.astype(np.uint8)):
            h.update(np.ascontiguousarray(a).tobytes())
        return h.hexdigest()

    def to_torch_sparse(self, teacher_vocab: int):
        """W as a coalesced sparse COO fp32 tensor [V_s, teacher_vocab] (teacher_vocab may be the
        padded logit width; the padded columns stay empty)."""
        import torch

        if self.teacher_vocab_size > teacher_vocab:
            raise ProjectionError(f"teacher vocab {teacher_vocab} is smaller than the map's teacher tokenizer "
                                  f"({self.teacher_vocab_size} tokens)")
        rows, cols = np.nonzero(self.indices >= 0)
        ids = self.indices[rows, cols]
        if ids.size and ids.max() >= teacher_vocab:
            raise ProjectionError(f"projection map has teacher id {int(ids.max())} >= teacher vocab {teacher_vocab}")
        coo = torch.from_numpy(np.stack([rows, ids]).astype(np.int64))
        values = torch.from_numpy(self.weights[rows, cols].astype(np.float32))
        return torch.sparse_coo_tensor(coo, values, (self.student_vocab_size, teacher_vocab),
                                       check_invariants=True).coalesce()


def validate(indices: np.ndarray, weights: np.ndarray, teacher_vocab: int, *, where: str,
             normalized: bool = True) -> None:
    """ProjectionError unless shapes agree, ids are -1 or in range, weights are non-negative and
    (with `normalized`) every row sums to 1 or is empty."""
    if indices.ndim != 2 or weights.shape != indices.shape:
        raise ProjectionError(f"{where}: indices {tuple(indices.shape)} and weights {tuple(weights.shape)} must be "
                              "the same [student_vocab, k] shape")
    if indices.size and indices.min() < -1:
        raise ProjectionError(f"{where}: negative teacher id {int(indices.min())} (only -1 marks padding)")
    if teacher_vocab >= 0 and indices.size and indices.max() >= teacher_vocab:
        raise ProjectionError(f"{where}: teacher id {int(indices.max())} is outside the teacher vocabulary of "
                              f"{teacher_vocab} tokens: the map was built for another teacher tokenizer")
    if not np.all(np.isfinite(weights)) or np.any(weights < 0):
        raise ProjectionError(f"{where}: weights must be finite and non-negative")
    if np.any(weights[indices < 0] != 0):
        raise ProjectionError(f"{where}: padding entries (-1) must have weight 0")
    if not normalized:
        return
    sums = weights.sum(axis=1)
    bad = ~(np.isclose(sums, 1.0, atol=1e-4) | (sums == 0))
    if np.any(bad):
        r = int(np.flatnonzero(bad)[0])
        raise ProjectionError(f"{where}: row {r} weights sum to {sums[r]:.4f}, expected 1 (or 0 for an empty row)")


def _pieces(info: TokenizerInfo) -> list[bytes]:
    data = info.piece_data.tobytes()
    st = info.piece_start.tolist()
    return [data[st[i]:st[i + 1]] for i in range(info.vocab_size)]


def _decompose(pieces: list[bytes], targets: list[int], tok, other_lookup: dict[bytes, int],
               other_pieces: list[bytes], max_len: int) -> dict[int, list[int]]:
    """Split each target's bytes into tokens of the other tokenizer: its own encoding where that
    reproduces the bytes exactly, else greedy longest-prefix matching over the other vocabulary."""
    texts, ok = [], []
    for i in targets:
        try:
            texts.append(pieces[i].decode("utf-8"))
            ok.append(i)
        except UnicodeDecodeError:
            pass
    out: dict[int, list[int]] = {}
    if texts:
        for i, enc in zip(ok, tok.backend_tokenizer.encode_batch(texts, add_special_tokens=False)):
            got = b"".join(other_pieces[t] for t in enc.ids)
            if got == pieces[i]:  # else (a prepended "▁", a normalizer) fall back to byte matching
                out[i] = list(enc.ids)
    greedy = 0
    for i in targets:
        if i in out or not pieces[i]:
            continue
        b, pos, ids = pieces[i], 0, []
        while pos < len(b):
            for ln in range(min(max_len, len(b) - pos), 0, -1):
                t = other_lookup.get(b[pos:pos + ln])
                if t is not None:
                    ids.append(t)
                    pos += ln
                    break
            else:
                ids = []
                break
        if ids:
            out[i] = ids
            greedy += 1
    log.debug("decomposed %d of %d tokens (%d by greedy byte matching)", len(out), len(targets), greedy)
    return out


def _lookup(tok, info: TokenizerInfo, pieces: list[bytes]) -> dict[bytes, int]:
    """Bytes -> the ordinary token spelling them (lowest id; a regular piece wins over a `<0xNN>`
    byte-fallback piece, as the tokenizer itself prefers it)."""
    names = tok.convert_ids_to_tokens(list(range(info.vocab_size)))
    out: dict[bytes, int] = {}
    for i, p in enumerate(pieces):
        if not p or info.control[i] or i == info.unk_id:
            continue
        fallback = len(names[i] or "") == 6 and names[i].startswith("<0x")
        if p not in out or (not fallback and out[p] < 0):
            out[p] = -i - 1 if fallback else i  # byte-fallback ids stored negated until resolved
    return {p: (-i - 1 if i < 0 else i) for p, i in out.items()}


def build_projection(student_tok, teacher_tok, *, top_k: int = 4, decay: float = 0.5,
                     reverse_scale: float = 0.5, pieces: str = "first") -> ProjectionMap:
    """Build W for two fast tokenizers; `notes` of the result carries the build report.

    `pieces="first"` keeps only the first piece of each decomposition: a student token stands for the
    first teacher token of its text, and is credited with the teacher tokens whose text its own text
    begins (the reverse direction's first pieces)."""
    if top_k < 1:
        raise ValueError(f"--top-k {top_k}: must be at least 1")
    if pieces not in ("first", "all"):
        raise ValueError(f"--pieces {pieces!r}: use first or all")
    keep = 1 if pieces == "first" else None
    s_info, t_info = tokenizer_info(student_tok), tokenizer_info(teacher_tok)
    v_s, v_t = s_info.vocab_size, t_info.vocab_size
    s_pieces, t_pieces = _pieces(s_info), _pieces(t_info)
    t_lookup = _lookup(teacher_tok, t_info, t_pieces)
    s_lookup = _lookup(student_tok, s_info, s_pieces)
    rows, cols, vals = [], [], []
    exact = np.zeros(v_s, dtype=bool)
    ordinary = [i for i in range(v_s) if not s_info.control[i] and i != s_info.unk_id]
    rest = []
    for i in ordinary:
        t = t_lookup.get(s_pieces[i]) if s_pieces[i] else None
        if t is None:
            rest.append(i)
        else:
            exact[i] = True
            rows.append(i), cols.append(t), vals.append(1.0)
    # control tokens (and unk): the teacher's of the same text, else by role
    unmatched_specials = []
    t_special_by_text = {t_pieces[j]: j for j in np.flatnonzero((t_info.role != 0) | t_info.control).tolist()}
    for i in np.flatnonzero((s_info.role != 0) | s_info.control).tolist():
        bits = int(s_info.role[i]) & (ROLE_BOS | ROLE_EOS | ROLE_PAD | ROLE_UNK)
        same = t_special_by_text.get(s_pieces[i])
        added = t_lookup.get(s_pieces[i])
        if same is None and added is not None and t_info.added[added]:
            same = added  # the teacher's added token of that text, not marked special there
        match = [same] if same is not None else np.flatnonzero(t_info.role & bits).tolist()
        if match:
            rows.append(i), cols.append(match[0]), vals.append(1.0)
            exact[i] = same is not None
        else:
            unmatched_specials.append(i)
    # forward decomposition: the student token's text in teacher tokens
    max_t = max((len(p) for p in t_lookup), default=1)
    fwd = _decompose(s_pieces, rest, teacher_tok, t_lookup, t_pieces, max_t)
    for i, ids in fwd.items():
        for j, t in enumerate(ids[:keep]):
            rows.append(i), cols.append(t), vals.append(decay ** j)
    # reverse: every ordinary teacher token's text in student tokens, credited back
    max_s = max((len(p) for p in s_lookup), default=1)
    t_ordinary = [i for i in range(v_t) if not t_info.control[i] and i != t_info.unk_id and t_pieces[i]]
    rev = _decompose(t_pieces, t_ordinary, student_tok, s_lookup, s_pieces, max_s)
    rest_set = set(rest)
    for t, ids in rev.items():
        for j, i in enumerate(ids[:keep]):
            if i in rest_set:
                rows.append(i), cols.append(t), vals.append(reverse_scale * decay ** j)
    indices, weights = _top_k(np.array(rows, dtype=np.int64), np.array(cols, dtype=np.int64),
                              np.array(vals, dtype=np.float64), v_s, v_t, top_k)
    empty = np.flatnonzero(indices[:, 0] < 0)
    notes = {
        "student_vocab": v_s, "teacher_vocab": v_t, "exact": int(exact.sum()),
        "decomposed": len(fwd), "empty_rows": empty.tolist(),
        "specials_without_counterpart": [student_tok.convert_ids_to_tokens(int(i)) for i in unmatched_specials],
    }
    if unmatched_specials:
        names = notes["specials_without_counterpart"]
        log.warning("%d student control tokens with no teacher counterpart (empty rows), e.g. %s", len(names),
                    names[:10])
    unmapped = sorted(set(empty.tolist()) - set(unmatched_specials))
    notes["unmapped_tokens"] = [student_tok.convert_ids_to_tokens(int(i)) for i in unmapped]
    if unmapped:
        log.warning("%d ordinary student tokens map to no teacher token (empty rows), e.g. %s",
                    len(unmapped), notes["unmapped_tokens"][:10])
    return ProjectionMap(indices=indices, weights=weights, exact=exact, student_fingerprint=s_info.fingerprint,
                         teacher_fingerprint=t_info.fingerprint, teacher_vocab_size=v_t, notes=notes)


def _top_k(rows, cols, vals, v_s, v_t, k) -> tuple[np.ndarray, np.ndarray]:
    """Sum duplicate (row, col) weights, keep each row's k largest, renormalize; -1 padded."""
    indices = np.full((v_s, k), -1, dtype=np.int64)
    weights = np.zeros((v_s, k), dtype=np.float32)
    if rows.size == 0:
        return indices, weights
    key, inv = np.unique(rows * v_t + cols, return_inverse=True)
    summed = np.bincount(inv, weights=vals)
    r, c = key // v_t, key % v_t
    order = np.lexsort((c, -summed, r))  # by row, then weight descending, then id
    r, c, w = r[order], c[order], summed[order]
    first = np.searchsorted(r, r, side="left")
    rank = np.arange(r.shape[0]) - first
    keep = rank < k
    indices[r[keep], rank[keep]] = c[keep]
    weights[r[keep], rank[keep]] = w[keep]
    sums = weights.sum(axis=1, keepdims=True)
    np.divide(weights, sums, out=weights, where=sums > 0)
    return indices, weights


def import_nemo(path: str | Path, student_tok, teacher_tok) -> tuple[ProjectionMap, dict]:
    """Read a NeMo-RL projection file (`indices` Long[V_s, k], -1 padded; `likelihoods` Float[V_s, k]).

    Returns the map and what the import changed or found: duplicated teacher ids within a row are
    merged (weights summed; `duplicate_entries_merged`, `rows_with_duplicates`), and rows that map
    to teacher tokens that are not text on their own (byte fragments, U+FFFD when decoded) are
    counted (`rows_targeting_u_fffd`) and kept.
    """
    import torch

    try:
        obj = torch.load(str(path), map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise ProjectionError(f"no file at {path}") from None
    except Exception as e:
        raise ProjectionError(f"{path} is not a tensor file torch.load(weights_only=True) can read ({e})") from None
    if not isinstance(obj, dict) or "indices" not in obj or "likelihoods" not in obj:
        keys = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
        raise ProjectionError(f"{path}: expected a dict with 'indices' and 'likelihoods', found {keys}")
    indices = obj["indices"].detach().cpu().numpy().astype(np.int64)
    weights = obj["likelihoods"].detach().cpu().float().numpy()
    s_info, t_info = tokenizer_info(student_tok), tokenizer_info(teacher_tok)
    v_s, v_t = s_info.vocab_size, t_info.vocab_size
    if indices.ndim != 2 or weights.shape != indices.shape:
        raise ProjectionError(f"{path}: indices {tuple(indices.shape)} and likelihoods {tuple(weights.shape)} "
                              "must both be [student_vocab, k]")
    if indices.shape[0] < v_s:
        raise ProjectionError(f"{path}: {indices.shape[0]} rows but the student tokenizer has {v_s} tokens: "
                              "the map was built for another student tokenizer")
    if indices.shape[0] > v_s:
        extra = indices[v_s:]
        if np.any(extra >= 0):
            raise ProjectionError(f"{path}: rows beyond the student tokenizer's {v_s} tokens carry mappings: "
                                  "the map was built for another student tokenizer")
        log.info("dropping %d empty padded rows beyond the student tokenizer", indices.shape[0] - v_s)
        indices, weights = indices[:v_s], weights[:v_s]
    weights = np.where(indices >= 0, weights, 0).astype(np.float32)
    validate(indices, weights, v_t, where=str(path), normalized=False)
    # a row may name one teacher id twice (real NeMo-RL maps do on inexact rows): merge, summing weights
    r, j = np.nonzero(indices >= 0)
    pairs = r * v_t + indices[r, j]
    unique_pairs, first_at, counts = np.unique(pairs, return_index=True, return_counts=True)
    dup_rows = np.unique(unique_pairs[counts > 1] // v_t)
    indices, weights = _top_k(r, indices[r, j], weights[r, j].astype(np.float64), v_s, v_t, indices.shape[1])
    s_pieces, t_pieces = _pieces(s_info), _pieces(t_info)
    # targets whose bytes are not text on their own (decoded, they read U+FFFD): reported, kept
    fffd_ids = np.array([i for i, piece in enumerate(t_pieces) if not _is_text(piece)], dtype=np.int64)
    fffd_rows = np.unique(np.nonzero(np.isin(indices, fffd_ids) & (indices >= 0))[0])
    report = {"duplicate_entries_merged": int((counts - 1).sum()), "rows_with_duplicates": int(dup_rows.size),
              "rows_targeting_u_fffd": int(fffd_rows.size)}
    if report["duplicate_entries_merged"]:
        log.warning("%s: merged %d duplicated teacher ids in %d rows (weights summed)", path,
                    report["duplicate_entries_merged"], report["rows_with_duplicates"])
    if fffd_rows.size:
        log.warning("%s: %d rows map to teacher tokens that are partial UTF-8 (U+FFFD when decoded)", path,
                    fffd_rows.size)
    single = (indices[:, 0] >= 0) & ((weights[:, 0] > 1 - 1e-6))
    exact = np.array([bool(single[i]) and s_pieces[i] != b"" and s_pieces[i] == t_pieces[int(indices[i, 0])]
                      for i in range(v_s)])
    pm = ProjectionMap(indices=indices, weights=weights, exact=exact, student_fingerprint=s_info.fingerprint,
                       teacher_fingerprint=t_info.fingerprint, teacher_vocab_size=v_t)
    return pm, report


def _is_text(piece: bytes) -> bool:
    try:
        piece.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def unreached_teacher_ids(pm: ProjectionMap, teacher_vocab: int = -1) -> np.ndarray:
    """The teacher ids no student row points at, ascending, of the map's teacher vocabulary or, where the map does
    not record one (an imported map), of `teacher_vocab` (empty when neither is known).

    Mostly teacher tokens whose text the student splits: the student spells them with two or more tokens, so at
    a chunk's first position it reaches them only through its first piece, whose row stands for the teacher's
    token of that piece. Their probability at a first row has no student counterpart in P-KL (docs/losses.md)."""
    vocab = pm.teacher_vocab_size if pm.teacher_vocab_size >= 0 else teacher_vocab
    if vocab < 0:
        return np.zeros(0, dtype=np.int64)
    reached = np.zeros(vocab, dtype=bool)
    reached[pm.indices[pm.indices >= 0]] = True
    return np.flatnonzero(~reached)


def coverage(pm: ProjectionMap) -> dict:
    """Share of student ids with an exact match, with any mapping, mean entries per row, and the teacher ids no
    student row reaches (`unreached_teacher_ids`; -1 when the teacher vocabulary is unknown)."""
    mapped = pm.indices[:, 0] >= 0
    return {
        "student_vocab": pm.student_vocab_size, "teacher_vocab": pm.teacher_vocab_size, "top_k": pm.top_k,
        "exact_share": float(pm.exact.mean()) if pm.student_vocab_size else 0.0,
        "mapped_share": float(mapped.mean()) if pm.student_vocab_size else 0.0,
        "mean_entries": float((pm.indices >= 0).sum(axis=1).mean()) if pm.student_vocab_size else 0.0,
        "empty_rows": int((~mapped).sum()),
        "unreached_teacher_ids": int(unreached_teacher_ids(pm).size) if pm.teacher_vocab_size >= 0 else -1,
    }


def format_report(pm: ProjectionMap, student_tok=None, teacher_tok=None, *, examples: int = 6) -> str:
    """Human-readable coverage report with a few example rows (token strings when both tokenizers
    are given, ids otherwise)."""
    c = coverage(pm)
    s_name = (lambda i: repr(student_tok.convert_ids_to_tokens(i))) if student_tok is not None else str
    t_name = (lambda i: repr(teacher_tok.convert_ids_to_tokens(i))) if teacher_tok is not None else str
    lines = [
        f"projection map: student vocab {c['student_vocab']}, teacher vocab {c['teacher_vocab']}, top-k {c['top_k']}",
        f"  exact matches     {c['exact_share']:.1%}",
        f"  rows with mapping {c['mapped_share']:.1%} ({c['empty_rows']} empty)",
        f"  entries per row   {c['mean_entries']:.2f}",
        f"  content sha256    {pm.digest()} (train-student's summary.json: data.projections)",
    ]
    unreached = unreached_teacher_ids(pm)
    if unreached.size:
        names = ", ".join(t_name(int(i)) for i in unreached[:: max(1, unreached.size // examples)][:examples])
        lines.append(f"  teacher ids no student row reaches: {unreached.size} of {c['teacher_vocab']} "
                     f"({unreached.size / c['teacher_vocab']:.1%}, e.g. {names}): at a chunk's first row P-KL has no "
                     "student probability to set against theirs (docs/losses.md)")
    inexact = np.flatnonzero(~pm.exact & (pm.indices[:, 0] >= 0))
    exact = np.flatnonzero(pm.exact)
    picks = list(exact[:: max(1, exact.size // 2)][:2]) + list(inexact[:: max(1, inexact.size // examples)][:examples])
    for r in picks:
        shown = ", ".join(f"{t_name(int(i))}:{w:.2f}" for i, w in zip(pm.indices[r], pm.weights[r]) if i >= 0)
        lines.append(f"  {s_name(int(r)):>14} -> {shown}")
    empty = np.flatnonzero(pm.indices[:, 0] < 0)
    if empty.size:
        names = ", ".join(s_name(int(i)) for i in empty[:10])
        label = "empty rows" if student_tok is not None else "empty rows (student ids)"  # ids: not a count
        lines.append(f"  {label}: {names}{' ...' if empty.size > 10 else ''}")
    return "\n".join(lines)
