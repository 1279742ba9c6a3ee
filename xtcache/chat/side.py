"""One model's tokenizer as a store keys it, resolved once: loaded, its template required where a
conversation corpus needs one, fingerprinted, its end-of-turn candidates listed.

    side = tokenizer_side("models/student", "student tokenizer", conversation=True)
    side.fingerprint      # the alignment group's key: the tokenizer with its chat template
    side.tokenizer_fp     # the tokenizer alone (what a plain-text store and the cache key record)

Stage 1's plan (teacher and students), `xtcache align`, `xtcache generate`'s rollouts and stage 2's
loader all take their tokenizer sides from here, so the four agree on what a side's key is.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from xtcache.chat.render import chat_fingerprint, require_template, turn_marker_ids
from xtcache.fingerprint import tokenizer_fingerprint
from xtcache.tokenizer import load_tokenizer


@dataclass(frozen=True)
class TokenizerSide:
    """A tokenizer with the keys a store gives it."""

    source: str  # the directory it was loaded from, or the name given for a tokenizer object
    tokenizer: Any
    tokenizer_fp: str  # tokenizer.json alone
    fingerprint: str  # the key of its alignment group: with its chat template for a conversation corpus
    turn_markers: tuple[int, ...]  # conversation corpus: its special added tokens (end-of-turn candidates)


def tokenizer_side(source: str | Path | Any, role: str, *, conversation: bool) -> TokenizerSide:
    """The side of `source` (a tokenizer directory or a loaded tokenizer); `role` names it in errors
    ("student tokenizer"). A conversation corpus needs a chat template: ConversationError without one."""
    if isinstance(source, (str, Path)):
        name, tok = str(source), load_tokenizer(str(source), role)
    else:
        name, tok = getattr(source, "name_or_path", "") or role, source
    plain = tokenizer_fingerprint(tok)
    if not conversation:
        return TokenizerSide(name, tok, plain, plain, ())
    require_template(tok, f"{role} ({name})")
    return TokenizerSide(name, tok, plain, chat_fingerprint(tok), tuple(turn_marker_ids(tok)))
