"""`xtcache align STORE --student-tokenizer NEW`: add a student tokenizer to an existing store.

No teacher runs. For every committed part the stored texts and teacher tokens/offsets are read
back, the texts are tokenized with the new student tokenizer, aligned to the stored teacher
tokens, and written as that tokenizer's alignment group. A student tokenizer equal to the
teacher's gets the identity alignment. Parts already aligned for that tokenizer are kept, so an
interrupted `xtcache align` continues where it stopped.

    xtcache align out/cache --student-tokenizer path/to/new_student_tokenizer
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace

import numpy as np

from schemas.models import AlignGroupMeta
from stage1_teacher.onpolicy.splice import replaced_tokens
from stage1_teacher.prep import _encode
from xtcache.align.chunks import align_batch, align_offsets, batch_or_each, identity_alignment
from xtcache.align.tokenizer import tokenizer_info
from xtcache.chat.layout import align_conversations
from xtcache.chat.render import ConversationError, chat_fingerprint, render, renderings
from xtcache.chat.side import tokenizer_side
from xtcache.errors import AlignmentError, CorruptionError, StoreError
from xtcache.fingerprint import tokenizer_fingerprint
from xtcache.store import AlignmentRecord, CacheReader, CacheWriter
from xtcache.store.tokenizer import load_store_tokenizer
from xtcache.tokenizer import load_tokenizer

log = logging.getLogger(__name__)


def _teacher_tokenizer(reader, teacher_tokenizer: str | None):
    """The store's teacher tokenizer when it can be found (for byte checks): --teacher-tokenizer, the
    copy the store carries (`xtcache.store.tokenizer`), or the store's recorded teacher path; None otherwise."""
    if not teacher_tokenizer:
        stored = load_store_tokenizer(reader.url, reader.manifest, reader.loc.storage_options)
        if stored is not None:
            return stored
    path = teacher_tokenizer or reader.manifest.teacher_name
    want = reader.manifest.fingerprints.get("teacher_tokenizer")
    if not path or not os.path.isdir(path):
        if teacher_tokenizer:
            raise StoreError(f"--teacher-tokenizer {teacher_tokenizer}: no such directory")
        return None
    tok = load_tokenizer(path, "teacher tokenizer")
    if want and tokenizer_fingerprint(tok) != want:
        if teacher_tokenizer:
            raise StoreError(f"--teacher-tokenizer {path} is not the tokenizer the store was written with")
        return None
    return tok


def align_store(url: str, student_path: str, *, student_tok=None, teacher_tok=None,
                storage_options: dict | None = None, reader=None) -> dict:
    """Write the alignment group of one student tokenizer for every committed part; returns stats."""
    reader = reader or CacheReader(url, storage_options)
    conversation = reader.manifest.settings.get("conversation") if reader.manifest.conversation else None
    side = tokenizer_side(student_tok if student_tok is not None else student_path, "student tokenizer",
                          conversation=conversation is not None)
    student_tok, fp = side.tokenizer, side.fingerprint
    if conversation is not None:
        identity = fp == conversation.get("teacher_chat")
        if identity:
            teacher_tok = student_tok
        elif teacher_tok is None or chat_fingerprint(teacher_tok) != conversation.get("teacher_chat"):
            why = "it was not found" if teacher_tok is None else "its chat template is not the store's"
            raise StoreError(f"xtcache align on the conversation store {url} renders each conversation again in the "
                             "teacher's chat template, to locate its messages by construction: pass "
                             f"--teacher-tokenizer with the tokenizer the store was written with ({why})")
    else:
        identity = fp == reader.manifest.fingerprints.get("teacher_tokenizer")
    s_info = None if identity else tokenizer_info(student_tok)
    t_info = None if identity or teacher_tok is None else tokenizer_info(teacher_tok)
    done = set(reader.alignment_parts(fp)) if fp in reader.alignment_groups() else set()
    for sid in sorted(done):  # a kept part must read back; a damaged one is aligned again
        try:
            reader.read_alignment(fp, sid, verify=True)
        except CorruptionError as e:
            log.warning("%s: aligning that part again", e)
            done.discard(sid)
    todo = [m for m in reader.shards if m.shard_id not in done]
    stats = {"fingerprint": fp, "parts_aligned": 0, "parts_kept": len(done), "documents": 0}
    if not todo:
        return stats
    group = AlignGroupMeta(fingerprint=fp, tokenizer_name=student_path, vocab_size=len(student_tok), identity=identity)
    # the store's alignment lock: a second `align` is refused, and a dump writer that must remove an
    # alignment part of a part it rewrites is refused while we run (xtcache/store/claims.py)
    writer = CacheWriter(url, reader.manifest, storage_options=storage_options, for_align=True)
    try:
        for meta in todo:
            shard = reader.read_shard(meta.shard_id)
            docs = [shard.doc(i) for i in range(shard.num_docs)]
            if conversation is not None:
                records = _conversation_records(docs, student_tok, teacher_tok, identity, conversation, meta.shard_id,
                                                t_info)
            elif identity:
                records = [AlignmentRecord(student_ids=d.teacher_ids.astype(np.int32),
                                           alignment=identity_alignment(len(d.teacher_ids))) for d in docs]
            else:
                s_ids, s_off = _encode(student_tok, [d.text for d in docs], "student tokenizer")
                aligns = _align_docs(docs, s_ids, s_off, s_info, t_info, meta.shard_id)
                records = [AlignmentRecord(student_ids=i, alignment=a) for i, a in zip(s_ids, aligns)]
            writer.add_alignment_group(group, meta.shard_id, records)
            stats["parts_aligned"] += 1
            stats["documents"] += len(records)
    finally:
        writer.close()
    return stats


