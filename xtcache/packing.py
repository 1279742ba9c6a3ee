"""Packing of documents' chunks into training windows: pure functions, shared by the stage 2 loader
(`stage2_student.loader.CacheDataset`) and `xtcache inspect --seq-len`.

A document is a run of chunks (their student-token lengths); a window holds at most `seq_len`
tokens and is cut only between chunks. A window is a list of segments, each a chunk range
[lo, hi) of one document whose first `ctx` chunks are context: read, never trained (they were
trained in an earlier window of that document).

- `pack_documents` (plain text, `--train-on all`): documents one after another; a document that
  goes on in the next window repeats its last chunk there as context. Every chunk is trained once.
- `pack_trained` (`--train-on assistant|last-assistant`): windows are cut around the chunks that
  hold a trained token. Each window trains at least one of them, reads before them as much of
  their document as fits in the window (the context), and holds no text after the last one;
  text that trains nothing is read only as context. Every trained chunk is trained once.

    plan = pack_trained([0], [np.array([40, 3, 50, 5])], [np.array([0, 3, 0, 5])], seq_len=64)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

CONTEXT_SHARE = 4
"""pack_trained keeps at least min(seq_len // CONTEXT_SHARE, the tokens before it) tokens of context
before a window's first trained chunk (up to chunk granularity): a trained run longer than a window
goes on in the next one after a quarter window of what precedes it, read again as context."""


@dataclass
class WindowPlan:
    """Windows of one shard: window w holds segments [window_offsets[w], window_offsets[w+1])."""

    window_offsets: np.ndarray  # int64 [W+1]
    seg_doc: np.ndarray  # int64 [S] document index inside the shard
    seg_lo: np.ndarray  # int64 [S] first chunk (a context chunk when seg_ctx > 0)
    seg_hi: np.ndarray  # int64 [S] exclusive last chunk
    seg_ctx: np.ndarray  # int64 [S] leading context chunks (read, not trained); only a window's first segment has any
    skipped_chunks: int = 0  # chunks longer than a window, never trained
    read_tokens: int = 0  # tokens of every window, context included
    trained_tokens: int = 0  # trained tokens of the target chunks (pack_documents: every target token)

    @property
    def num_windows(self) -> int:
        return int(self.window_offsets.shape[0] - 1)


class _Windows:
    """Segments appended window by window (the shared bookkeeping of both packers)."""

    def __init__(self):
        self.offsets, self.docs, self.los, self.his, self.ctxs = [0], [], [], [], []
        self.used = 0

    def add(self, d: int, lo: int, hi: int, ctx: int, tokens: int) -> None:
        self.docs.append(d)
        self.los.append(lo)
        self.his.append(hi)
        self.ctxs.append(ctx)
        self.used += tokens

    def close(self) -> None:
        if len(self.docs) > self.offsets[-1]:
            self.offsets.append(len(self.docs))
        self.used = 0

    def plan(self, skipped: int, read: int, trained: int) -> WindowPlan:
        self.close()
        i64 = lambda x: np.asarray(x, dtype=np.int64)  # noqa: E731
        return WindowPlan(i64(self.offsets), i64(self.docs), i64(self.los), i64(self.his), i64(self.ctxs),
                          skipped, read, trained)


def pack_documents(doc_indices, chunk_lengths: list[np.ndarray], seq_len: int) -> WindowPlan:
    """Greedy packing of documents (student-token length of each chunk) into windows.

    doc_indices: the documents to pack, in order; chunk_lengths[i]: int [C_i] for document
    doc_indices[i]. Windows never exceed `seq_len` tokens and cut only between chunks.
    """
    w = _Windows()
    skipped = read = ctx_tokens = 0
    for d, lens in zip(doc_indices, chunk_lengths):
        lens = np.asarray(lens, dtype=np.int64)
        c, n_chunks = 0, lens.shape[0]
        ctx = False
        while c < n_chunks:
            start = c - 1 if ctx else c
            base = w.used + (lens[c - 1] if ctx else 0)
            fit = int(np.searchsorted(np.cumsum(lens[c:]), seq_len - base, side="right"))
            if fit == 0:
                if ctx:  # the context chunk leaves no room: start the window without it
                    ctx = False
                    continue
                if w.used == 0:  # a single chunk longer than a window
                    skipped += 1
                    c += 1
                    continue
                w.close()
                continue
            tokens = int(lens[start:c + fit].sum())
            w.add(d, start, c + fit, int(ctx), tokens)
            read += tokens
            ctx_tokens += int(lens[c - 1]) if ctx else 0
            c += fit
            ctx = False
            if c < n_chunks:  # the document goes on in the next window, after a context chunk
                w.close()
                ctx = lens[c - 1] > 0
        if w.used >= seq_len:
            w.close()
    return w.plan(skipped, read, read - ctx_tokens)


def pack_trained(doc_indices, chunk_lengths: list[np.ndarray], chunk_trained: list[np.ndarray],
                 seq_len: int) -> WindowPlan:
    """Windows cut around the trained chunks of documents (chunk_trained[i]: int [C_i], the trained
    student tokens of each chunk of document doc_indices[i]; a chunk is trained when it holds one).

    A window's targets run from the first trained chunk not yet trained to the last trained chunk
    that fits in `seq_len` minus the context kept before them (`CONTEXT_SHARE`, and at least the
    chunk just before); its context is as much of the document before them as then fits. A
    document whose trained chunks are done leaves the window open for the next document, which
    joins it when its own first window fits in what is left (so it reads the same context as in a
    window of its own). Trained chunks longer than a window are skipped (counted).
    """
    w = _Windows()
    skipped = read = trained_total = 0
    for d, lens, tr in zip(doc_indices, chunk_lengths, chunk_trained):
        lens, tr = np.asarray(lens, dtype=np.int64), np.asarray(tr, dtype=np.int64)
        cum = np.concatenate([[0], np.cumsum(lens)])  # [C+1] tokens before each chunk
        targets = np.flatnonzero(tr > 0)
        too_long = lens[targets] > seq_len
        skipped += int(too_long.sum())
        targets = targets[~too_long]
        done, t = 0, 0  # chunks [0, done) were trained in earlier windows; targets[t] comes next
        while t < targets.shape[0]:
            m = int(targets[t])
            keep = max(min(seq_len // CONTEXT_SHARE, int(cum[m])), int(lens[m - 1]) if m > 0 else 0)
            room = max(seq_len - keep, int(lens[m]))  # for the targets
            n = int(np.searchsorted(cum[targets[t:] + 1], cum[m] + room, side="right"))  # >= 1
            hi = int(targets[t + n - 1]) + 1
            lo = int(np.searchsorted(cum, cum[hi] - seq_len, side="left"))  # as much context as fits
            tokens = int(cum[hi] - cum[lo])
            if w.used + tokens > seq_len:
                w.close()
            w.add(d, lo, hi, max(0, done - lo), tokens)
            read += tokens
            trained_total += int(tr[m:hi].sum())
            done, t = hi, t + n
            if t < targets.shape[0] or w.used >= seq_len:  # the document goes on in a window of its own
                w.close()
    return w.plan(skipped, read, trained_total)


def most_windows(num_docs: int, seq_len: int, *, longest: int, trained_span: int | None = None) -> int | None:
    """The most windows the packers make of `num_docs` documents, whatever their chunks: one a document when each
    has at most `longest` tokens and that fits in a window; with `pack_trained`, also when from the start of the
    chunk just before each one's first trained chunk to the end of its last trained chunk at most
    `trained_span` tokens run, and they fit in a window less its context share (`CONTEXT_SHARE`). Else None: no
    bound without the chunks.

    Such a document opens at most one window. `pack_trained` takes all its trained chunks as the targets of one
    window: the room it keeps for them reaches the window's end (a whole document), or holds them after the
    context it keeps (a quarter window, or the chunk before them: within `trained_span`); they go into the
    window open before them when they fit there, else into a new one. `pack_documents` starts a document in a
    new window only where it fits nowhere in the open one, and then whole, or goes on from the open window into
    one new window, whose context chunk and the rest of the document are at most the document. Every window is
    opened by a document of its shard."""
    if longest <= seq_len or trained_span is not None and trained_span <= seq_len - seq_len // CONTEXT_SHARE:
        return num_docs
    return None


def common_boundaries(ends: list[np.ndarray]) -> np.ndarray:
    """int64 [G] the positive chunk ends that every one of `ends` (chunk ends of one document, one
    array per tokenization or teacher) holds, ascending; empty when `ends` is.

    Stage 2: the student-token ends of every teacher's chunks, the chunk groups: a group is the
    smallest run of student tokens that whole chunks of every teacher cover; with one teacher each
    group is one chunk (with any empty-student chunks after it). Stage 1 (teacher windows): the
    teacher-token ends of every student's alignment, where a window may be cut.
    """
    if not ends:
        return np.zeros(0, dtype=np.int64)
    common = np.unique(np.asarray(ends[0], dtype=np.int64))
    for e in ends[1:]:
        common = np.intersect1d(common, np.asarray(e, dtype=np.int64), assume_unique=False)
    return common[common > 0]


def group_trained(bounds: np.ndarray, trained: np.ndarray) -> np.ndarray:
    """int64 [G] trained tokens of each chunk group of one document: `bounds` int [G] the groups'
    exclusive student-token ends, `trained` bool [S] the document's trained student tokens."""
    cum = np.concatenate([[0], np.cumsum(trained, dtype=np.int64)])
    return np.diff(cum[np.asarray(bounds, dtype=np.int64)], prepend=0)


def pack(doc_indices, chunk_lengths: list[np.ndarray], chunk_trained: list[np.ndarray] | None,
         seq_len: int) -> WindowPlan:
    """`pack_trained` when trained tokens are given (--train-on assistant|last-assistant), else
    `pack_documents` (plain text, --train-on all)."""
    if chunk_trained is None:
        return pack_documents(doc_indices, chunk_lengths, seq_len)
    return pack_trained(doc_indices, chunk_lengths, chunk_trained, seq_len)
