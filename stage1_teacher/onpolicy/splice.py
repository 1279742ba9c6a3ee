"""The sampled ids of a rollout's generated turn, spliced into the sampling student's rendering.

`teacher-dump` renders a rollout row with the student's chat template and tokenizes the rendering
(`xtcache.chat.render.renderings`). The student sampled its turn token by token, so its ids can be another
tokenization of the same text than the one re-tokenizing gives (a word in two tokens where the
merges make one). On-policy training needs the sampled ids: those are the tokens whose sampling
log-probs the importance ratio reads. Before alignment, `splice_rollouts` replaces the rendering's
tokens of the generated turn's content by the sampled ids when they spell it:

- the content is where the template wrote the last message's content (`Located`, by construction);
  the rendering's tokens must cut cleanly at both ends of it (no token shared with template text);
- the sampled ids, the stop token left out (a last id that is a special token), must stand for
  exactly the content's UTF-8 bytes (`TokenizerInfo` pieces); their character offsets come from
  those bytes (a character split over byte tokens: each of them covers it, as the tokenizer's own
  offsets do);
- a sampled stop token must be the token the template writes after the content (its end-of-turn).

The sampled ids spell the message's own text (as `generate` decoded it): byte tokens that are no
UTF-8 decoded as U+FFFD count as that character (`replaced_text`), and whitespace the template trims
(the Llama-3 template strips a sampled leading space) is still sampled: the tokens standing only for
trimmed characters get an empty span at the content's edge, and the student trains on the ids it
sampled after the template's header. Otherwise nothing is spliced, and
`stage1_teacher.onpolicy.sampled.attach_sampled` counts the turn as one whose ids do not spell its
text: ids that decode to other text, a stop token other than the template's marker, a template that
changes the text in other ways than trimming it. A special token the student sampled inside its turn
(a weak student's `<s>`) stands for no text: it is kept where it was sampled, with an empty span
(`sampled.attach_sampled` gives it the template role: no loss trains it).
For a turn that trains on its sampled ids (spliced, or already the rendering's), the tokens before the
turn are the ones `generate` prompted with: the generation prompt rendered and encoded alone (`generation_prompt`, as `rollouts.prompt_of` does). Encoding the whole rendering can
tokenize the prompt's end otherwise, merged with what follows (the Llama-3-style toy student's `ĊĊ`
before a digit, `Ċ Ċ` before a letter); the student would then train its first answer token after a
context it never reads when it samples. Where the rendering's text up to the turn is the generation
prompt's, its tokens there are replaced by the prompt's (the turn's own counts stay as they were: a
rollout whose turn ids were already the sampled ones is not counted as spliced).
The rendered text is never changed, so the alignment (`xtcache.chat.layout.align_conversations`) runs on the spliced tokens as on any others;
the sampled ids that stand for a U+FFFD for invalid UTF-8 are marked (`Renderings.replaced`), and their chunk
is not exact (no KD there: the teacher scored a U+FFFD, not those bytes), as in a text rollout.

A same-tokenizer student (the teacher's tokenizer and template: an identity alignment group) is spliced
the same way into the teacher's own tokens (`stage1_teacher.prep`), so the teacher scores the ids the student
read and sampled, as an online teacher would; the other groups of the dump align against those tokens, the
teacher's ones standing for a U+FFFD flagged like a student's.

A text rollout (a prefix and its completion, `prefix_chars`, no template) is spliced whole by
`text_splice`: the prefix as the student's tokenizer encodes it alone (the ids `generate` prompted
with), then the sampled ids, when they spell the completion as a turn's do (U+FFFD for invalid UTF-8,
special tokens inside with an empty span); the tokenizer's own end tokens of the whole text (an
end-of-sequence it appends) follow. A plain-text store checks every token's bytes against its text:
the sampled ids that cover a U+FFFD for invalid UTF-8 are marked (`TextSplice.replaced`), and the
alignment leaves them unchecked and their chunk inexact (no KD there; their log-probs are kept). Re-tokenizing
the whole text can merge a token across the prefix's end, or split the completion another way; the
spliced ids are the ones the student read and sampled.

    python -c "import stage1_teacher.onpolicy.splice as s; help(s.splice_rollouts)"
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from xtcache.align.bytes import text_bytes
from xtcache.align.tokenizer import encode_with_offsets
from xtcache.chat.render import ConversationError, Rendering, Renderings, render


@dataclass(frozen=True)
class Splice:
    """The rendering's tokens [lo, hi) (the generated turn's content) replaced by the sampled ids."""

    lo: int
    hi: int
    ids: np.ndarray  # int64 [n] the sampled ids, stop token left out
    offsets: np.ndarray  # int64 [n, 2] their character offsets in the rendering
    replaced: np.ndarray  # bool [n]: ids standing for a U+FFFD for invalid UTF-8
    prompt: tuple[np.ndarray, np.ndarray] | None = None  # the ids (and offsets) prompted with, replacing [0, lo)


def piece_bytes(info, ids: np.ndarray) -> bytes:
    """The UTF-8 bytes token ids `ids` stand for (`TokenizerInfo` pieces, concatenated)."""
    start, end = info.piece_start[ids], info.piece_start[ids + 1]  # [n]
    lens = end - start
    at = np.repeat(start - (np.cumsum(lens) - lens), lens) + np.arange(int(lens.sum()))
    return info.piece_data[at].tobytes()


def replaced_tokens(info, ids: np.ndarray, offsets: np.ndarray, text: str) -> np.ndarray:
    """bool [n]: the tokens `ids` (character `offsets` in `text`) that stand for a U+FFFD of the text with other
    bytes, as sampled byte tokens that are no UTF-8 do once spliced in (`sampled_offsets`). The tokens covering one
    U+FFFD are read together: a U+FFFD the tokenizer spells in three byte tokens is the text's own character, not
    flagged. What a stored splice leaves to find again: `xtcache align` flags them on the teacher side of a store
    whose teacher scored a same-tokenizer student's sampled ids."""
    ids = np.asarray(ids, dtype=np.int64)
    out = np.zeros(ids.shape[0], dtype=bool)
    if "\ufffd" not in text:
        return out
    offsets = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    for c in np.flatnonzero(np.frombuffer(text.encode("utf-32-le"), "<u4") == 0xFFFD).tolist():
        cover = np.flatnonzero((offsets[:, 0] <= c) & (offsets[:, 1] > c))  # empty spans (special tokens) cover none
        if cover.shape[0]:
            a, b = int(offsets[cover, 0].min()), int(offsets[cover, 1].max())
            out[cover] |= piece_bytes(info, ids[cover]) != text[a:b].encode("utf-8")
    return out