def _conversation_records(docs, student_tok, teacher_tok, identity: bool, conversation: dict, shard_id: str,
                          t_info=None) -> list:
    """Alignment records of a conversation part: each document's messages rendered with the
    student's template and aligned to the stored teacher rendering and tokens (whose messages are
    located by rendering them again with `teacher_tok`'s template). With `t_info`, stored teacher tokens that
    stand for a U+FFFD of the text with other bytes (a same-template student's sampled ids, spliced) are
    flagged: their chunk is not exact."""
    import json

    if not docs:
        return []
    markers = np.asarray(conversation.get("teacher_turn_markers", []), dtype=np.int64)
    convs = [json.loads(d.conversation) for d in docs]
    stored = (np.concatenate([np.asarray(d.teacher_ids, np.int64) for d in docs]),
              np.concatenate([np.asarray(d.char_offsets, np.int64).reshape(-1, 2) for d in docs]),
              np.array([len(d.teacher_ids) for d in docs], dtype=np.int64))
    teachers = renderings(teacher_tok, [d.text for d in docs], convs, markers=markers, encoded=stored)
    masks = None if t_info is None else _stored_replaced(docs, t_info)
    if masks is not None:
        teachers = replace(teachers, replaced=np.concatenate(masks))
    if identity:
        students = teachers
    else:
        try:
            texts = [render(student_tok, c, where=f"document {d.doc_id} of part {shard_id}")
                     for d, c in zip(docs, convs)]
        except ConversationError as e:
            raise AlignmentError(str(e)) from None
        students = renderings(student_tok, texts, convs, side="student tokenizer", texts_of=teachers)
    aligned = align_conversations(convs, students, teachers)
    return [AlignmentRecord(student_ids=s.ids.astype(np.int32),
                            alignment=identity_alignment(len(s.ids)) if identity else ca.alignment,
                            student_role=ca.student_role, stats=ca.stats) for s, ca in zip(students, aligned)]


def _stored_replaced(docs, t_info) -> list[np.ndarray] | None:
    """Per document, bool [its teacher tokens]: the stored teacher tokens standing for a U+FFFD of their text with
    other bytes (`splice.replaced_tokens`); None when no document has one."""
    masks = [replaced_tokens(t_info, d.teacher_ids, d.char_offsets, d.text) for d in docs]
    return masks if any(m.any() for m in masks) else None


def _align_docs(docs, s_ids, s_off, s_info, t_info, shard_id: str) -> list:
    """Alignments of a part's documents to stored teacher tokens; AlignmentError names the first failure. Stored
    teacher tokens that stand for a U+FFFD of the text with other bytes (a same-tokenizer student's sampled ids,
    spliced) are flagged: not byte-checked, their chunk inexact."""
    t_ids = [d.teacher_ids for d in docs]
    t_off = [d.char_offsets for d in docs]
    replaced = None if t_info is None else _stored_replaced(docs, t_info)
    t_masks = None if replaced is None else [t_info.control[np.asarray(d.teacher_ids)] | m
                                             for d, m in zip(docs, replaced)]
    info = dict(student_info=s_info, teacher_info=t_info)
    out = batch_or_each(len(docs), lambda: align_batch([d.text for d in docs], s_ids, s_off, t_ids, t_off, None,
                                                       t_masks, **info),
                        lambda i: align_offsets(docs[i].text, s_ids[i], s_off[i], t_ids[i], t_off[i], None,
                                                None if t_masks is None else t_masks[i], **info))
    for d, a in zip(docs, out):
        if isinstance(a, AlignmentError):
            raise AlignmentError(f"document {d.doc_id} of part {shard_id}: {a}")
    return out


def ensure_groups(url: str, students, teacher_tok, storage_options: dict | None = None) -> list[str]:
    """Add missing alignment groups for `students` (prep.StudentSide) to a complete store; their names."""
    reader = CacheReader(url, storage_options)
    have = reader.alignment_groups()
    added = []
    for s in students:
        if s.fingerprint in have and len(reader.alignment_parts(s.fingerprint)) == len(reader.shards):
            continue
        log.info("adding alignment group for %s to %s (no teacher work)", s.name, url)
        align_store(url, s.name, student_tok=s.tokenizer, teacher_tok=teacher_tok, storage_options=storage_options,
                    reader=reader)
        added.append(s.name)
    return added


def run_align(store: str, student_tokenizer: str, *, teacher_tokenizer: str | None = None,
              storage_options: dict | None = None, allow_incomplete: bool = False) -> dict:
    """The `xtcache align` command body: refuses an incomplete store unless `allow_incomplete`."""
    reader = CacheReader(store, storage_options)
    reader.usable_parts(None, allow_incomplete=allow_incomplete)  # refuses, or logs "N of M parts"
    teacher_tok = _teacher_tokenizer(reader, teacher_tokenizer)
    if teacher_tok is None:
        log.info("teacher tokenizer not found: trusting the stored teacher offsets (no byte check on that side)")
    return align_store(store, student_tokenizer, teacher_tok=teacher_tok, storage_options=storage_options,
                       reader=reader)
