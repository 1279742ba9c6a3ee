"""Where each message text is in a batch of chat renderings: one marked rendering per conversation,
read for the whole batch at once in numpy.

The method is `xtcache.chat.spans`'s (placeholders of the same length, no search for the text),
with one rendering less: in the marked conversation text k's core becomes a run of `chr(base + k)`
and its leading and trailing whitespace become runs of two whitespace characters of their own
(`Plan.spaces`: Unicode spaces that no rendering of the batch contains; `Plan.base`: private-use
characters that none contains), so one marked rendering says both where the core is and whether
the template kept the whitespace around it (a template that trims, trims a Unicode space alike; no
quiet rendering).

A conversation is read here when the marked rendering, with every run put back (core runs by the
core, whitespace runs by the text's own whitespace), is its real rendering character for
character, each core run as long as its core and each whitespace run as long as its whitespace and
next to its core run. Every other conversation (a template that changed, escaped, split or
partly stripped a text, or rejected the marked conversation) is left to the general walk
(`locate_one`: `xtcache.chat.spans.locate`, with the whitespace kept and a quiet rendering): `read`
returns None for it. `locate_all` does both for a batch.

    python -c "from xtcache.chat.runs import locate_all; help(locate_all)"
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from xtcache.chat.spans import (
    _AREAS,
    Located,
    _in_order,
    _reasoning_key,
    locate,
    marked_conversation,
    message_texts,
    needs_quiet,
    placeholder_base,
    unlocated,
)
from xtcache.errors import ConfigError

log = logging.getLogger(__name__)

# Unicode spaces (str.isspace, stripped by str.strip and jinja's trim) for the whitespace runs
SPACES = "\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a\u205f\u3000\u1680"


@dataclass
class Plan:
    """The placeholders of a batch's marked conversations (one side), and its real renderings."""

    texts: list[list]  # per conversation: (message, field, text) of its message texts
    base: int | None  # text k's core run is chr(base + k) (None: no free characters; none is read here)
    spaces: str  # the characters of the leading and trailing whitespace runs ("": none free)
    spaced: list[bool]  # per conversation: some text has a core and outer whitespace
    first: np.ndarray  # int64 [D + 1]: conversation d's texts are [first[d], first[d + 1]) of the batch
    split: np.ndarray  # int64 [T, 3]: leading whitespace, core and trailing whitespace length of each text
    start: np.ndarray  # int64 [T]: where each text starts in all texts joined
    real: np.ndarray  # uint32 [C]: the real renderings' code points, each followed by one "\\x00"
    begin: np.ndarray  # int64 [D]: where each starts in real


def _codes(s: str) -> np.ndarray:
    return np.frombuffer(s.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)


def plan(renderings: list[str], texts: list[list]) -> Plan:
    """The placeholders for conversations whose real renderings are `renderings` and whose message
    texts are `texts` (`xtcache.chat.spans.message_texts` of each)."""
    joined = "".join(r + "\x00" for r in renderings)
    real = _codes(joined)
    n = np.fromiter((len(t) for t in texts), dtype=np.int64, count=len(texts))
    n_max = int(n.max(initial=0))
    base = next((b for b, size in _AREAS if n_max <= size and not ((real - np.uint32(b)) < np.uint32(n_max)).any()),
                None)
    spaces = ""
    for c in SPACES:
        if len(spaces) < 2 and c not in joined:
            spaces += c
    flat = [s for t in texts for _, _, s in t]
    lengths = np.fromiter((len(s) for s in flat), dtype=np.int64, count=len(flat))
    split = np.zeros((len(flat), 3), dtype=np.int64)
    split[:, 1] = lengths
    for j in (j for j, s in enumerate(flat) if s[0].isspace() or s[-1].isspace()):  # outer whitespace
        core = flat[j].strip()
        lead = len(flat[j]) - len(flat[j].lstrip()) if core else 0
        split[j] = lead, len(core), lengths[j] - lead - len(core)
    spaced = (split[:, 1] > 0) & ((split[:, 0] > 0) | (split[:, 2] > 0))
    lens = np.fromiter((len(r) + 1 for r in renderings), dtype=np.int64, count=len(renderings))
    return Plan(texts, base, spaces if len(spaces) == 2 else "",
                (np.bincount(np.repeat(np.arange(len(texts)), n), weights=spaced, minlength=len(texts)) > 0).tolist(),
                np.concatenate(([0], np.cumsum(n))), split, np.cumsum(lengths) - lengths, real, np.cumsum(lens) - lens)


