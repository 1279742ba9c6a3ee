"""Rollouts of `xtcache generate`: prompts from corpus rows, rollout rows, the policy fingerprint and
the output directory's files.

A prompt is a conversation whose last message is the user's (rendered with the student's own chat
template and its generation prompt) or a plain-text prefix. A rollout row is what `teacher-dump
--data 'OUT/parts/*.jsonl'` reads as it is: `messages` (the prompt's messages plus the generated
assistant turn) or `text` (prefix + completion, with `prefix_chars`), and beside them what on-policy
training needs: `sampled_ids`, `sampled_logprobs` (log-probs under the sampling policy, after
temperature and top-p), `prompt_token_ids`, `stop_reason`, `prompt_id`, `sample`, `policy`.

Output directory layout (`--out`):

    manifest.json              policy fingerprint, its parts, the sampling settings (created once)
    claims/w00000.json         the writer claim (xtcache.store.claims)
    parts/w00000-p00000.jsonl  part p of writer w (written whole: temp file + rename, or one PUT)
    index/w00000.json          the committed parts of writer w (rewritten after each part)
    done/w00000.json           writer w generated all its parts

    python -c "import stage1_teacher.onpolicy.rollouts as r; help(r.policy_fingerprint)"
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from xtcache.chat.render import ConversationError, chat_fingerprint, conversation_json, render, require_template
from xtcache.chat.spans import placeholder_base
from xtcache.errors import ConfigError, StoreError
from xtcache.fingerprint import canonical_sha256, model_fingerprint
from xtcache.store.reader import foreign_entries, shown_entries

ROLLOUT_FORMAT = 1
MANIFEST = "manifest.json"
ENTRIES = frozenset({MANIFEST, "claims", "parts", "index", "done"})  # the output directory's (module docstring)


@dataclass(frozen=True)
class Prompt:
    """One prompt of the prompt set, tokenized for the student."""

    prompt_id: str  # the corpus document id
    where: str  # "file row N", for messages
    token_ids: list[int]
    conversation: dict | None = None  # {"messages": [...], ("tools": [...])}; None: a text prefix
    text: str = ""  # the prefix (text prompts)


@dataclass(frozen=True)
class Completion:
    """One sampled completion: its token ids (with the stop token when it stopped), their log-probs
    under the sampling policy, and why it ended."""

    ids: list[int]
    logprobs: list[float]
    stop_reason: str  # "stop" | "length"


def prompt_of(doc, tokenizer, flag: str = "--data") -> Prompt:
    """The Prompt of a corpus Document; ConfigError naming `flag`, the file and the row when it cannot be one."""
    where = f"{doc.source} row {doc.row}"
    if not doc.conversation:
        ids = tokenizer(doc.text, add_special_tokens=True)["input_ids"]
        return Prompt(doc.doc_id, where, list(ids), None, doc.text)
    conv = json.loads(doc.text)
    last = conv["messages"][-1].get("role")
    if last not in ("user", "human"):
        raise ConfigError(f"{flag} {where}: the last message is the {last!r}'s; a prompt conversation ends with "
                          "the user's message (the student writes the next assistant turn)")

    require_template(tokenizer, "student")
    try:
        text = render(tokenizer, conv, where=f"{flag} {where} (the student's template)", add_generation_prompt=True)
    except ConversationError as e:
        raise ConfigError(str(e)) from None
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]  # the template writes its own specials
    return Prompt(doc.doc_id, where, list(ids), conv)


# a token more at each cut between template text and a message's text: tokenized with its neighbour, text tokenizes
# otherwise than alone (the Llama-3-style toy student's `ĊĊ` before a digit, `Ċ Ċ` before a letter)
JUNCTION = 1


@dataclass(frozen=True)
class RolloutSize:
    """At most how many student tokens one rollout of a prompt holds in a teacher-dump cache (`rollout_size`)."""

    tokens: int
    """The whole rollout."""
    turn: int | None
    """A conversation's generated turn and the template text around it: from the end of the prompt's last message
    to the rollout's end (None: a text rollout, or a last message without text)."""


def rollout_size(prompt: Prompt, tokenizer, max_new_tokens: int) -> RolloutSize | None:
    """The most student tokens of one rollout of `prompt`, its generated turn counted as the sampled ids it trains
    on (at most `max_new_tokens`, spliced into the rendering: `stage1_teacher.onpolicy.splice`). A text rollout:
    the prefix's ids, the turn and the tokenizer's own special tokens. A conversation, rendered with a
    placeholder for the turn (and one for the last message, for `turn`): the tokens before the turn (the
    prompt's, or the rendering's where its template writes more there), the turn and the template's text after
    it, with a `JUNCTION` token at each cut. None where the student's template rejects the placeholders or
    writes the turn other than once."""
    if prompt.conversation is None:
        return RolloutSize(len(prompt.token_ids) + max_new_tokens + tokenizer.num_special_tokens_to_add(), None)
    conv, count = prompt.conversation, lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])
    *before, last = conv["messages"]
    try:
        base = placeholder_base(conversation_json(conv) + render(tokenizer, conv, add_generation_prompt=True), 2)
        if base is None:
            return None
        mark, turn = chr(base), chr(base + 1)  # in neither the conversation nor the prompt: each one is ours
        answered = {"role": "assistant", "content": turn}
        whole = render(tokenizer, {**conv, "messages": [*before, last, answered]})
        marked = render(tokenizer, {**conv, "messages": [*before, {**last, "content": mark}, answered]}) \
            if isinstance(last.get("content"), str) and last["content"].strip() else ""
    except ConversationError:
        return None
    if whole.count(turn) != 1:
        return None
    head, tail = whole.split(turn)
    tokens = max(len(prompt.token_ids), count(head) + JUNCTION) + max_new_tokens + count(tail) + JUNCTION
    if marked.count(mark) != 1 or marked.count(turn) != 1 or marked.index(mark) > marked.index(turn):
        return RolloutSize(tokens, None)
    gap = count(marked[marked.index(mark) + 1:marked.index(turn)])
    return RolloutSize(tokens, gap + max_new_tokens + count(tail) + 2 * JUNCTION if gap else None)


