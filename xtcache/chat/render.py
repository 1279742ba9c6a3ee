"""Conversations as each model renders them: rows, chat templates, renderings and their tokens.

A conversation is `{"messages": [{role, content, ...}], "tools": [...]}` (tool calls, a `name` and a
reasoning field such as `reasoning_content` pass through to the template as they are). Each model
renders it with the chat template of its own tokenizer (`render`); `renderings` tokenizes a batch of
renderings in one call and locates every message's text in them (`xtcache.chat.runs`), and
`flat_side` joins one side of a batch into the batch coordinates that the layout
(`xtcache.chat.layout`) and its self-check (`xtcache.chat.check`) work in. The role codes a store
keeps per token are `schemas.roles`; `trained_roles` turns them into `--train-on` masks.

    python -c "from xtcache.chat.render import render; help(render)"
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import numpy as np

from schemas.roles import LAST_ASSISTANT, ROLE_ASSISTANT, ROLE_CODES, ROLE_OTHER
from xtcache.align.tokenizer import encode_flat
from xtcache.chat import runs as chat_runs
from xtcache.chat.spans import Located
from xtcache.errors import ConfigError
from xtcache.fingerprint import tokenizer_fingerprint

TRAIN_ON = ("assistant", "all", "last-assistant")


class ConversationError(ConfigError):
    """A conversation row or a chat template that cannot be used (names the row or the tokenizer)."""


def role_code(role: str) -> int:
    return ROLE_CODES.get(role, ROLE_OTHER)


def trained_roles(codes: np.ndarray, train_on: str) -> np.ndarray:
    """bool mask of the role codes `--train-on` trains on: assistant (every assistant message,
    end-of-turn included), last-assistant (the final assistant message only) or all (everything)."""
    if train_on == "all":
        return np.ones(codes.shape, dtype=bool)
    if train_on == "assistant":
        return (codes & 0x7F) == ROLE_ASSISTANT
    if train_on == "last-assistant":
        return (codes & LAST_ASSISTANT) != 0
    raise ConfigError(f"--train-on {train_on!r}: use one of {', '.join(TRAIN_ON)}")


# ------------------------------------------------------------------------------------ rows


def parse_conversation(messages, tools=None) -> dict | str:
    """`{"messages": [...], "tools": [...]}` from a corpus row's values, or the reason it is unusable.

    Messages are dicts with a string `role` and a string (or null, for a tool-call-only turn)
    `content`; every other key (tool_calls, name, reasoning_content, ...) passes to the template.
    `tools` may be a list or its JSON text.
    """
    if isinstance(messages, str):
        try:
            messages = json.loads(messages)
        except ValueError:
            return "messages field is not a list"
    if not isinstance(messages, (list, tuple)) or not messages:
        return "messages field is not a list" if not isinstance(messages, (list, tuple)) else "empty conversation"
    out = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            return "message without a role"
        content = m.get("content")
        if content is not None and not isinstance(content, str):
            return "message content is not a string"
        # Parquet/Arrow list-of-struct columns give every key of the schema: drop the absent ones
        clean = {k: v for k, v in m.items() if v is not None or k == "content"}
        for key in ("tool_calls",):
            if isinstance(clean.get(key), str):
                try:
                    clean[key] = json.loads(clean[key])
                except ValueError:
                    return f"{key} is not JSON"
        for call in clean.get("tool_calls") or []:
            fn = call.get("function") if isinstance(call, dict) else None
            if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                try:  # templates render arguments as a mapping (tojson / items())
                    fn["arguments"] = json.loads(fn["arguments"])
                except ValueError:
                    pass
        out.append(clean)
    if isinstance(tools, str):
        try:
            tools = json.loads(tools) if tools.strip() else None
        except ValueError:
            return "tools field is not JSON"
    if tools is not None and not isinstance(tools, (list, tuple)):
        return "tools field is not a list"
    if not any(isinstance(m.get("content"), str) and m["content"] for m in out):
        return "empty conversation"
    conv = {"messages": out}
    if tools:
        conv["tools"] = list(tools)
    return conv


def conversation_json(conv: dict) -> str:
    """The JSON text of a conversation as the store keeps it: compact, keys in the row's own order
    (templates render mappings such as tool schemas in insertion order, so sorting would change
    the rendered text)."""
    return json.dumps(conv, separators=(",", ":"), ensure_ascii=False)


# ------------------------------------------------------------------------------ templates


def chat_template(tokenizer) -> str | None:
    """The tokenizer's chat template text (a named set is serialised as sorted JSON); None without one."""
    t = getattr(tokenizer, "chat_template", None)
    if isinstance(t, dict):
        return json.dumps(t, sort_keys=True)
    return t or None