def byte_offsets(text: str, lens: np.ndarray) -> np.ndarray:
    """int64 [n, 2] character offsets in `text` of tokens of `lens` bytes each that spell it in order;
    a token inside a multi-byte character covers that character."""
    return _char_spans(text_bytes(text)[1], lens)


def _char_spans(byte_of_char: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """int64 [n, 2] character offsets of consecutive byte runs of `lens` bytes, from the byte offset of each
    character (int64 [chars + 1]): a run inside a character covers that character."""
    end = np.cumsum(lens)
    start = end - lens
    return np.stack([np.searchsorted(byte_of_char, start, side="right") - 1,
                     np.searchsorted(byte_of_char, end, side="left")], axis=1).astype(np.int64)


def replaced_text(data: bytes) -> tuple[str, np.ndarray, np.ndarray]:
    """`data` decoded as UTF-8 with each invalid run replaced by one U+FFFD, as a tokenizer decodes sampled
    byte tokens that are no UTF-8 (`bytes.decode(errors="replace")`), the byte offset at which each of its
    characters starts (int64 [chars + 1], the last one len(data)) and which characters replace an invalid
    run (bool [chars]; a U+FFFD spelled by its own valid bytes is not one)."""
    chars, starts, bad_at, p = [], [], [], 0
    while p < len(data):
        try:
            good = data[p:].decode("utf-8")
            bad = None
        except UnicodeDecodeError as e:
            good, bad = data[p:p + e.start].decode("utf-8"), (p + e.start, p + e.end)
        chars.append(good)
        starts.append(p + text_bytes(good)[1][:-1])
        if bad is None:
            break
        bad_at.append(sum(map(len, chars)))
        chars.append("\ufffd")
        starts.append(np.asarray([bad[0]], dtype=np.int64))
        p = bad[1]
    text = "".join(chars)
    replaced = np.zeros(len(text), dtype=bool)
    replaced[bad_at] = True
    return text, np.concatenate([*starts, [len(data)]]).astype(np.int64), replaced


def sampled_offsets(info, body: np.ndarray, text: str, skipped: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """int64 [n, 2] character offsets in `text` of the sampled ids `body` when they spell it, and which of them
    cover a U+FFFD that replaces invalid UTF-8 (bool [n]: their bytes are not the text's); None when they do
    not spell it. They spell it when their bytes are its UTF-8 bytes, or decode to it with invalid runs
    replaced by U+FFFD (byte tokens sampled out of order, a character cut by --max-new-tokens). Special
    tokens sampled inside the text (`skipped`, the tokenizer's `TokenizerInfo.control`) stand for no
    characters, as the decoded text leaves them out: each gets an empty span where it was sampled."""
    special = skipped[body]
    lens = np.where(special, 0, np.diff(info.piece_start)[body])
    data = piece_bytes(info, body[~special])
    if data == text.encode("utf-8"):
        spans, replaced = byte_offsets(text, lens), np.zeros(body.shape[0], dtype=bool)
    else:
        decoded, byte_of_char, by_char = replaced_text(data)
        if decoded != text:
            return None
        spans = _char_spans(byte_of_char, lens)
        seen = np.concatenate(([0], np.cumsum(by_char)))  # replaced characters before each character position
        replaced = seen[spans[:, 1]] > seen[spans[:, 0]]
    spans[special, 1] = spans[special, 0]  # empty, also between the bytes of one character (it covers none of it)
    return spans, replaced


def turn_splice(r: Rendering, last_msg: int, sampled_ids, info, skipped: np.ndarray,
                prompt: tuple[str, np.ndarray, np.ndarray] | None = None) -> Splice | None:
    """How the sampled ids of message `last_msg` (the generated turn) replace its content's tokens in
    rendering `r`; None when they do not spell the content (see the module) or the content is empty.
    The ids spell the message's own text; where the template trimmed its whitespace, the tokens that
    stand for the trimmed characters only get an empty span at the content's edge. `prompt`: the text, ids and
    offsets `generate` prompted with (the generation prompt's text encoded alone); where that text is the
    rendering's up to the content and the rendering tokenizes it otherwise (a merge across the content's
    start: `ĊĊ` before a digit, `Ċ Ċ` before a letter), those ids replace the rendering's there too."""
    k = next((k for k, (m, field, _) in enumerate(r.located.texts) if m == last_msg and field == 1), None)
    if k is None or r.located.at[k] < 0 or r.located.width[k] == 0:
        return None
    a = r.located.at[k]
    b = a + r.located.width[k]  # the content's characters [a, b) in the rendering
    skip = r.located.skip[k]  # leading characters of the message's text the template trimmed
    ids = np.asarray(sampled_ids, dtype=np.int64)
    if ids.shape[0] == 0 or np.any((ids < 0) | (ids >= info.vocab_size)):
        return None
    stop = ids[-1:] if skipped[ids[-1]] else ids[:0]  # a special last id: the turn's stop token
    body = ids[:ids.shape[0] - stop.shape[0]]
    if body.shape[0] == 0:
        return None
    touch = np.flatnonzero((r.offsets[:, 1] > a) & (r.offsets[:, 0] < b))  # tokens sharing a character with it
    if touch.shape[0] == 0:
        return None
    lo, hi = int(touch[0]), int(touch[-1]) + 1
    if r.offsets[lo, 0] != a or r.offsets[hi - 1, 1] != b:  # a token straddles template text and content
        return None
    if stop.shape[0] and (hi >= r.ids.shape[0] or r.ids[hi] != stop[0]):
        return None  # stopped on a token that is not the one the template writes after the turn
    message = r.located.texts[k][2]
    if message[skip:skip + b - a] != r.text[a:b]:
        return None
    spelled = sampled_offsets(info, body, message, skipped)
    if spelled is None:
        return None
    off = a + np.clip(spelled[0], skip, skip + b - a) - skip
    if prompt is not None and prompt[0] == r.text[:a] and not np.array_equal(r.ids[:lo], prompt[1]):
        return Splice(lo, hi, body, off, spelled[1], prompt[1:])
    return Splice(lo, hi, body, off, spelled[1])


def splice_rollouts(side: Renderings, rows: list, info, skipped: np.ndarray) -> tuple[Renderings, list[bool]]:
    """`side` (one student's Renderings of a batch of conversations) with the generated turn of each
    rollout row spliced in, and per conversation whether the sampled ids replaced other tokens there.
    `rows[d]`: conversation d's (message count, sampled ids, the generation prompt as `turn_splice` takes it
    or None), None for a row that is no rollout of this student (its `TokenizerInfo` `info`, and
    `info.control` as `skipped`). A turn they do not spell keeps the rendering's tokens (False)."""
    spliced = [False] * len(side)
    starts = np.cumsum(side.counts) - side.counts
    counts = side.counts.copy()
    ids, offs, rep, cut = [], [], [], 0
    was = np.zeros(side.ids.shape[0], dtype=bool) if side.replaced is None else side.replaced
    for d, row in enumerate(rows):
        sp = None if row is None else turn_splice(side[d], row[0] - 1, row[1], info, skipped, row[2])
        if sp is None:
            continue
        spliced[d] = not np.array_equal(side[d].ids[sp.lo:sp.hi], sp.ids)
        if not spliced[d] and sp.prompt is None:
            continue
        at, lo = int(starts[d]), 0 if sp.prompt is not None else sp.lo
        new_ids, new_offs = (sp.ids, sp.offsets) if sp.prompt is None else (
            np.concatenate([sp.prompt[0], sp.ids]), np.concatenate([sp.prompt[1], sp.offsets]))
        ids += [side.ids[cut:at + lo], new_ids]
        offs += [side.offsets[cut:at + lo], new_offs]
        rep += [was[cut:at + lo], np.zeros(new_ids.shape[0] - sp.ids.shape[0], dtype=bool), sp.replaced]
        cut = at + sp.hi
        counts[d] += new_ids.shape[0] - (sp.hi - lo)
    if not ids:
        return side, spliced
    replaced = np.concatenate([*rep, was[cut:]])
    return Renderings(side.texts, np.concatenate([*ids, side.ids[cut:]]), np.concatenate([*offs, side.offsets[cut:]]),
                      counts, side.located, side.marker_ids, replaced if replaced.any() else None), spliced


def generation_prompt(tokenizer, conv: dict) -> tuple[str, np.ndarray, np.ndarray] | None:
    """The text, ids and character offsets `generate` prompted a rollout's student with
    (`stage1_teacher.onpolicy.rollouts.prompt_of`: the conversation before its generated turn, rendered with
    the generation prompt and encoded alone), or None where the template refuses it."""
    try:
        text = render(tokenizer, {**conv, "messages": conv["messages"][:-1]}, add_generation_prompt=True)
    except ConversationError:
        return None
    ids, offsets = encode_with_offsets(tokenizer, text, add_special_tokens=False, side="student tokenizer")
    return text, np.asarray(ids, dtype=np.int64), np.asarray(offsets, dtype=np.int64)


def splice_batch(side: Renderings, live: list[int], docs: list, convs: list[dict],
                 student) -> tuple[Renderings, set[int]]:
    """`splice_rollouts` for the conversations `live` of a prep batch (`side`: their renderings by
    `student`, a `prep.StudentSide`, in that order): the rows `docs[i]` that `student` sampled, and
    the set of those `i` spliced."""
    rows = [(len(convs[i]["messages"]), docs[i].sampled.ids, generation_prompt(student.tokenizer, convs[i]))
            if docs[i].sampled is not None and docs[i].sampled.chat == student.fingerprint else None for i in live]
    if not any(rows):
        return side, set()
    side, flags = splice_rollouts(side, rows, student.info, student.info.control)
    return side, {i for i, f in zip(live, flags) if f}


@dataclass(frozen=True)
class TextSplice:
    """A text rollout's student tokens with the sampled ids spliced in (`text_splice`)."""

    ids: np.ndarray  # [n] the prefix's ids, the sampled ids, the tokenizer's appended end tokens
    offsets: np.ndarray  # [n, 2] their character offsets in the whole text
    replaced: np.ndarray  # bool [n]: sampled ids covering a U+FFFD for invalid UTF-8


def text_splice(student, text: str, prefix_chars: int, sampled, ids: np.ndarray,
                offsets: np.ndarray) -> TextSplice | None:
    """A text rollout's student tokens with the ids `sampled` (a `corpus.Sampled`) spliced in (module
    docstring), or None when they do not spell the completion, or already are the re-tokenized ids `ids` /
    `offsets` (the whole text's encoding, special tokens added, offsets as `encode_flat` gives them).
    `student`: a `prep.StudentSide` (its tokenizer, `info` and `appended`). They spell it as a conversation
    turn's ids do (`sampled_offsets`): byte for byte, or with U+FFFD for invalid UTF-8 (those tokens are
    marked `replaced`: a plain-text store's alignment checks every other token's bytes against the text),
    special tokens inside with an empty span."""
    info, skipped = student.info, student.info.control
    body = np.asarray(sampled.ids, dtype=np.int64)
    if np.any((body < 0) | (body >= info.vocab_size)):
        return None  # ids of no token of this tokenizer (an lm_head padded past it)
    if sampled.stop_reason == "stop" and body.shape[0] and skipped[body[-1]]:
        body = body[:-1]  # the stop token: the text does not hold it
    if body.shape[0] == 0:
        return None
    spelled = sampled_offsets(info, body, text[prefix_chars:], skipped)
    if spelled is None:
        return None
    p_ids, p_off = encode_with_offsets(student.tokenizer, text[:prefix_chars], add_special_tokens=True,
                                       side="student tokenizer")
    tail = student.appended  # tokens the tokenizer appends after a text: after the completion, not the prefix
    p_ids, p_off = p_ids[:p_ids.shape[0] - tail], p_off[:p_off.shape[0] - tail]
    new_ids = np.concatenate([p_ids, body, ids[ids.shape[0] - tail:]])
    new_off = np.concatenate([p_off, prefix_chars + spelled[0], offsets[offsets.shape[0] - tail:]])
    if np.array_equal(new_ids, ids):
        return None
    replaced = np.zeros(new_ids.shape[0], dtype=bool)
    replaced[p_ids.shape[0]:p_ids.shape[0] + body.shape[0]] = spelled[1]
    return TextSplice(new_ids.astype(ids.dtype), new_off.astype(offsets.dtype), replaced)
