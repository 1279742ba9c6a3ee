"""The sampled turn of a rollout row in the alignment group of the student that sampled it.

`xtcache generate` records, per rollout row, the student token ids it sampled for the generated
(last assistant) turn and their log-probs under the sampling policy (`corpus.Sampled`).
`teacher-dump` renders the conversation with the student's template (`xtcache.chat.layout`) and, in the
alignment group whose chat fingerprint is the sampling student's, splices the sampled ids into that
rendering where they spell the turn but re-tokenizing gives other ids (`stage1_teacher.onpolicy.splice`),
before aligning it. `attach_sampled` then checks that the stored tokens of the turn are the sampled
ones and stores their log-probs per student token (`AlignmentRecord.sampled_logprobs`, the store's
optional `sampled_logprobs` array): NaN everywhere else, and on the whole turn when the ids differ.
Counted, for `xtcache inspect`: `sampled_mismatch`, the turns whose sampled ids are not the
re-tokenized ones, and of them `sampled_same_text`, those spliced (trained on the sampled ids);
the others keep the re-tokenized ids and no log-probs.

Tokens the template writes after the sampled ones (its end-of-turn marker after a turn cut by
`--max-new-tokens`) were not written by the student: they get the template role (no training on
them, for any loss), so a truncated turn does not teach the student to end there. A turn cut by
`--max-new-tokens` (`stop_reason` "length") whose ids were re-tokenized loses the role of its
end-of-turn markers (the student tokenizer's special added tokens in the turn) the same way.

A text rollout (a text prefix and its completion, `prefix_chars`) has no template: `stage1_teacher.prep`
gives its completion's tokens the generated turn's role (`prefix_roles`), and `attach_sampled(text=True)`
compares them with the sampled ids less the stop token, which the text does not hold.

    python -c "import stage1_teacher.onpolicy.sampled as s; help(s.attach_sampled)"
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from schemas.roles import LAST_ASSISTANT, ROLE_TEMPLATE
from stage1_teacher.corpus.rows import Sampled
from xtcache.store import AlignmentRecord


def attach_sampled(record: AlignmentRecord, sampled: Sampled, spliced: bool = False,
                   markers: np.ndarray | None = None, *, text: bool = False,
                   untrained: np.ndarray | None = None) -> AlignmentRecord:
    """The record with its sampling log-probs (float32 [S], NaN where not sampled), the roles of
    template tokens after the sampled ones cleared, and stats `sampled_turns` 1, `sampled_mismatch`
    1 when the turn's re-tokenized ids are not the sampled ids, and `sampled_same_text` 1 when, so,
    the sampled ids were `spliced` into the record (`stage1_teacher.onpolicy.splice`). `markers`: the
    student's end-of-turn candidates, untrained in a turn cut by --max-new-tokens. `text`: a text rollout,
    whose text holds no stop token: a completion that stopped is compared without its last sampled id.
    `untrained`: bool [V + 1], the ids a decode leaves out (`TokenizerInfo.control`); one sampled inside the turn, not as
    its stop token, keeps its place but gets the template role: no loss trains it (the teacher's text has
    nothing there to score it against, and CE on it would teach the student to sample it again)."""
    ids, roles = np.asarray(record.student_ids), np.asarray(record.student_role)
    turn = np.flatnonzero(roles & LAST_ASSISTANT)  # [t] the generated turn's student tokens
    want = np.asarray(sampled.ids, dtype=np.int64)
    lps = np.asarray(sampled.logprobs, dtype=np.float32)
    if text and sampled.stop_reason == "stop" and len(want):
        want, lps = want[:-1], lps[:-1]  # the stop token ended the completion; the text does not hold it
    n = len(want)
    logprobs = np.full(len(ids), np.nan, dtype=np.float32)
    contiguous = len(turn) > 0 and int(turn[-1] - turn[0]) + 1 == len(turn)
    same = (n == len(turn) == 0  # an empty completion (stopped at once): no token, none re-tokenized
            or contiguous and n <= len(turn) and np.array_equal(ids[turn[:n]].astype(np.int64), want))
    stats = {**(record.stats or {}), "sampled_turns": 1, "sampled_mismatch": int(spliced or not same),
             "sampled_same_text": int(spliced and same)}
    roles = roles.copy()
    if same:
        logprobs[turn[:n]] = lps
        roles[turn[n:]] = ROLE_TEMPLATE  # written by the template after a length stop, not sampled
        if untrained is not None and n:
            inside = turn[:n - 1] if not text and sampled.stop_reason == "stop" else turn[:n]  # the stop stays
            roles[inside[untrained[ids[inside]]]] = ROLE_TEMPLATE
    elif sampled.stop_reason == "length" and markers is not None:  # re-tokenized: the template's end marker
        roles[turn[np.isin(ids[turn], markers)]] = ROLE_TEMPLATE
    return replace(record, student_role=roles, stats=stats, sampled_logprobs=logprobs)
