"""`--train-on assistant|last-assistant`: windows are cut around what is trained (`xtcache.packing`).

A conversation corpus whose user turns are longer than the window (paragraph-long prompts, short
and long answers) goes through stage 1 (`teacher-dump --engine hf`); the loader's windows then
train every trained position exactly once per epoch, each window trains something, data order
and resume hold, and `train-student --seq-len 64 --train-on assistant` runs to its last step.

    pytest -q tests/test_train_on.py
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stage2_student import loader as L
from stage2_student.batches import IGNORE
from tests.commands import xtcache
from tests.loader_settings import loader_settings
from xtcache.packing import (
    CONTEXT_SHARE,
    common_boundaries,
    group_trained,
    most_windows,
    pack_documents,
    pack_trained,
)
from xtcache.testing.chat import WORDS, chat_tokenizer, write_chat_jsonl

SEQ = 64

# ------------------------------------------------------------------------------ pure packing


def _check_trained_plan(plan, lens, trained, seq_len):
    cum = [np.concatenate([[0], np.cumsum(x)]) for x in lens]
    seen = [np.zeros(len(x), dtype=int) for x in lens]
    for w in range(plan.num_windows):
        segs = range(plan.window_offsets[w], plan.window_offsets[w + 1])
        assert len(segs) > 0 and sum(cum[plan.seg_doc[i]][plan.seg_hi[i]] - cum[plan.seg_doc[i]][plan.seg_lo[i]]
                                     for i in segs) <= seq_len
        trains = 0
        for i in segs:
            d, lo, hi, ctx = plan.seg_doc[i], plan.seg_lo[i], plan.seg_hi[i], plan.seg_ctx[i]
            assert ctx == 0 or i == plan.window_offsets[w]  # context opens a window
            assert trained[d][hi - 1] > 0  # nothing after the last trained chunk
            assert lo == 0 or cum[d][hi] - cum[d][lo - 1] > seq_len  # as much context as fits
            assert (seen[d][lo:lo + ctx][trained[d][lo:lo + ctx] > 0] == 1).all()  # context was trained before
            seen[d][lo + ctx:hi] += trained[d][lo + ctx:hi] > 0
            trains += int((trained[d][lo + ctx:hi] > 0).sum())
            first = lo + ctx + int(np.argmax(trained[d][lo + ctx:hi] > 0))  # the segment's first trained chunk
            if first > 0 and lens[d][first - 1] + lens[d][first] <= seq_len:
                assert lo < first  # its first token is predicted inside the window
                keep = max(min(seq_len // CONTEXT_SHARE, int(cum[d][first])), int(lens[d][first - 1]))
                if lo > 0 and cum[d][hi] - cum[d][first] <= seq_len - keep:  # a quarter window, up to a chunk
                    assert cum[d][first] - cum[d][lo - 1] > keep
        assert trains > 0  # every window trains something
    skipped = 0
    for d in range(len(lens)):
        is_trained, too_long = trained[d] > 0, lens[d] > seq_len
        assert (seen[d][is_trained & ~too_long] == 1).all() and (seen[d][~is_trained | too_long] == 0).all()
        skipped += int((is_trained & too_long).sum())
    assert plan.skipped_chunks == skipped
    assert plan.trained_tokens == sum(int(t[(t > 0) & (x <= seq_len)].sum()) for x, t in zip(lens, trained))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.tuples(st.integers(0, 12), st.booleans()), max_size=40), min_size=1, max_size=6),
       st.integers(4, 40))
def test_pack_trained_trains_each_trained_chunk_once_after_the_context_that_fits(docs, seq_len):
    lens = [np.asarray([n for n, _ in d], dtype=np.int64) for d in docs]
    trained = [np.asarray([n if t else 0 for n, t in d], dtype=np.int64) for d in docs]
    plan = pack_trained(list(range(len(docs))), lens, trained, seq_len)
    _check_trained_plan(plan, lens, trained, seq_len)


def _trained_span(lens: np.ndarray, trained: np.ndarray) -> int:
    """Tokens from the start of the chunk before a document's first trained chunk to the end of its last one."""
    cum, targets = np.concatenate([[0], np.cumsum(lens)]), np.flatnonzero(trained > 0)
    if not targets.shape[0]:
        return 0
    return int(cum[targets[-1] + 1] - cum[max(int(targets[0]) - 1, 0)])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(st.tuples(st.integers(0, 12), st.booleans()), max_size=40), min_size=1, max_size=8),
       st.integers(4, 40))
