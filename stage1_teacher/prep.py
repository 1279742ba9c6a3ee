"""Document preparation for `xtcache teacher-dump`: tokenize, align, plan windows, form parts.

A writer's stream is the rows of the corpus ranges its shard plan gives it (see
`stage1_teacher.shard_plan`: contiguous Parquet row groups or whole files), in order. Usable
documents of that stream are grouped into parts of `--docs-per-part` documents: part j holds
documents [j * P, (j + 1) * P) of the stream, a fixed run that does not depend on timing,
batching or interruptions, so a resumed run rewrites exactly the parts an uninterrupted one would. Rows that cannot be used (see `corpus.Skipped`,
plus documents of fewer than 2 teacher tokens and texts the tokenizers cannot align) are skipped
with a reason, deterministically.

With a student tokenizer equal to the teacher's (same fingerprint) the alignment is the
identity and the text is not tokenized again; the rollouts that student sampled are spliced into the
teacher's tokens (`stage1_teacher.onpolicy.splice`), so the teacher scores the sampled ids.

Conversation corpora (`Preparer(conversation=True)`): each row is rendered with the teacher's chat
template (that rendering is the stored document text) and with each student's template, tokenized
without added special tokens (the templates write their own) and aligned by `xtcache.chat.layout`; a row
a template rejects is skipped with the reason "chat template rejected the row" and a warning
naming the row. A rollout row of `xtcache generate` gets its sampling log-probs in the group of the
student that sampled it (`stage1_teacher.onpolicy.sampled`).

    python -c "import stage1_teacher.prep as p; help(p.Preparer)"
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from schemas.roles import LAST_ASSISTANT, ROLE_ASSISTANT, ROLE_USER
from stage1_teacher.corpus import Document, Skipped
from stage1_teacher.onpolicy.sampled import attach_sampled
from stage1_teacher.onpolicy.splice import splice_batch, text_splice
from stage1_teacher.windows import Window, plan_windows, window_tokens
from xtcache.align.chunks import align_batch, align_offsets, batch_or_each, identity_alignment
from xtcache.align.tokenizer import encode_flat, tokenizer_info
from xtcache.chat.layout import align_conversations
from xtcache.chat.render import ConversationError, chat_fingerprint, render, renderings, turn_marker_ids
from xtcache.errors import AlignmentError
from xtcache.packing import common_boundaries
from xtcache.store import AlignmentRecord

log = logging.getLogger(__name__)

TOKENIZE_BATCH = 64


@dataclass
class StudentSide:
    """One student tokenizer and its alignment group."""

    name: str
    tokenizer: object
    fingerprint: str
    identity: bool
    info: object = None
    markers: object = None  # conversation corpora: the tokenizer's end-of-turn candidate ids
    appended: int = 0  # tokens the tokenizer appends after a text (an end-of-sequence); with `info`


@dataclass
class PreparedDoc:
    """A document ready for the teacher: tokens, offsets, alignments and windows."""

    doc: Document
    teacher_ids: np.ndarray  # int32 [T]
    offsets: np.ndarray  # int32 [T, 2]
    alignments: dict  # fingerprint -> AlignmentRecord
    windows: list[Window]
    conversation: str | None = None  # the conversation's JSON (doc.text is the teacher's rendering)

    @property
    def num_tokens(self) -> int:
        return int(self.teacher_ids.shape[0])


@dataclass
class Part:
    """Part `index` of this writer: its prepared documents and the rows skipped while forming it."""

    index: int
    docs: list[PreparedDoc]
    skipped: list[Skipped] = field(default_factory=list)


def adds_bos(tok) -> bool:
    """True when the tokenizer puts a BOS token first (later teacher windows then get one too)."""
    bos = tok.bos_token_id
    if bos is None:
        return False
    ids = tok.backend_tokenizer.encode("a", add_special_tokens=True).ids
    return bool(ids) and ids[0] == bos


def appended_specials(tok) -> int:
    """How many tokens the tokenizer appends after a text's own (an end-of-sequence), with special tokens on."""
    plain = tok.backend_tokenizer.encode("a", add_special_tokens=False).ids
    whole = tok.backend_tokenizer.encode("a", add_special_tokens=True).ids
    start = next(i for i in range(len(whole) - len(plain) + 1) if whole[i:i + len(plain)] == plain)
    return len(whole) - start - len(plain)