def marked_conversations(convs: list[dict], p: Plan) -> list[dict | None]:
    """Each conversation with its texts' cores and outer whitespace replaced by their runs (None:
    not read here: no free placeholder characters, or outer whitespace and no free spaces)."""
    out = []
    split, first, base = p.split.tolist(), p.first.tolist(), p.base
    for d, (conv, texts) in enumerate(zip(convs, p.texts)):
        if base is None or (p.spaced[d] and not p.spaces):
            out.append(None)
            continue
        msgs = list(conv["messages"])
        for k, (i, field, _) in enumerate(texts):
            lead, core, trail = split[first[d] + k]
            if core:
                run = chr(base + k) * core
                if lead or trail:
                    run = p.spaces[0] * lead + run + p.spaces[1] * trail
                if msgs[i] is conv["messages"][i]:
                    msgs[i] = dict(msgs[i])
                msgs[i]["content" if field == 1 else _reasoning_key(msgs[i])] = run
        out.append({**conv, "messages": msgs})
    return out


@dataclass
class _Batch:
    """The marked renderings joined as `Plan.real` is (a conversation not read: its real rendering),
    as code points, and their core runs."""

    marked: np.ndarray  # uint32 [C]
    bad: np.ndarray  # bool [D]: not read, or its marked rendering does not put back to its real one
    begin: np.ndarray  # int64 [D]: where each conversation starts
    r0: np.ndarray  # int64 [R]: where each core run starts
    rn: np.ndarray  # int64 [R]: its length
    doc: np.ndarray  # int64 [R]: its conversation
    text: np.ndarray  # int64 [R]: its text (batch index)

    def flag(self, pos: np.ndarray) -> None:
        """Mark the conversations holding positions `pos` unread."""
        self.bad[np.searchsorted(self.begin, pos, side="right") - 1] = True