def test_most_windows_bounds_both_packers_whatever_the_chunks(docs, seq_len):
    """`most_windows` (what `xtcache rounds` refuses a plan by, before any rollout exists): documents that fit in a
    window, or whose trained chunks and the chunk before them fit in one less its context share, make at most one
    window each under either packer (the trained span: `pack_trained` only)."""
    lens = [np.asarray([n for n, _ in d], dtype=np.int64) for d in docs]
    trained = [np.asarray([n if t else 0 for n, t in d], dtype=np.int64) for d in docs]
    longest = max(int(x.sum()) for x in lens)
    span = max(_trained_span(x, t) for x, t in zip(lens, trained))
    plans = {"documents": pack_documents(range(len(docs)), lens, seq_len),
             "trained": pack_trained(range(len(docs)), lens, trained, seq_len)}
    for name, plan in plans.items():
        bound = most_windows(len(docs), seq_len, longest=longest, trained_span=span if name == "trained" else None)
        assert bound is None or plan.num_windows <= bound, (name, plan.num_windows, bound)
    assert (most_windows(len(docs), seq_len, longest=longest) is None) == (longest > seq_len)
    assert most_windows(3, 40, longest=41, trained_span=30) == 3 and most_windows(3, 40, longest=41, trained_span=31) \
        is None  # a quarter window of context before the turn


# ------------------------------------------------------------------------------ a chat cache


def long_prompt_corpus(n: int, seed: int = 0) -> list[dict]:
    """Conversations whose user turns are paragraphs (60-120 words), answers of 3-40 words, and every
    fourth conversation a long answer (70-110 words) too."""
    rng = random.Random(seed)
    words = lambda a, b: " ".join(rng.choice(WORDS) for _ in range(rng.randint(a, b)))  # noqa: E731
    rows = []
    for i in range(n):
        msgs = [{"role": "system", "content": "You answer briefly."}] if i % 3 == 0 else []
        for turn in range(rng.randint(1, 3)):
            msgs.append({"role": "user", "content": words(60, 120) + "?"})
            msgs.append({"role": "assistant", "content": (words(70, 110) if i % 4 == 1 and turn == 0
                                                          else words(3, 40)) + "."})
        rows.append({"messages": msgs})
    return rows


def _cli(*args):
    """`xtcache ARGS` in this process (`tests.commands.xtcache`); its stdout."""
    proc = xtcache(*args)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.fixture(scope="module")
def chat_store(toy_setup, procs, tmp_path_factory):
    """teacher-dump --engine hf of the long-prompt corpus: ChatML teacher, Llama-3 student. The warm
    process server (`procs`) imports meanwhile."""
    from xtcache.testing.toy import build_tiny_model

    root = tmp_path_factory.mktemp("train_on")
    t_dir, s_dir = root / "teacher_tok", root / "student_tok"
    chat_tokenizer(toy_setup.teacher_tokenizer, "chatml-thinking", t_dir)
    student_tok = chat_tokenizer(toy_setup.student_tokenizer, "llama3", s_dir)
    build_tiny_model("qwen2", t_dir, root / "teacher", hidden=64, layers=1)
    build_tiny_model("llama", s_dir, root / "student", hidden=64, layers=1)
    data = write_chat_jsonl(root / "chat.jsonl", long_prompt_corpus(36))
    store = root / "store"
    _cli("teacher-dump", "--teacher", root / "teacher", "--student-tokenizer", s_dir, "--data", data, "--out", store,
         "--engine", "hf", "--top-k", "8", "--docs-per-part", "10", "--max-seq-len", "1024")
    return {"root": root, "store": str(store), "tok": student_tok}