def require_template(tokenizer, side: str) -> str:
    t = chat_template(tokenizer)
    if t is None:
        raise ConversationError(f"the {side} has no chat template (no chat_template in its tokenizer_config.json "
                                "or chat_template.jinja): a conversation corpus is rendered with each model's own "
                                "template; give a tokenizer with one")
    return t


def chat_fingerprint(tokenizer) -> str:
    """Fingerprint of a tokenizer together with its chat template: what keys conversation caches
    and their alignment groups (a changed template is another tokenizer)."""
    body = json.dumps({"chat_template": chat_template(tokenizer), "tokenizer": tokenizer_fingerprint(tokenizer)},
                      sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(body.encode("utf-8")).hexdigest()


def turn_marker_ids(tokenizer) -> list[int]:
    """Ids of the tokenizer's special added tokens: the candidates for end-of-turn markers."""
    return sorted(int(i) for i, t in tokenizer.added_tokens_decoder.items() if getattr(t, "special", False))


def render(tokenizer, conv: dict, *, where: str = "", add_generation_prompt: bool = False) -> str:
    """The conversation in the tokenizer's chat template (with the template's generation prompt only
    when asked: a prompt for the next assistant turn). ConversationError naming `where` when the
    template rejects it."""
    try:
        text = tokenizer.apply_chat_template(conv["messages"], tools=conv.get("tools") or None, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    except Exception as e:  # jinja's TemplateError, raise_exception(), a template's own type errors
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConversationError(f"{where or 'a conversation'}: the chat template rejects it ({msg})") from None
    if not isinstance(text, str):
        raise ConversationError(f"{where or 'a conversation'}: the chat template did not render to text")
    return text


# The structure a template may open at the start of an assistant turn, before any content: a reasoning block, a
# tool call. Each probe is an assistant message that holds it, with a text only the structure writes.
_TURN_STRUCTURES = {
    "reasoning": ({"role": "assistant", "content": "Fine.", "reasoning_content": "Think it over."}, "Think it over."),
    "tool call": ({"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "lookup", "arguments": {"word": "cache"}}}]}, "lookup"),
}
_PROBE_TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Look a word up.", "parameters": {
    "type": "object", "properties": {"word": {"type": "string"}}}}}]


def _turn_prefix(tokenizer, message: dict) -> str | None:
    """The text `tokenizer`'s template writes between the generation prompt and the rest of `message`, an
    assistant turn after one user turn; None where the template does not extend the generation prompt (or
    rejects the probe)."""
    user = [{"role": "user", "content": "Hello?"}]
    try:
        prompt = render(tokenizer, {"messages": user, "tools": _PROBE_TOOLS}, add_generation_prompt=True)
        full = render(tokenizer, {"messages": [*user, message], "tools": _PROBE_TOOLS})
    except ConversationError:
        return None
    return full[len(prompt):] if full.startswith(prompt) else None


def turn_openers(teacher_tok, student_tok) -> dict[str, int]:
    """The teacher ids that open a structure at the start of an assistant turn which the student's template does
    not open with the same text: {structure: teacher id}.

    Where the teacher's template writes a turn without that structure straight after its generation prompt,
    the teacher's next-token distribution at a turn's first content position holds the probability of opening
    it ("<" of a reasoning block written `<think>` in text, say). The student's template writes the same turn
    another way (a Llama-3 template drops reasoning), so no text of the turn the student trains on can express
    it (docs/conversations.md, "Turn starts across templates")."""
    plain = _turn_prefix(teacher_tok, {"role": "assistant", "content": "Fine."})
    if plain is None or not plain.startswith("Fine."):
        return {}  # the template writes something before every turn's content: its content row follows that
    out = {}
    for name, (message, marker) in _TURN_STRUCTURES.items():
        prefix = _turn_prefix(teacher_tok, message)
        at = prefix.find(marker) if prefix else -1
        if at < 0 or (message["content"] and prefix.find(message["content"]) < at):
            continue  # the template does not write the structure, or not before the content
        enc = teacher_tok(prefix, add_special_tokens=False, return_offsets_mapping=True)
        if not enc["input_ids"] or enc["offset_mapping"][0][0] != 0 or enc["offset_mapping"][0][1] > at:
            continue  # no token of its own opens it
        opened = prefix[:enc["offset_mapping"][0][1]]
        if (_turn_prefix(student_tok, message) or "").startswith(opened):
            continue  # the student writes the structure with the same opening text: it can say it too
        out[name] = int(enc["input_ids"][0])
    return out


# ------------------------------------------------------------------------------ alignment