def _runs(pos: np.ndarray, key: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Start and length of the runs of consecutive positions `pos` with equal `key`."""
    new = np.ones(pos.shape[0], dtype=bool)
    new[1:] = (pos[1:] != pos[:-1] + 1) | (key[1:] != key[:-1])
    first = np.flatnonzero(new)
    return pos[first], np.diff(np.append(first, pos.shape[0]))


def _batch(renderings: list[str], marked: list, p: Plan, chars: np.ndarray) -> _Batch:
    """The core runs of the marked renderings, each checked against its text's core, and every
    template character against the real rendering's."""
    ok = [m is not None and len(m) == len(r) for m, r in zip(marked, renderings)]
    codes = _codes("".join((m if k else r) + "\x00" for m, r, k in zip(marked, renderings, ok)))
    n = np.diff(p.first)
    core = (codes - np.uint32(p.base)) < np.uint32(max(int(n.max()), 1))  # uint32: below base wraps round
    ours = core
    for c in p.spaces if any(p.spaced) else ():
        ours = ours | (codes == ord(c))
    edge = np.empty(codes.shape[0] + 1, dtype=bool)  # a run starts or ends: the code changes
    edge[0] = edge[-1] = True
    np.not_equal(codes[1:], codes[:-1], out=edge[1:-1])
    r0 = np.flatnonzero(edge[:-1] & core)
    rn = np.flatnonzero(edge[1:] & core) + 1 - r0
    b = _Batch(codes, ~np.asarray(ok, dtype=bool), p.begin, r0, rn, np.zeros(0, np.int64), np.zeros(0, np.int64))
    b.flag(np.flatnonzero((codes != p.real) & ~ours))  # template text that differs
    b.doc = np.searchsorted(b.begin, r0, side="right") - 1
    k = codes[r0].astype(np.int64) - p.base
    known = k < n[b.doc]
    b.text = p.first[b.doc] + np.where(known, k, 0)
    b.bad[b.doc[~known | (rn != p.split[b.text, 1])]] = True
    # the real rendering's characters under the core runs, against the cores
    run_start = np.repeat(p.start[b.text] + p.split[b.text, 0] - r0, rn)  # each core character's index in chars
    cp = np.flatnonzero(core)
    b.flag(cp[p.real[cp] != chars[np.minimum(run_start + cp, max(chars.shape[0] - 1, 0))]])
    return b


def _spaces(b: _Batch, p: Plan, chars: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Check the whitespace runs next to the core runs (each as long as its text's whitespace, the
    real rendering holding that whitespace); whether each core run has its leading / trailing one."""
    kept = []
    ends = b.r0 + b.rn
    for side, c in enumerate(p.spaces if any(p.spaced) else ()):
        wp = np.flatnonzero(b.marked == ord(c))
        w0, wn = _runs(wp, np.zeros_like(wp))
        nxt = w0 + wn if side == 0 else w0  # the core run's start / end next to the run
        j = np.minimum(np.searchsorted(b.r0 if side == 0 else ends, nxt), max(b.r0.shape[0] - 1, 0))
        ok = (b.r0 if side == 0 else ends)[j] == nxt if b.r0.shape[0] else np.zeros(w0.shape[0], dtype=bool)
        g = b.text[j] if b.r0.shape[0] else np.zeros(w0.shape[0], np.int64)
        ok &= wn == p.split[g, 2 * side]
        b.flag(w0[~ok])
        at = p.start[g] + (0 if side == 0 else p.split[g, 0] + p.split[g, 1]) - w0
        want = np.minimum(np.repeat(at, wn) + wp, max(chars.shape[0] - 1, 0))
        b.flag(wp[p.real[wp] != chars[want]])
        kept.append(b.marked[b.r0 - 1 if side == 0 else ends] == ord(c))
    return tuple(kept) if kept else (np.zeros(b.r0.shape[0], bool),) * 2


def read(renderings: list[str], marked: list[str | None], p: Plan) -> list[Located | None]:
    """Where each conversation's texts are in its real rendering `renderings[d]`, read from its
    marked rendering `marked[d]` (the template's rendering of `marked_conversations`' entry, None
    when there is none); None for a conversation whose marked rendering does not put back to its
    real one (the general walk's)."""
    out: list[Located | None] = [None] * len(renderings)
    if not p.split.shape[0]:  # no message texts
        return [unlocated(r, t) for r, t in zip(renderings, p.texts)]
    chars = _codes("".join([s for t in p.texts for _, _, s in t]))
    if p.base is None:
        return out
    b = _batch(renderings, marked, p, chars)
    lead_kept, trail_kept = _spaces(b, p, chars)
    good = np.flatnonzero(~b.bad[b.doc])
    text, first = np.unique(b.text[good], return_index=True)  # each text's first run
    run = good[first]
    total = p.split.shape[0]
    core_at = np.full(total, -1, dtype=np.int64)
    core_at[text] = b.r0[run] - b.begin[b.doc[run]]
    core_at = _keep_order(core_at, p.first)
    got = core_at >= 0
    lead, core, trail = p.split[:, 0], p.split[:, 1], p.split[:, 2]
    kl, kt = np.zeros(total, dtype=bool), np.zeros(total, dtype=bool)
    kl[text], kt[text] = lead_kept[run], trail_kept[run]
    at = np.where(got, core_at - lead * kl, -1)
    skip = np.where(got, lead * ~kl, 0)
    width = np.where(got, core + lead * kl + trail * kt, 0)
    return _located(renderings, marked, p, b, out, at, skip, width)


def _located(renderings, marked, p: Plan, b: _Batch, out: list, at, skip, width) -> list[Located | None]:
    """`out` with a Located for every conversation of the batch that was read."""
    lengths = p.split.sum(axis=1)
    text_doc = np.repeat(np.arange(len(renderings)), np.diff(p.first))
    content = np.bincount(text_doc, weights=lengths, minlength=len(renderings)).astype(np.int64).tolist()
    shared = np.bincount(text_doc, weights=width, minlength=len(renderings)).astype(np.int64).tolist()
    spans = np.bincount(text_doc, weights=width < lengths, minlength=len(renderings)).astype(np.int64).tolist()
    at_l, skip_l, width_l, first = at.tolist(), skip.tolist(), width.tolist(), p.first.tolist()
    for d in np.flatnonzero(~b.bad).tolist():
        lo, hi = first[d], first[d + 1]
        out[d] = Located(renderings[d], p.texts[d], at_l[lo:hi], skip_l[lo:hi], width_l[lo:hi], content[d],
                         content[d] - shared[d], spans[d], marked[d], p.base, [0] * (hi - lo))
    return out


def _keep_order(core_at: np.ndarray, first: np.ndarray) -> np.ndarray:
    """`core_at` with each conversation's located texts outside its longest in-order subsequence
    unlocated (`xtcache.chat.spans._in_order`, run only for a conversation out of order)."""
    got = np.flatnonzero(core_at >= 0)
    if got.shape[0] < 2:
        return core_at
    doc = np.searchsorted(first, got, side="right") - 1
    back = (doc[1:] == doc[:-1]) & (core_at[got[1:]] <= core_at[got[:-1]])
    for d in np.unique(doc[1:][back]).tolist():
        lo, hi = int(first[d]), int(first[d + 1])
        core_at[lo:hi] = _in_order(core_at[lo:hi].tolist())
    return core_at


def locate_all(render: Callable[[dict], str], texts: list[str], convs: list[dict], msg_texts: list) -> list[Located]:
    """Where the message texts of each conversation (`msg_texts[d]`: its `message_texts`, None to
    collect them) are in `texts[d]`, its rendering by `render` (one template; it raises
    `xtcache.chat.render.ConversationError` for a conversation the template rejects): one marked rendering
    per conversation, read for the whole batch (`read`); a conversation that cannot be read so is
    walked by `locate_one`, reusing its marked rendering where the walk's would be the same."""
    msg_texts = [message_texts(c) if m is None else m for c, m in zip(convs, msg_texts)]
    p = plan(texts, msg_texts)
    marked = []
    for c in marked_conversations(convs, p):
        try:
            marked.append(None if c is None else render(c))
        except ConfigError:  # the template rejects the marked conversation: the walk says so
            marked.append(None)
    out = read(texts, marked, p)
    walk = [d for d, x in enumerate(out) if x is None]
    for d in walk:
        same = not p.spaced[d] and p.base == placeholder_base(texts[d], len(msg_texts[d]))
        out[d] = locate_one(render, texts[d], convs[d], msg_texts[d], marked[d] if same else None)
    if walk:
        log.debug("%d of %d conversations located by the general walk (their template changed a text)",
                  len(walk), len(texts))
    return out


def locate_one(render: Callable[[dict], str], text: str, conv: dict, texts: list | None = None,
               marked: str | None = None) -> Located:
    """The general walk for one conversation (`xtcache.chat.spans.locate`): its marked rendering
    (`marked`, when already rendered) and, where a text has leading or trailing whitespace, a quiet
    one. A template that rejects the marked conversation, or a rendering that uses every
    private-use character it would need, leaves every text unaligned (counted), with a warning."""
    texts = message_texts(conv) if texts is None else texts
    if not texts:
        return unlocated(text, texts)
    base = placeholder_base(text, len(texts))
    try:
        if base is None:
            raise ConfigError("the rendering contains the private-use characters its placeholders need")
        marked = marked if marked is not None else render(marked_conversation(conv, texts, base))
        quiet = render(marked_conversation(conv, texts, base, quiet=True)) if needs_quiet(texts) else None
    except ConfigError as e:
        log.warning("conversation messages left unaligned (no KD, not trained): %s", e)
        return unlocated(text, texts)
    return locate(text, marked, texts, base, quiet)
