"""Where each message text is in a chat rendering, by construction (no search for the text).

`xtcache.chat.layout` renders a conversation in a model's template and then needs the exact character span
of each message's reasoning and content in that rendering. Searching the rendering for the text
finds a short text ("user", "1", "Yes.", a newline) inside the template's own headers, so the
span is taken from the template instead:

1. the conversation is rendered a second time, *marked*: every message text keeps its leading and
   trailing whitespace and has its other characters replaced by a run of one private-use character,
   distinct per text (text k: `chr(base + k)`, a base whose characters the rendering does not
   contain). Each run in the marked rendering is where the template wrote text k;
2. the real rendering must equal the marked one with every run replaced by its text. This is
   checked run by run from the start (same offsets) and from the end (offsets shifted by the length
   difference); a text the template changed (escaped, split, rewrote, truncated) stops the walk, so
   it and the texts between the two walks' stops are *unaligned*: no KD, never trained, counted;
3. a template that trims whitespace trims the placeholder's whitespace alike, so the core (the
   text without leading and trailing whitespace) is located either way; whether the template kept
   that whitespace is read from a third, *quiet* rendering with the whitespace left out (only for
   conversations that have such a text): a gap that grew by exactly the whitespace kept it;
4. texts the template wrote out of message order keep their longest in-order subsequence;
   whitespace-only texts, texts the template dropped (earlier turns' reasoning) and texts of a
   conversation whose marked rendering the template rejects are unaligned.

Pure functions on strings, the general walk for one conversation; `xtcache.chat.runs` reads a whole
batch from one marked rendering each and leaves to this walk (`chat_runs.locate_one`, which
renders) the conversations whose template changed a text.

    python -c "from xtcache.chat.spans import locate; help(locate)"
"""

from __future__ import annotations

import re
from bisect import bisect_left
from dataclasses import dataclass

import numpy as np

REASONING_FIELDS = ("reasoning_content", "reasoning", "thinking")
# private-use areas: U+E000..U+F8FF (6,400 characters), planes 15 and 16 (65,534 each)
_AREAS = ((0xE000, 6400), (0xF0000, 65534), (0x100000, 65534))


@dataclass
class Piece:
    """One message text (reasoning or content) located in a rendering at [start, end)."""

    msg: int
    field: int  # 0 reasoning, 1 content
    start: int
    end: int
    text: str


@dataclass
class Located:
    """Where the message texts of a conversation (`texts`, as `message_texts` gives them) are in one
    rendering `text`: characters [skip[k], skip[k] + width[k]) of text k are at `at[k]` (-1 and width
    0: not located; skip is the leading whitespace the template trimmed, 0 when it kept it)."""

    text: str
    texts: list
    at: list[int]
    skip: list[int]
    width: list[int]
    content_chars: int = 0
    unaligned_chars: int = 0
    unaligned_spans: int = 0
    marked: str | None = None  # the marked rendering (None: not rendered)
    base: int = 0  # text k's placeholder character is chr(base + k)
    shift: list[int] | None = None  # text k's core is at its run's marked offset + shift[k]

    @property
    def pieces(self) -> list[Piece]:
        """The located texts, as Pieces, in order."""
        return [Piece(m, f, a, a + w, self.text[a:a + w])
                for (m, f, _), a, w in zip(self.texts, self.at, self.width) if a >= 0]


def message_texts(conv: dict) -> list[tuple[int, int, str]]:
    """(message, field, text) of every non-empty reasoning and content string, in order."""
    out = []
    for i, m in enumerate(conv["messages"]):
        key = _reasoning_key(m)
        if key is not None and isinstance(m[key], str):
            out.append((i, 0, m[key]))
        c = m.get("content")
        if c and isinstance(c, str):
            out.append((i, 1, c))
    return out


def _reasoning_key(m: dict) -> str | None:
    return next((k for k in REASONING_FIELDS if m.get(k)), None)


def _split(s: str) -> tuple[int, str, int]:
    """(leading whitespace length, core, trailing whitespace length) of a text."""
    core = s.strip()
    lead = len(s) - len(s.lstrip()) if core else 0
    return lead, core, len(s) - lead - len(core)