def _dataset(chat_store, **kw):
    args = dict(seq_len=SEQ, micro_batch_size=2, pad_id=0, seed=3, train_on="assistant", shard_cache=100)
    args.update(kw)
    return L.CacheDataset(chat_store["store"], chat_store["tok"], *loader_settings(args), **args)


def _numbered(ds):
    """Every student token id replaced by its index in the store (its part's offset + its index there)."""
    base = 0
    for i in range(len(ds.caches[0].shard_ids)):
        src = ds.source(0, i)
        n = src.student_ids.shape[0]
        ds._cache[(0, i)] = dataclasses.replace(src, student_ids=np.arange(base, base + n, dtype=np.int32))
        base += n
    return base


@pytest.mark.parametrize("train_on", ["assistant", "last-assistant"])
def test_every_trained_position_is_trained_once_per_epoch(chat_store, train_on):
    from schemas.roles import ROLE_USER
    from xtcache.chat.render import trained_roles
    from xtcache.store import CacheReader

    ds = _dataset(chat_store, micro_batch_size=1, train_on=train_on)
    r = CacheReader(chat_store["store"])
    # the teacher's template opens reasoning and tool calls at a turn's start, the student's does not: each
    # trained turn's first chunk trains CE only (tests/test_chat.py)
    assert ds.caches[0].turn_openers
    trained, exact_trained, user_runs, doc_first, base = [], [], [], set(), 0
    for sid in ds.caches[0].shard_ids:
        al = r.read_alignment(ds.fingerprint, sid)
        t = trained_roles(al.student_role, train_on)
        ok = np.zeros_like(t)  # tokens of exact chunks whose tokens are all trained: the KD targets
        for d in range(len(al.doc_chunk_offsets) - 1):
            c0, c1, s0 = al.doc_chunk_offsets[d], al.doc_chunk_offsets[d + 1], al.doc_student_offsets[d]
            ends = al.student_end[c0:c1].astype(np.int64)
            for a, b, ex in zip(np.concatenate([[0], ends[:-1]]), ends, al.exact[c0:c1]):
                if b > a and ex and t[s0 + a:s0 + b].all() and t[s0 + a - 1]:  # not a turn's first chunk
                    ok[s0 + a:s0 + b] = True
            doc_first.add(base + int(s0))  # a document's first token has no logit predicting it
        trained.append(t)
        exact_trained.append(ok)
        base += t.shape[0]
        user = (al.student_role & 0x7F) == ROLE_USER
        edges = np.flatnonzero(np.diff(np.concatenate([[0], user.astype(int), [0]])))
        user_runs += (edges[1::2] - edges[::2]).tolist()
    assert min(user_runs) > SEQ  # every user turn is longer than a window
    trained, exact_trained = np.concatenate(trained), np.concatenate(exact_trained)
    _numbered(ds)
    assert ds.batches_per_epoch == ds.num_windows  # one window per micro-batch: every window of the epoch
    ce, kd = Counter(), Counter()
    for j in range(ds.batches_per_epoch):
        b = ds.micro_batch(0, j)
        assert b["train_on"] == train_on  # what the objective's messages about trained positions read
        labels = b["labels"][b["labels"] != IGNORE]
        assert labels.size > 0  # no window trains nothing
        ce.update(labels.tolist())
        nxt = np.concatenate([b["input_ids"][:, 1:], np.zeros((1, 1), np.int64)], axis=1)
        kd.update(nxt[b["student_chunk"] >= 0].tolist())
    want = set(np.flatnonzero(trained).tolist()) - doc_first
    assert set(ce) == want and set(ce.values()) == {1}  # every trained position exactly once
    assert set(kd) == set(np.flatnonzero(exact_trained).tolist()) - doc_first and set(kd.values()) == {1}
    assert ds.skipped_chunks == 0 and ds.plan_tokens["trained"] == trained.sum()
    # packed as plain text, the same corpus has windows that train nothing: what stopped the trainer
    idle = 0
    for sid in ds.caches[0].shard_ids:
        docs = ds._chunk_ends(r, ds.caches[0], sid)
        bounds = [common_boundaries([e]) for e, _ in docs]
        counts = [group_trained(b, t) for b, (_, t) in zip(bounds, docs)]
        plain = pack_documents(range(len(docs)), [np.diff(b, prepend=0) for b in bounds], SEQ)
        for w in range(plain.num_windows):
            segs = range(plain.window_offsets[w], plain.window_offsets[w + 1])
            idle += all(counts[plain.seg_doc[i]][plain.seg_lo[i] + plain.seg_ctx[i]:plain.seg_hi[i]].sum() == 0
                        for i in segs)
    assert idle > ds.num_windows // 4