def completion_text(tokenizer, c: Completion, stop_ids: set[int]) -> str:
    """The completion's text: its ids without the stop token, special tokens left out."""
    ids = c.ids[:-1] if c.stop_reason == "stop" and c.ids and c.ids[-1] in stop_ids else c.ids
    return tokenizer.decode(ids, skip_special_tokens=True)


def rollout_row(prompt: Prompt, sample: int, c: Completion, text: str, policy: str, chat: str) -> dict:
    """One row of a part file (a conversation row or a text row; both with the sampling record and the
    student's chat fingerprint `chat`, which names the alignment group teacher-dump stores it in)."""
    if prompt.conversation is not None:
        head = {"messages": [*prompt.conversation["messages"], {"role": "assistant", "content": text}]}
        if prompt.conversation.get("tools"):
            head["tools"] = prompt.conversation["tools"]
    else:
        head = {"text": prompt.text + text, "prefix_chars": len(prompt.text)}
    return {**head, "stop_reason": c.stop_reason, "prompt_id": prompt.prompt_id, "sample": sample, "policy": policy,
            "chat_fingerprint": chat, "sampled_ids": c.ids, "sampled_logprobs": [round(float(x), 6) for x in c.logprobs],
            "prompt_token_ids": prompt.token_ids}


def sample_seed(seed: int, prompt_id: str, sample: int) -> int:
    """The seed of one (prompt, sample) draw: a function of (--seed, prompt id, sample index) only,
    so a resumed or re-sharded job draws the same."""
    h = hashlib.sha256(f"{seed}:{prompt_id}:{sample}".encode()).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 63) - 1)


def policy_settings(sampling) -> dict:
    return {"samples_per_prompt": sampling.samples_per_prompt, "temperature": sampling.temperature,
            "top_p": sampling.top_p, "max_new_tokens": sampling.max_new_tokens, "seed": sampling.seed}


def policy_fingerprint(student: str, tokenizer, sampling) -> dict:
    """The policy that writes the rollouts: sha256 over the checkpoint's model fingerprint, its
    tokenizer + chat template fingerprint (`xtcache.chat.render.chat_fingerprint`) and the sampling
    settings. Returns {"policy", "model", "chat", "sampling"}."""
    parts = {"model": model_fingerprint(student), "chat": chat_fingerprint(tokenizer),
             "sampling": policy_settings(sampling)}
    return {"policy": canonical_sha256(parts), **parts}


# ------------------------------------------------------------------------------------ files


def part_name(writer: int, part: int) -> str:
    return f"parts/w{writer:05d}-p{part:05d}.jsonl"


def index_name(writer: int) -> str:
    return f"index/w{writer:05d}.json"


def done_name(writer: int) -> str:
    return f"done/w{writer:05d}.json"


def write_part(loc, rel: str, rows: list[dict]) -> str:
    """Write one part file whole (local: temp file, fsync, rename; remote: one PUT, which object
    stores make visible atomically); returns the sha256 of its bytes."""
    data = "".join(json.dumps(r, ensure_ascii=False, separators=(",", ":")) + "\n" for r in rows).encode("utf-8")
    loc.write_bytes_atomic(rel, data)
    return hashlib.sha256(data).hexdigest()


def open_manifest(loc, manifest: dict) -> dict:
    """Create `manifest.json`, or check that the one there was written for the same policy and
    settings; StoreError naming --out otherwise. A directory without a manifest that holds other entries is
    refused: the rollouts would be written among files that are not theirs."""
    if not loc.exists(MANIFEST) and (extra := foreign_entries(loc, ENTRIES)):
        raise ConfigError(f"--out {loc.url} holds no rollouts but other entries ({shown_entries(extra)}); give a new "
                          "or empty directory for the rollouts")
    if loc.create_exclusive(MANIFEST, manifest):
        return manifest
    have = loc.read_json(MANIFEST) or {}
    if have.get("kind") != manifest["kind"]:
        raise StoreError(f"--out {loc.url}: it holds something other than rollouts ({MANIFEST} kind "
                         f"{have.get('kind')!r}); give an empty or a rollouts directory")
    several = manifest["num_shards"] > 1  # one job reads every row under any split
    for key in ("policy", "engine", "prompts_per_part", "num_shards", "data", *(("split",) if several else ())):
        if have.get(key) != manifest[key]:
            raise StoreError(f"--out {loc.url}: its rollouts were written with another {key} ({have.get(key)!r}, this "
                             f"run: {manifest[key]!r}); a rollout directory holds one policy's samples of one prompt "
                             "set: use another --out")
    return have


def committed_parts(loc, writer: int) -> dict[int, dict]:
    """The parts of `writer` named by its index: {part: {"name", "rows", "prompts", "sha256"}}."""
    raw = loc.read_json(index_name(writer)) or {"parts": []}
    return {int(p["part"]): p for p in raw["parts"]}