def placeholder_base(text: str, n: int) -> int | None:
    """A code point `base` such that chr(base) .. chr(base + n - 1) are private-use characters that
    `text` does not contain (None when every area is too small or in use)."""
    for base, size in _AREAS:
        if n <= size and (n == 0 or not re.search(f"[{chr(base)}-{chr(base + n - 1)}]", text)):
            return base
    return None


def needs_quiet(texts) -> bool:
    """Whether a quiet rendering is needed: some text has a core and leading or trailing whitespace."""
    return any(s != s.strip() and not s.isspace() for _, _, s in texts)


def marked_conversation(conv: dict, texts, base: int, *, quiet: bool = False) -> dict:
    """`conv` with text k's core replaced by chr(base + k) repeated (its whitespace kept, or left
    out when `quiet`); whitespace-only texts stay as they are."""
    msgs = [dict(m) for m in conv["messages"]]
    for k, (i, field, s) in enumerate(texts):
        lead, core, trail = _split(s)
        if not core:
            continue
        run = chr(base + k) * len(core)
        msgs[i]["content" if field == 1 else _reasoning_key(msgs[i])] = \
            run if quiet else s[:lead] + run + s[len(s) - trail:]
    out = dict(conv)
    out["messages"] = msgs
    return out


def _runs(marked: str, base: int, n: int) -> list[tuple[int, int, int]]:
    """(text index, start, end) of every run of one placeholder character, in order."""
    if n == 0:
        return []
    pat = re.compile(f"([{chr(base)}-{chr(base + n - 1)}])\\1*")
    return [(ord(m.group(1)) - base, m.start(), m.end()) for m in pat.finditer(marked)]


def _verified(text: str, marked: str, runs, cores) -> list[int]:
    """Where each run's text is in `text` (-1: not verified): runs checked from the start at the
    marked offsets, then from the end at offsets shifted by the length difference."""
    pos = [-1] * len(runs)
    prev = j = 0
    for j, (k, a, b) in enumerate(runs):
        if b - a != len(cores[k]) or not text.startswith(marked[prev:a], prev) or not text.startswith(cores[k], a):
            break
        pos[j], prev = a, b
    else:
        j = len(runs)
    if j == len(runs) and text[prev:] == marked[prev:]:
        return pos
    delta, nxt = len(text) - len(marked), len(marked)
    floor = prev  # the end of the forward walk's last verified run, in `text`
    for i in range(len(runs) - 1, j - 1, -1):
        k, a, b = runs[i]
        if (b - a != len(cores[k]) or a + delta < floor or text[b + delta:nxt + delta] != marked[b:nxt]
                or not text.startswith(cores[k], a + delta)):
            break
        pos[i], nxt = a + delta, a
    return pos


def _in_order(at: list[int]) -> list[int]:
    """`at` with the located entries outside its longest increasing subsequence set to -1."""
    idx = [k for k, a in enumerate(at) if a >= 0]
    tails: list[int] = []  # position values ending the best subsequence of each length
    tail_k: list[int] = []
    back = {}
    for k in idx:
        i = bisect_left(tails, at[k])
        back[k] = tail_k[i - 1] if i else -1
        tails[i:i + 1], tail_k[i:i + 1] = [at[k]], [k]
    keep, k = set(), tail_k[-1] if tail_k else -1
    while k >= 0:
        keep.add(k)
        k = back[k]
    return [a if k in keep else -1 for k, a in enumerate(at)]


def _kept_space(marked: str, quiet: str, runs, q_runs, splits, texts) -> tuple[set, set]:
    """Runs whose leading / trailing whitespace the template kept: a gap between two runs of the
    marked rendering equals the quiet rendering's gap with exactly the kept whitespace added (one
    reading only; an ambiguous gap keeps nothing)."""
    lead_kept, trail_kept = set(), set()
    if [(k, b - a) for k, a, b in runs] != [(k, b - a) for k, a, b in q_runs]:
        return lead_kept, trail_kept
    ends = [(0, 0, None)] + [(b, qb, j) for j, ((_, _, b), (_, _, qb)) in enumerate(zip(runs, q_runs))]
    starts = [(a, qa, j) for j, ((_, a, _), (_, qa, _)) in enumerate(zip(runs, q_runs))]
    starts.append((len(marked), len(quiet), None))
    for (p0, q0, before), (p1, q1, after) in zip(ends, starts):
        gap, q_gap = marked[p0:p1], quiet[q0:q1]
        trail = _ws(texts, splits, runs, before, trail=True)
        lead = _ws(texts, splits, runs, after, trail=False)
        fits = [(t, w) for t in ({False, bool(trail)}) for w in ({False, bool(lead)})
                if (trail if t else "") + q_gap + (lead if w else "") == gap]
        if len(fits) == 1:
            if fits[0][0]:
                trail_kept.add(before)
            if fits[0][1]:
                lead_kept.add(after)
    return lead_kept, trail_kept