def _all(loader):
    return [b for b in loader]


def _same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k] == b[k] if isinstance(a[k], (int, str)) else np.array_equal(a[k].numpy(), b[k].numpy()), k


def test_trained_windows_keep_order_workers_resume_and_world_size(chat_store):
    full = _all(L.CacheLoader(_dataset(chat_store, epochs=2)))
    assert len(full) > 4
    for a, b in zip(full, _all(L.CacheLoader(_dataset(chat_store, epochs=2), num_workers=2))):
        _same(a, b)
    cut = len(full) // 2 + 1  # across the epoch boundary
    ld = L.CacheLoader(_dataset(chat_store, epochs=2))
    it = iter(ld)
    head = [next(it) for _ in range(cut)]
    state = json.loads(json.dumps(ld.state_dict()))
    del it
    resumed = L.CacheLoader(_dataset(chat_store, epochs=2))
    resumed.load_state_dict(state)
    rest = _all(resumed)
    assert len(head) + len(rest) == len(full)
    for a, b in zip(head + rest, full):
        _same(a, b)
    # world 2 x accum 1, saved after one step, resumed on world 1 x accum 2: the same global micro-batches
    one = _all(L.CacheLoader(_dataset(chat_store, epochs=1, grad_accum=2)))
    ranks = [L.CacheLoader(_dataset(chat_store, epochs=1, rank=r, world_size=2)) for r in range(2)]
    firsts = [next(iter(x)) for x in ranks]
    _same(firsts[0], one[0])
    _same(firsts[1], one[1])
    moved = L.reshard_state(ranks[0].state_dict(), rank=0, world_size=1, grad_accum=2)
    again = L.CacheLoader(_dataset(chat_store, epochs=1, grad_accum=2))
    again.load_state_dict(moved)
    for a, b in zip(_all(again), one[2:], strict=True):
        _same(a, b)


def test_inspect_reports_the_loaders_trained_positions_and_context(chat_store):
    from xtcache.app.store_commands import window_summary
    from xtcache.store import CacheReader

    r = CacheReader(chat_store["store"])
    for train_on in ("assistant", "last-assistant"):
        ds = _dataset(chat_store, train_on=train_on)
        w = window_summary(r, ds.fingerprint, SEQ, train_on)
        assert (w["windows"], w["trained"], w["context"]) == (ds.num_windows, ds.plan_tokens["trained"],
                                                              ds.plan_tokens["context"])
        assert w["trained"] > 0 and w["context"] > 0
    out = _cli("inspect", chat_store["store"], "--seq-len", SEQ)
    assert f"windows of --seq-len {SEQ} per --train-on" in out and "last-assistant" in out


def test_train_student_on_assistant_runs_to_its_last_step_at_seq_len_64(chat_store, procs, tmp_path):
    """`xtcache train-student` in a process of its own (forked from the warm server): its exit status and log."""
    out = tmp_path / "run"
    steps = _dataset(chat_store).batches_per_epoch  # one whole epoch: every window of the corpus
    proc = procs.cli("train-student", "--out", str(out), "--cache", chat_store["store"], "--student",
                     str(chat_store["root"] / "student"), "--seq-len", str(SEQ), "--micro-batch-size", "2",
                     "--max-steps", str(steps), "--loss", "alm", "--train-on", "assistant", "--zero-stage", "0",
                     "--seed", "3")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "trained positions" in proc.stderr + proc.stdout
    train = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, steps + 1)) and all(np.isfinite(r["loss"]) for r in train)
    assert all(r["chunks"] > 0 for r in train)