def prefix_roles(offsets: np.ndarray, prefix_chars: int | None) -> np.ndarray | None:
    """The roles of a text rollout's tokens (None for other text): a token that starts in the completion
    (at or after `prefix_chars`) is the generated turn's (assistant, last assistant), one that starts in
    the prompt the user's; a token that straddles the two starts in the prompt and is not trained."""
    if prefix_chars is None:
        return None
    completion = np.asarray(offsets)[:, 0] >= prefix_chars
    return np.where(completion, ROLE_ASSISTANT | LAST_ASSISTANT, ROLE_USER).astype(np.uint8)


class Preparer:
    """Tokenizes and aligns documents and plans their teacher windows."""

    def __init__(self, teacher_tok, students: list[StudentSide], *, window_len: int, overlap: int,
                 conversation: bool = False):
        self.teacher_tok = teacher_tok
        self.students = students
        self.window_len = window_len
        self.overlap = overlap
        self.bos_prefix = adds_bos(teacher_tok)
        self.bos_id = teacher_tok.bos_token_id
        self.seconds = 0.0  # time spent in prepare(), for the run summary
        self.unmatched_rollouts = 0  # rollout rows whose sampling student is none of `students`
        self._text_sides = None  # text rollouts: chat fingerprint -> the student that sampled
        self.conversation = conversation
        if conversation:
            self.teacher_markers = np.asarray(turn_marker_ids(teacher_tok), dtype=np.int64)
            for s in students:
                s.markers = np.asarray(turn_marker_ids(s.tokenizer), dtype=np.int64)
        self.teacher_info = tokenizer_info(teacher_tok) if any(not s.identity for s in students) else None
        for s in students:
            if not s.identity:
                s.info = s.info or tokenizer_info(s.tokenizer)
                s.appended = appended_specials(s.tokenizer)

    def prepare(self, docs: list[Document]) -> list[PreparedDoc | Skipped]:
        """Tokenize (both sides, in Rust batches), align (one vectorized walk per student) and plan windows."""
        import time

        t0 = time.perf_counter()
        if self.conversation:
            out = self._prepare_conversations(docs)
            self.seconds += time.perf_counter() - t0
            return out
        texts = [d.text for d in docs]
        t_ids, t_off = _encode(self.teacher_tok, texts, "teacher tokenizer")
        keep = [i for i in range(len(docs)) if len(t_ids[i]) >= 2]
        aligns: list[dict] = [{} for _ in docs]
        failed: set[int] = set()
        spliced: dict[str, set[int]] = {}  # student fingerprint -> text rollouts whose sampled ids were spliced in
        t_replaced: dict[int, np.ndarray] = {}  # teacher tokens covering a U+FFFD for invalid UTF-8, by document
        for s in self.students:  # a same-tokenizer student's text rollouts: the teacher scores the ids it sampled
            if s.identity:
                spliced[s.fingerprint] = self._splice_text_rollouts(s, docs, keep, t_ids, t_off, t_replaced)
        for s in self.students:
            if s.identity:  # same tokenizer: no second tokenization, 1:1 chunks
                for i in keep:
                    aligns[i][s.fingerprint] = AlignmentRecord(
                        student_ids=t_ids[i].copy(), alignment=identity_alignment(len(t_ids[i])),
                        student_role=prefix_roles(t_off[i], docs[i].prefix_chars))
                continue
            s_ids, s_off = _encode(s.tokenizer, texts, "student tokenizer")
            replaced: dict[int, np.ndarray] = {}  # sampled ids covering a U+FFFD for invalid UTF-8, by document
            spliced[s.fingerprint] = self._splice_text_rollouts(s, docs, keep, s_ids, s_off, replaced)
            todo = [i for i in keep if i not in failed]
            for i, a in zip(todo, self._align(todo, docs, s, s_ids, s_off, t_ids, t_off, failed, replaced,
                                              t_replaced)):
                if a is not None:
                    aligns[i][s.fingerprint] = AlignmentRecord(student_ids=s_ids[i], alignment=a,
                                                               student_role=prefix_roles(s_off[i], docs[i].prefix_chars))
        self._attach_sampled(docs, ((i, a) for i, a in enumerate(aligns) if a), spliced)  # the documents kept
        out: list[PreparedDoc | Skipped] = []
        for i, d in enumerate(docs):
            if len(t_ids[i]) < 2:
                out.append(Skipped(d.source, d.row, "fewer than 2 teacher tokens"))
                continue
            if i in failed:
                out.append(Skipped(d.source, d.row, "alignment failed"))
                continue
            out.append(self._prepared(d, t_ids[i], t_off[i], aligns[i]))
        self.seconds += time.perf_counter() - t0
        return out

    def _prepared(self, doc: Document, ids, offsets, aligns: dict, conversation: str | None = None) -> PreparedDoc:
        bounds = None
        if len(ids) > self.window_len:
            bounds = common_boundaries([r.alignment.teacher_end for fp, r in aligns.items()
                                        if not _is_identity(self.students, fp)])
        windows = plan_windows(len(ids), self.window_len, self.overlap, bounds, bos_prefix=self.bos_prefix)
        return PreparedDoc(doc=doc, teacher_ids=ids, offsets=offsets, alignments=aligns, windows=windows,
                           conversation=conversation)

    def _prepare_conversations(self, docs: list[Document]) -> list[PreparedDoc | Skipped]:
        """Render each conversation in every model's template, tokenize, align (xtcache.chat.layout)."""
        import json

        result: list = [None] * len(docs)
        convs = [json.loads(d.text) for d in docs]

        def render_all(tok, who: str) -> dict[int, str]:
            out = {}
            for i, (d, conv) in enumerate(zip(docs, convs)):
                if result[i] is not None:
                    continue
                try:
                    out[i] = render(tok, conv, where=f"row {d.row} of {d.source} ({who})")
                except ConversationError as e:
                    log.warning("skipping: %s", e)
                    result[i] = Skipped(d.source, d.row, "chat template rejected the row")
            return out

        t_text = render_all(self.teacher_tok, "teacher template")
        todo = sorted(t_text)
        t_all = renderings(self.teacher_tok, [t_text[i] for i in todo], [convs[i] for i in todo],
                           markers=self.teacher_markers, side="teacher tokenizer")
        for i, n in zip(todo, t_all.counts.tolist()):
            if n < 2:
                result[i] = Skipped(docs[i].source, docs[i].row, "fewer than 2 teacher tokens")
        kept = [k for k, i in enumerate(todo) if result[i] is None]
        t_rend = t_all.take(kept)
        at = {todo[k]: j for j, k in enumerate(kept)}  # row -> its entry of t_rend
        aligns: dict[int, dict] = {i: {} for i in at}
        spliced: dict[str, set[int]] = {}  # student fingerprint -> rows whose sampled ids were spliced in
        for s in self.students:  # a same-template student's rollouts: the teacher scores the ids it sampled
            if s.identity and any(docs[i].sampled is not None for i in at):
                t_rend, spliced[s.fingerprint] = splice_batch(t_rend, [todo[k] for k in kept], docs, convs,
                                                              self._sampler(s))
        for s in self.students:
            if s.identity:  # same tokenizer and template: 1:1 chunks, roles from the teacher's rendering
                live = [i for i in at if result[i] is None]
                t_live = t_rend.take([at[i] for i in live])
                for i, r, ca in zip(live, t_live, self._align_convs(live, convs, docs, t_live, t_live, s.name)):
                    if ca is not None:
                        aligns[i][s.fingerprint] = AlignmentRecord(
                            student_ids=r.ids.astype(np.int32), alignment=identity_alignment(len(r.ids)),
                            student_role=ca.student_role, stats=ca.stats)
                continue
            s_text = render_all(s.tokenizer, f"student template {s.name}")
            live = [i for i in sorted(s_text) if i in at]
            t_live = t_rend.take([at[i] for i in live])
            s_live = renderings(s.tokenizer, [s_text[i] for i in live], [convs[i] for i in live], markers=s.markers,
                                side="student tokenizer", texts_of=t_live)
            s_live, spliced[s.fingerprint] = splice_batch(s_live, live, docs, convs, s)  # sampled ids, where they spell
            for i, r, ca in zip(live, s_live, self._align_convs(live, convs, docs, s_live, t_live, s.name)):
                if ca is not None:
                    aligns[i][s.fingerprint] = AlignmentRecord(student_ids=r.ids.astype(np.int32),
                                                               alignment=ca.alignment, student_role=ca.student_role,
                                                               stats=ca.stats)
        self._attach_sampled(docs, aligns.items(), spliced)
        out: list[PreparedDoc | Skipped] = []
        t_views = list(t_rend)
        for i, d in enumerate(docs):
            if result[i] is not None:
                out.append(result[i])
                continue
            if len(aligns[i]) < len(self.students):
                out.append(Skipped(d.source, d.row, "alignment failed"))
                continue
            r = t_views[at[i]]
            rendered = Document(d.source, d.row, r.text)
            out.append(self._prepared(rendered, r.ids.astype(np.int32), r.offsets.astype(np.int32), aligns[i],
                                      conversation=d.text))
        return out

    def _splice_text_rollouts(self, s, docs: list[Document], keep: list[int], s_ids: list, s_off: list,
                              replaced: dict[int, np.ndarray]) -> set[int]:
        """The text rollouts of `keep` that student `s` sampled, their sampled ids spliced into `s_ids` / `s_off`
        in place where they spell the completion (`stage1_teacher.onpolicy.splice.text_splice`); their rows.
        `replaced` gets, by row, the tokens that cover a U+FFFD for invalid UTF-8 (where there are any)."""
        sides = self._text_sampling_sides()
        out = set()
        for i in keep:
            d = docs[i]
            if d.sampled is None or d.prefix_chars is None or sides.get(d.sampled.chat) is not s:
                continue
            sp = text_splice(self._sampler(s), d.text, d.prefix_chars, d.sampled, s_ids[i], s_off[i])
            if sp is not None:
                s_ids[i], s_off[i] = sp.ids, sp.offsets
                if sp.replaced.any():
                    replaced[i] = sp.replaced
                out.add(i)
        return out

    def _sampler(self, s: StudentSide) -> StudentSide:
        """`s`, which sampled a rollout of this batch, with the `info` and `appended` a splice reads (a
        same-tokenizer student gets them here, the first time: a dump without its rollouts never needs them)."""
        if s.info is None:
            s.info = self.teacher_info or tokenizer_info(s.tokenizer)
            s.appended = appended_specials(s.tokenizer)
        return s

    def _text_sampling_sides(self) -> dict:
        """Text rollouts: the chat fingerprint of each student -> that student (computed once)."""
        if self._text_sides is None:
            self._text_sides = {chat_fingerprint(s.tokenizer): s for s in self.students}
        return self._text_sides

    def _attach_sampled(self, docs: list[Document], aligns, spliced: dict[str, set[int]] | None = None) -> None:
        """Rollout rows (`aligns`: (row index, records by group fingerprint) pairs): the sampled turn's ids
        checked and log-probs stored in the sampling student's group (`stage1_teacher.onpolicy.sampled`); a row
        sampled by none of the --student-tokenizer's is counted and logged. A rollout row names its student by
        the chat fingerprint, which is the group's key in a conversation store; a plain-text store keys its
        groups by the tokenizer alone, and its rollouts are text rollouts."""
        sides = {s.fingerprint: s for s in self.students} if self.conversation else self._text_sampling_sides()
        for i, by_fp in aligns:
            sampled = docs[i].sampled
            if sampled is None:
                continue
            side = sides.get(sampled.chat)
            if side is None:
                if not self.unmatched_rollouts:
                    log.warning("row %d of %s is a rollout of a student (chat fingerprint %s..) that is none of the "
                                "--student-tokenizer's: its sampling log-probs are not stored (rkl-pg refuses a store "
                                "that also holds rollouts of the student it trains); pass the sampling student's "
                                "tokenizer", docs[i].row, docs[i].source, sampled.chat[:12])
                self.unmatched_rollouts += 1
            elif side.fingerprint in by_fp:
                fp = side.fingerprint
                by_fp[fp] = attach_sampled(by_fp[fp], sampled, i in (spliced or {}).get(fp, ()), markers=side.markers,
                                           text=not self.conversation,
                                           untrained=None if side.info is None else side.info.control)

    def _align_convs(self, live, convs, docs, s_rend, t_rend, name) -> list:
        """ConversationAlignments of conversations `live` (their Renderings `s_rend`, `t_rend`, in that
        order; None where one fails: that row is skipped)."""
        out = batch_or_each(len(live), lambda: align_conversations([convs[i] for i in live], s_rend, t_rend),
                            lambda k: align_conversations([convs[live[k]]], s_rend.take([k]), t_rend.take([k]))[0])
        for k, i in enumerate(live):
            if isinstance(out[k], AlignmentError):
                log.warning("skipping row %d of %s for %s: %s", docs[i].row, docs[i].source, name, out[k])
                out[k] = None
        return out

    def _align(self, todo, docs, s, s_ids, s_off, t_ids, t_off, failed: set[int],
               replaced: dict[int, np.ndarray], t_replaced: dict[int, np.ndarray]) -> list:
        """Alignments of documents `todo` (None where it fails: those are added to `failed`). `replaced` and
        `t_replaced`: by document, student and teacher tokens whose bytes are not the text's (sampled ids covering
        a U+FFFD for invalid UTF-8): flagged, so they are not checked against the text and their chunk is inexact."""
        info = dict(student_info=s.info, teacher_info=self.teacher_info)
        masks = [s.info.control[s_ids[i]] | replaced.get(i, False) for i in todo] if replaced else None
        t_masks = ([self.teacher_info.control[t_ids[i]] | t_replaced.get(i, False) for i in todo]
                   if t_replaced else None)
        out = batch_or_each(len(todo), lambda: align_batch(
            [docs[i].text for i in todo], [s_ids[i] for i in todo], [s_off[i] for i in todo],
            [t_ids[i] for i in todo], [t_off[i] for i in todo], masks, t_masks, **info),
            lambda k: align_offsets(docs[todo[k]].text, s_ids[todo[k]], s_off[todo[k]], t_ids[todo[k]],
                                    t_off[todo[k]], None if masks is None else masks[k],
                                    None if t_masks is None else t_masks[k], **info))
        for k, i in enumerate(todo):
            if isinstance(out[k], AlignmentError):
                log.warning("skipping row %d of %s: it does not align for %s: %s", docs[i].row, docs[i].source,
                            s.name, out[k])
                failed.add(i)
                out[k] = None
        return out

    def tokens(self, pd: PreparedDoc, w: Window) -> np.ndarray:
        return window_tokens(pd.teacher_ids, w, self.bos_id)