def _ws(texts, splits, runs, j, *, trail: bool) -> str:
    if j is None:
        return ""
    k = runs[j][0]
    s, (lead, _, tr) = texts[k][2], splits[k]
    return s[len(s) - tr:] if trail else s[:lead]


def locate(text: str, marked: str | None, texts, base: int, quiet: str | None = None) -> Located:
    """Where each of `texts` is in the rendering `text`, read from its `marked` rendering (None: the
    template rejected it, nothing is located) and, for whitespace, its `quiet` one (see the module)."""
    n = len(texts)
    splits = [_split(s) for _, _, s in texts]
    cores = [c for _, c, _ in splits]
    at, skip, width = [-1] * n, [0] * n, [0] * n
    runs = _runs(marked, base, n) if marked is not None else []
    run_of, shift = {}, [0] * n
    for j, p in enumerate(_verified(text, marked, runs, cores) if runs else []):
        k = runs[j][0]
        if p >= 0 and at[k] < 0:
            at[k], run_of[k], shift[k] = p, j, p - runs[j][1]
    at = _in_order(at)
    lead_kept, trail_kept = set(), set()
    if quiet is not None and runs:
        lead_kept, trail_kept = _kept_space(marked, quiet, runs, _runs(quiet, base, n), splits, texts)
    for k, a in enumerate(at):
        if a < 0:
            continue
        (lead, _, trail), j, s = splits[k], run_of[k], texts[k][2]
        core_end = len(s) - trail  # where the trailing whitespace starts in s
        if j in lead_kept and text.startswith(s[:lead], a - lead):
            a, lead = a - lead, 0  # a: where s[lead] is in text
        kept = j in trail_kept and text.startswith(s[core_end:], a + core_end - lead)
        at[k], skip[k], width[k] = a, lead, (len(s) if kept else core_end) - lead
    lengths = [len(s) for _, _, s in texts]
    return Located(text, texts, at, skip, width, sum(lengths), sum(lengths) - sum(width),
                   sum(w < n_ for w, n_ in zip(width, lengths)), marked, base, shift)


def unlocated(text: str, texts) -> Located:
    """A rendering none of whose texts could be located (all counted unaligned)."""
    n = len(texts)
    chars = sum(len(s) for _, _, s in texts)
    return Located(text, texts, [-1] * n, [0] * n, [0] * n, chars, chars, n)


def pair_spans(at_s, skip_s, w_s, at_t, skip_t, w_t) -> tuple[np.ndarray, ...]:
    """Which texts are located on both sides, and where their shared span (the characters of the
    text both sides located) starts on each side and how wide it is (int64 arrays over the texts)."""
    lo, hi = np.maximum(skip_s, skip_t), np.minimum(skip_s + w_s, skip_t + w_t)
    both = (at_s >= 0) & (at_t >= 0) & (hi > lo)
    return both, at_s + lo - skip_s, at_t + lo - skip_t, np.where(both, hi - lo, 0)


def shared_pieces(a: Located, b: Located) -> list[tuple[Piece, Piece]]:
    """The texts located in both renderings, each narrowed to the characters both sides located."""
    arr = lambda xs: np.asarray(xs, dtype=np.int64).reshape(-1)  # noqa: E731
    both, s0, t0, w = pair_spans(arr(a.at), arr(a.skip), arr(a.width), arr(b.at), arr(b.skip), arr(b.width))
    out = []
    for k in np.flatnonzero(both).tolist():
        m, f, _ = a.texts[k]
        x, y, n = int(s0[k]), int(t0[k]), int(w[k])
        out.append((Piece(m, f, x, x + n, a.text[x:x + n]), Piece(m, f, y, y + n, b.text[y:y + n])))
    return out
