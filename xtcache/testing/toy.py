"""Local stand-ins for real models: a corpus, two different tokenizers and tiny models.

Nothing here downloads anything. The corpus is the Python standard library's own source text,
found at run time; tokenizers are byte-level BPE trained on it with `tokenizers`; models are tiny
Qwen2 (teacher) and Llama (student) configs from `transformers`. Tests, benchmarks and
`xtcache demo` all build their artifacts here, so every part of xtcache is exercised on the same
kind of data.

    python -c "from xtcache.testing import toy; print(toy.build_toy_setup('/tmp/toy'))"
"""

from __future__ import annotations

import fcntl
import json
import logging
import math
import random
import sysconfig
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from xtcache.tokenizer import load_tokenizer

log = logging.getLogger(__name__)

TEACHER_SPECIALS = ["<|endoftext|>", "<|pad|>"]
STUDENT_SPECIALS = ["<s>", "</s>", "<pad>"]


def stdlib_corpus(max_docs: int = 2000, *, doc_chars: int = 2000, seed: int = 0) -> list[str]:
    """Documents cut from the standard library's .py files at line boundaries.

    Deterministic for a given Python installation: files are walked in sorted order and every
    document holds whole lines, about `doc_chars` characters long (the last piece of a file may be
    shorter). `seed` shuffles the order of the returned documents.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    docs: list[str] = []
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts or "tests" in path.parts:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        piece: list[str] = []
        size = 0
        for line in text.splitlines(keepends=True):
            piece.append(line)
            size += len(line)
            if size >= doc_chars:
                docs.append("".join(piece))
                piece, size = [], 0
        if size > doc_chars // 4:
            docs.append("".join(piece))
        if len(docs) >= max_docs * 3:
            break
    rng = random.Random(seed)
    rng.shuffle(docs)
    return docs[:max_docs]


def train_bpe_tokenizer(texts: list[str], vocab_size: int, style: str, out_dir: str | Path):
    """Train a fast byte-level BPE tokenizer and save it as a transformers tokenizer directory.

    style "teacher" (Qwen-like): single-digit pre-tokenization, no BOS, `<|endoftext|>` as EOS.
    style "student" (Llama-like): digits grouped 1-3, BOS `<s>` prepended, `</s>` as EOS.
    Returns the loaded `PreTrainedTokenizerFast`.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if style == "teacher":
        specials = TEACHER_SPECIALS
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif style == "student":
        specials = STUDENT_SPECIALS
        digits = pre_tokenizers.Split(Regex(r"\d{1,3}"), behavior="isolated")
        tok.pre_tokenizer = pre_tokenizers.Sequence([digits, byte_level])
    else:
        raise ValueError(f"unknown tokenizer style {style!r}: use 'teacher' or 'student'")
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    if style == "student":
        bos = tok.token_to_id("<s>")
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
        )
        fast = PreTrainedTokenizerFast(
            tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", add_bos_token=True
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
        fast = PreTrainedTokenizerFast(
            tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>"
        )
    fast.save_pretrained(str(out_dir))
    return fast


def build_tiny_model(arch: str, tokenizer_dir: str | Path, out_dir: str | Path, *, hidden: int = 64,
                     layers: int = 2, heads: int | None = None, kv_heads: int | None = None, intermediate: int = 192,
                     max_positions: int = 2048, seed: int = 0, vocab_pad: int = 0):
    """A randomly initialised tiny causal LM saved with its tokenizer (safetensors weights).

    arch "qwen2" (the teacher family) or "llama" (the student family). `vocab_pad` adds unused
    lm_head columns beyond the tokenizer, as real checkpoints do (Qwen3: 151,936 vs 151,669).
    Heads default to a head size of 32: vLLM's CPU attention has no kernel for smaller heads.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    tok = load_tokenizer(tokenizer_dir)
    heads = heads or max(1, hidden // 32)
    kv_heads = kv_heads or max(1, heads // 2)
    common = dict(
        vocab_size=len(tok) + vocab_pad, hidden_size=hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=intermediate,
        max_position_embeddings=max_positions, tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(seed)
    if arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    elif arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        raise ValueError(f"unknown arch {arch!r}: use 'qwen2' or 'llama'")
    out_dir = Path(out_dir)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    tok.save_pretrained(str(out_dir))
    return model


def train_tiny_lm(model_dir: str | Path, texts: list[str], *, steps: int, seq_len: int = 256,
                  batch_size: int = 8, lr: float = 3e-3, seed: int = 0, log_every: int = 50) -> list[float]:
    """Train a tiny causal LM in place on `texts` with plain next-token CE; returns the losses.

    Used to make the toy teacher informative (better than a fresh student) before it is cached.
    """
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    tok = load_tokenizer(model_dir)  # as stage 1 will tokenize for this teacher
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    ids = [i for t in texts for i in tok(t)["input_ids"] + [tok.eos_token_id]]
    stream = torch.tensor(ids, dtype=torch.long)
    n_windows = (len(stream) - 1) // seq_len
    if n_windows < 1:
        raise ValueError(f"corpus of {len(stream)} tokens is shorter than one window of {seq_len}")
    windows = stream[: n_windows * seq_len + 1]
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    gen = torch.Generator().manual_seed(seed)
    losses = []
    model.train()
    for step in range(steps):
        scale = min(1.0, (step + 1) / max(1, steps // 10)) * 0.5 * (1 + math.cos(math.pi * step / steps))
        for g in opt.param_groups:
            g["lr"] = lr * scale
        starts = torch.randint(0, n_windows, (batch_size,), generator=gen) * seq_len
        x = torch.stack([windows[s : s + seq_len] for s in starts.tolist()])
        y = torch.stack([windows[s + 1 : s + seq_len + 1] for s in starts.tolist()])
        logits = model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if log_every and (step % log_every == 0 or step == steps - 1):
            log.info("teacher pre-training step %d/%d loss %.3f", step + 1, steps, loss.item())
    model.save_pretrained(str(model_dir), safe_serialization=True)
    return losses


@dataclass(frozen=True)
class ToySpec:
    """Sizes of a toy setup; the artifacts are cached under a directory keyed by these values."""

    num_docs: int = 400
    doc_chars: int = 1500
    teacher_vocab: int = 2048
    student_vocab: int = 1536
    teacher_hidden: int = 128
    teacher_layers: int = 2
    student_hidden: int = 64
    student_layers: int = 2
    teacher_vocab_pad: int = 16
    teacher_steps: int = 300
    teacher_seq_len: int = 128
    heldout_fraction: float = 0.1
    seed: int = 0
    recipe: int = 2  # bumped when the build itself changes, so cached artifacts are rebuilt

    def key(self) -> str:
        import hashlib

        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]


@dataclass(frozen=True)
class ToySetup:
    root: Path
    train_jsonl: Path
    heldout_jsonl: Path
    teacher_tokenizer: Path
    student_tokenizer: Path
    teacher_model: Path
    student_model: Path


def build_toy_setup(cache_dir: str | Path, spec: ToySpec = ToySpec(), *, train_teacher: bool = True) -> ToySetup:
    """Build (or find in `cache_dir`) corpus files, both tokenizers, a trained teacher and a student.

    The directory name carries the spec's hash and a `DONE` marker is written last, so an
    interrupted build is redone and a finished one is reused.
    """
    root = Path(cache_dir) / f"toy-{spec.key()}{'' if train_teacher else '-untrained'}"
    setup = ToySetup(
        root=root, train_jsonl=root / "corpus" / "train.jsonl", heldout_jsonl=root / "corpus" / "heldout.jsonl",
        teacher_tokenizer=root / "teacher_tokenizer", student_tokenizer=root / "student_tokenizer",
        teacher_model=root / "teacher", student_model=root / "student",
    )
    build_once(root, lambda: _build_toy_setup(setup, spec, train_teacher))
    return setup


def build_once(root: Path, build: Callable[[], str]) -> None:
    """Run `build()` unless `root` is already built, then write its `DONE` marker (the text `build`
    returns) last. An exclusive lock beside `root` is held meanwhile, so that parallel test workers
    or a demo run beside the tests build it once and never read a half-built directory."""
    root = Path(root)
    if (root / "DONE").exists():
        return
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f".{root.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not (root / "DONE").exists():
            marker = build()
            (root / "DONE").write_text(marker)


def _build_toy_setup(setup: ToySetup, spec: ToySpec, train_teacher: bool) -> str:
    root = setup.root
    root.mkdir(parents=True, exist_ok=True)
    docs = stdlib_corpus(spec.num_docs, doc_chars=spec.doc_chars, seed=spec.seed)
    n_held = max(1, int(len(docs) * spec.heldout_fraction))
    held, train = docs[:n_held], docs[n_held:]
    setup.train_jsonl.parent.mkdir(parents=True, exist_ok=True)
    for path, part in ((setup.train_jsonl, train), (setup.heldout_jsonl, held)):
        with open(path, "w", encoding="utf-8") as f:
            for text in part:
                f.write(json.dumps({"text": text}) + "\n")
    train_bpe_tokenizer(train, spec.teacher_vocab, "teacher", setup.teacher_tokenizer)
    train_bpe_tokenizer(train, spec.student_vocab, "student", setup.student_tokenizer)
    build_tiny_model("qwen2", setup.teacher_tokenizer, setup.teacher_model, hidden=spec.teacher_hidden,
                     layers=spec.teacher_layers, intermediate=spec.teacher_hidden * 3, seed=spec.seed,
                     vocab_pad=spec.teacher_vocab_pad)
    build_tiny_model("llama", setup.student_tokenizer, setup.student_model, hidden=spec.student_hidden,
                     layers=spec.student_layers, intermediate=spec.student_hidden * 3, seed=spec.seed + 1)
    if train_teacher and spec.teacher_steps > 0:
        train_tiny_lm(setup.teacher_model, train, steps=spec.teacher_steps, seq_len=spec.teacher_seq_len,
                      seed=spec.seed)
    return json.dumps(asdict(spec))


def train_sentencepiece_style_tokenizer(texts: list[str], vocab_size: int, out_dir: str | Path):
    """Train a SentencePiece-style fast tokenizer (Llama-2 family) and save it as a transformers directory.

    Metaspace pre-tokenization (`▁` for spaces, one prepended to the text), BPE with byte fallback
    (the 256 `<0xNN>` pieces are ordinary vocabulary entries, so no text is ever unknown), `<s>`
    prepended as BOS, `</s>` EOS, `<unk>`. Returns the loaded `PreTrainedTokenizerFast`.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    specials = ["<unk>", "<s>", "</s>"]
    byte_pieces = [f"<0x{b:02X}>" for b in range(256)]
    draft = Tokenizer(models.BPE(unk_token="<unk>"))
    draft.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=max(vocab_size - len(byte_pieces), len(specials) + 64),
                                  special_tokens=specials, show_progress=False)
    draft.train_from_iterator(texts, trainer=trainer)
    learned = json.loads(draft.to_str())["model"]
    vocab = {tok: i for i, tok in enumerate(specials + byte_pieces)}
    for tok, _ in sorted(learned["vocab"].items(), key=lambda kv: kv[1]):
        vocab.setdefault(tok, len(vocab))
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in learned["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tok.add_special_tokens(specials)
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.Metaspace(replacement="▁", prepend_scheme="first"),
                                     decoders.ByteFallback(), decoders.Fuse()])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", vocab["<s>"])])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="</s>")
    fast.save_pretrained(str(out_dir))
    return fast