def _encode(tok, texts: list[str], side: str) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per-document int32 ids and [N, 2] character offsets, encoded in one Rust batch.

    Uses xtcache.align.chunks's encoder so offsets are untrimmed exactly as the aligner expects.
    """
    if not texts:
        return [], []
    ids, offsets, counts = encode_flat(tok, texts, add_special_tokens=True, side=side)
    cuts = np.cumsum(counts)[:-1]
    return (np.split(ids.astype(np.int32), cuts), np.split(offsets.astype(np.int32), cuts))


def _is_identity(students: list[StudentSide], fp: str) -> bool:
    return any(s.fingerprint == fp and s.identity for s in students)


def iter_parts(rows, preparer: Preparer, *, docs_per_part: int, max_positions: int | None = None) -> Iterator[Part]:
    """Parts of this writer's stream of rows (`corpus.iter_corpus` over its plan ranges), in order: each ends at
    `docs_per_part` documents or, given `max_positions`, before the document that would take it past that many
    positions (a longer document is a part of its own, with a warning: its targets are held in memory whole)."""
    pending: list[Document] = []
    skipped: list[Skipped] = []
    ready: list[PreparedDoc] = []
    part_index = 0

    def flush_pending():
        nonlocal pending
        for item in preparer.prepare(pending):
            (skipped if isinstance(item, Skipped) else ready).append(item)
        pending = []

    longer = longest = 0  # documents longer than a part's limit (each a part of its own), the longest's positions

    def take() -> int:
        """How many of `ready` the next part holds; 0: not known yet (more documents may still fit)."""
        nonlocal longer, longest
        if max_positions is None:
            return docs_per_part if len(ready) >= docs_per_part else 0
        total = 0
        for n, pd in enumerate(ready[:docs_per_part]):
            total += pd.num_tokens
            if total > max_positions:
                if n == 0:
                    if not longer:
                        log.warning("%s row %d: %d positions, more than a part's %d: written as a part of its own, "
                                    "its targets held in memory whole (said once; the count comes at the end)",
                                    pd.doc.source, pd.doc.row, pd.num_tokens, max_positions)
                    longer, longest = longer + 1, max(longest, pd.num_tokens)
                return max(n, 1)
        return docs_per_part if len(ready) >= docs_per_part else 0

    def cut(n: int) -> Part:
        nonlocal ready, skipped, part_index
        part = Part(part_index, ready[:n], skipped)
        ready, skipped = ready[n:], []
        part_index += 1
        return part

    for item in rows:
        if isinstance(item, Skipped):
            skipped.append(item)
            continue
        pending.append(item)
        if len(pending) >= TOKENIZE_BATCH:
            flush_pending()
        while n := take():
            yield cut(n)
    flush_pending()
    while ready:
        yield cut(take() or len(ready))
    if skipped:
        yield Part(part_index, [], skipped)
    if longer > 1:
        log.warning("%d documents longer than a part's %d positions were written as parts of their own (the longest: "
                    "%d positions)", longer, max_positions, longest)


@dataclass
class WindowItem:
    """One window of one document of a part, as handed to the teacher."""

    doc: int  # index into the part's docs
    window: int  # index into the doc's windows
    tokens: np.ndarray  # int64 [L]


def part_batches(part: Part, preparer: Preparer, batch_tokens: int) -> list[list[WindowItem]]:
    """The part's windows, in document order, packed into batches of at most `batch_tokens` tokens."""
    batches: list[list[WindowItem]] = []
    cur: list[WindowItem] = []
    size = 0
    for di, pd in enumerate(part.docs):
        for wi, w in enumerate(pd.windows):
            toks = preparer.tokens(pd, w)
            if cur and size + len(toks) > batch_tokens:
                batches.append(cur)
                cur, size = [], 0
            cur.append(WindowItem(doc=di, window=wi, tokens=toks))
            size += len(toks)
    if cur:
        batches.append(cur)
    return batches