@dataclass
class Rendering:
    """One conversation as one model renders it: its text, its tokens and where the messages are
    (a view of one entry of `Renderings`)."""

    text: str
    ids: np.ndarray  # int64 [N]
    offsets: np.ndarray  # int64 [N, 2] character offsets in `text`
    located: Located
    marker_ids: np.ndarray  # int64: the tokenizer's end-of-turn candidates (special added tokens)

    @property
    def markers(self) -> np.ndarray:
        """bool [N]: the tokens that are end-of-turn candidates."""
        return np.isin(self.ids, self.marker_ids)


@dataclass
class Renderings:
    """One side of a batch of conversations, all rendered by one tokenizer's template: the texts,
    their tokens flat (`counts[d]` tokens of conversation d, offsets in its own text), where the
    messages are in each text, and the tokenizer's end-of-turn candidates. `renderings` builds it
    from one batch encoding; `align_conversations` reads it without copying per conversation."""

    texts: list[str]
    ids: np.ndarray  # int64 [N]
    offsets: np.ndarray  # int64 [N, 2]
    counts: np.ndarray  # int64 [D]
    located: list[Located]
    marker_ids: np.ndarray
    replaced: np.ndarray | None = None  # bool [N]: sampled tokens standing for a U+FFFD of the text (invalid
    #                                     UTF-8, `stage1_teacher.onpolicy.splice`): their chunk is not exact

    def __len__(self) -> int:
        return len(self.texts)

    def _starts(self) -> np.ndarray:
        return np.cumsum(self.counts) - self.counts

    def _view(self, d: int, start: int) -> Rendering:
        end = start + int(self.counts[d])
        return Rendering(self.texts[d], self.ids[start:end], self.offsets[start:end], self.located[d], self.marker_ids)

    def __getitem__(self, d: int) -> Rendering:
        return self._view(d, int(self._starts()[d]))

    def __iter__(self):
        return (self._view(d, a) for d, a in enumerate(self._starts().tolist()))

    def take(self, rows: list[int]) -> Renderings:
        """The conversations `rows` of this batch, in that order."""
        if rows == list(range(len(self))):
            return self
        rows_a = np.asarray(rows, dtype=np.int64)
        starts, counts = self._starts()[rows_a], self.counts[rows_a]
        tok = np.repeat(starts - (np.cumsum(counts) - counts), counts) + np.arange(int(counts.sum()))
        return Renderings([self.texts[d] for d in rows], self.ids[tok], self.offsets[tok], counts,
                          [self.located[d] for d in rows], self.marker_ids,
                          None if self.replaced is None else self.replaced[tok])


def renderings(tokenizer, texts: list[str], convs: list[dict], *, markers=None, encoded=None,
               side: str = "tokenizer", texts_of: Renderings | None = None) -> Renderings:
    """The Renderings of conversations `convs`, rendered by `tokenizer`'s template as `texts`: tokens
    without added special tokens (the template writes its own), in one batch encoding unless
    `encoded` gives them ((ids [N], offsets [N, 2], counts [D]), as `encode_flat` returns them),
    with each conversation's messages located in its text. `markers`: the end-of-turn candidates
    (default: the tokenizer's special added tokens); `texts_of`: Renderings of the same
    conversations by another template, whose collected message texts are reused."""
    if encoded is None:
        encoded = encode_flat(tokenizer, texts, add_special_tokens=False, side=side) if texts else \
            (np.zeros(0, np.int64), np.zeros((0, 2), np.int64), np.zeros(0, np.int64))
    ids, offs, counts = encoded
    if markers is None:
        markers = turn_marker_ids(tokenizer)
    msg_texts = [None] * len(texts) if texts_of is None else [x.texts for x in texts_of.located]
    located = chat_runs.locate_all(lambda c: render(tokenizer, c), list(texts), convs, msg_texts)
    return Renderings(list(texts), np.asarray(ids, dtype=np.int64), np.asarray(offs, dtype=np.int64).reshape(-1, 2),
                      np.asarray(counts, dtype=np.int64), located, np.asarray(markers, dtype=np.int64))



@dataclass
class Flat:
    """One side of a batch: tokens concatenated, offsets shifted into the joined texts."""

    ids: np.ndarray
    offs: np.ndarray  # batch-global character offsets (document d starts at base[d])
    counts: np.ndarray
    base: np.ndarray
    lens: np.ndarray  # characters of each rendering
    markers: np.ndarray  # bool [N]: end-of-turn candidates with a non-empty span


def flat_side(side: Renderings) -> Flat:
    lens = np.fromiter((len(x) for x in side.texts), dtype=np.int64, count=len(side))
    base = np.cumsum(lens + 1) - (lens + 1)
    offs = side.offsets + np.repeat(base, side.counts)[:, None]
    markers = np.isin(side.ids, side.marker_ids) & (offs[:, 1] > offs[:, 0])
    return Flat(side.ids, offs, side.counts, base, lens, markers)
