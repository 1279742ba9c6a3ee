"""The sampled turn of a rollout row in the alignment group of the student that sampled it.

`xtcache generate` records, per rollout row, the student token ids it sampled for the generated
(last assistant) turn and their log-probs under the sampling policy (`corpus.Sampled`).
`teacher-dump` re-tokenizes the student's rendering of the conversation (`xtcache.chat`); in the
alignment group whose chat fingerprint is the sampling student's, `attach_sampled` checks that the
stored tokens of the turn are the sampled ones and stores their log-probs per student token
(`AlignmentRecord.sampled_logprobs`, the store's optional `sampled_logprobs` array): NaN everywhere
else, and on the whole turn when the ids differ (counted as `sampled_mismatch`, reported by
`xtcache inspect`; the re-tokenized ids are kept, the sampled ones are not spliced in; of those,
`sampled_same_text` counts the turns whose sampled ids still spell the rendered turn).

Tokens the template writes after the sampled ones (its end-of-turn marker after a turn cut by
`--max-new-tokens`) were not written by the student: they get the template role (no training on
them, for any loss), so a truncated turn does not teach the student to end there.

    python -c "import stage1_teacher.sampled as s; help(s.attach_sampled)"
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from stage1_teacher.corpus.rows import Sampled
from xtcache.chat import LAST_ASSISTANT, ROLE_TEMPLATE
from xtcache.store import AlignmentRecord


def attach_sampled(record: AlignmentRecord, sampled: Sampled, tokenizer) -> AlignmentRecord:
    """The record with its sampling log-probs (float32 [S], NaN where not sampled), the roles of
    template tokens after the sampled ones cleared, and stats `sampled_turns` 1, `sampled_mismatch`
    1 when the turn's stored ids are not the sampled ids, and `sampled_same_text` 1 when, so, the
    sampled ids still spell the turn's rendered text (decoded by the student `tokenizer`, special
    tokens left out; a decoding with U+FFFD, which stands for bytes that are no UTF-8, never counts):
    another tokenization of the same text, which splicing would train on."""
    ids, roles = np.asarray(record.student_ids), np.asarray(record.student_role)
    turn = np.flatnonzero(roles & LAST_ASSISTANT)  # [t] the generated turn's student tokens
    want = np.asarray(sampled.ids, dtype=np.int64)
    n = len(want)
    logprobs = np.full(len(ids), np.nan, dtype=np.float32)
    stats = {**(record.stats or {}), "sampled_turns": 1, "sampled_mismatch": 0, "sampled_same_text": 0}
    contiguous = len(turn) > 0 and int(turn[-1] - turn[0]) + 1 == len(turn)
    if contiguous and n <= len(turn) and np.array_equal(ids[turn[:n]].astype(np.int64), want):
        logprobs[turn[:n]] = np.asarray(sampled.logprobs, dtype=np.float32)
        roles = roles.copy()
        roles[turn[n:]] = ROLE_TEMPLATE  # written by the template after a length stop, not sampled
    else:
        stats["sampled_mismatch"] = 1
        rendered = tokenizer.decode(ids[turn].tolist(), skip_special_tokens=True)
        spelled = tokenizer.decode(list(sampled.ids), skip_special_tokens=True)
        stats["sampled_same_text"] = int(spelled == rendered and "\ufffd" not in spelled)  # U+FFFD: lossy bytes
    return replace(record, student_role=roles, stats=stats, sampled_logprobs=logprobs)
