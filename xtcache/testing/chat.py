"""Chat templates in the style of the main model families, on the toy tokenizers, and a chat corpus.

The templates are written here in the manner of the families' own (ChatML with thinking and tool
calls as Qwen3 renders them, Llama-3 headers with an injected default system text and trimmed
content, Gemma turns, Mistral `[INST]`); they are not copies of the released files. `chat_tokenizer`
adds a family's special tokens to one of the toy byte-level tokenizers and saves it with the
template, so everything stays local.

    python -c "from xtcache.testing.chat import chat_corpus; print(chat_corpus(2)[0])"
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from schemas.roles import LAST_ASSISTANT, ROLE_NAMES
from xtcache.chat.layout import segments
from xtcache.chat.render import render, renderings
from xtcache.testing import toy
from xtcache.testing.suite import TEST_CACHE, TEST_SPEC
from xtcache.testing.toy import build_tiny_model, train_tiny_lm

# HF compiles templates with trim_blocks and lstrip_blocks: a newline right after a block tag is
# dropped, so newlines that follow a tag are written as {{ "\n" }}
NL = '{{ "\\n" }}'

CHATML_THINKING = (
    "{% set ns = namespace(last_user=-1) %}"
    "{% for m in messages %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}<|im_end|>" + NL +
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>" + NL +
    "{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'system' %}"
    "{% elif m.role == 'assistant' %}<|im_start|>assistant" + NL +
    "{% if m.reasoning_content and loop.index0 > ns.last_user %}<think>" + NL +
    "{{ m.reasoning_content }}\n</think>\n\n{% endif %}{{ m.content or '' }}"
    "{% for tc in m.tool_calls or [] %}" + NL + "<tool_call>" + NL +
    "{\"name\": \"{{ tc.function.name }}\", \"arguments\": {{ tc.function.arguments | tojson }}}\n</tool_call>"
    "{% endfor %}<|im_end|>" + NL +
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>" + NL +
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>" + NL + "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant" + NL + "{% endif %}"
)

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}<|im_end|>" + NL + "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant" + NL + "{% endif %}"
)

LLAMA3 = (
    "{{ bos_token }}"
    "{% if messages[0].role == 'system' %}{% set sys = messages[0].content | trim %}{% set msgs = messages[1:] %}"
    "{% else %}{% set sys = 'Cutting Knowledge Date: December 2023' %}{% set msgs = messages %}{% endif %}"
    "<|start_header_id|>system<|end_header_id|>\n\n{{ sys }}"
    "{% if tools %}\n\nYou may call these functions:" + NL + "{% for t in tools %}{{ t | tojson }}" + NL +
    "{% endfor %}{% endif %}<|eot_id|>"
    "{% for m in msgs %}<|start_header_id|>{{ 'ipython' if m.role == 'tool' else m.role }}<|end_header_id|>"
    + NL + NL +
    "{% if m.tool_calls %}{% for tc in m.tool_calls %}"
    "{\"name\": \"{{ tc.function.name }}\", \"parameters\": {{ tc.function.arguments | tojson }}}{% endfor %}"
    "{% else %}{{ (m.content or '') | trim }}{% endif %}<|eot_id|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>" + NL + NL + "{% endif %}"
)

GEMMA = (
    "{{ bos_token }}"
    "{% for m in messages %}{% if m.role != 'system' %}"
    "<start_of_turn>{{ 'model' if m.role == 'assistant' else 'user' }}" + NL +
    "{% if loop.index0 == 1 and messages[0].role == 'system' %}{{ messages[0].content }}" + NL + NL + "{% endif %}"
    "{% if m.role == 'tool' %}Tool result: {% endif %}"
    "{{ (m.content or '') | trim }}<end_of_turn>" + NL + "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model" + NL + "{% endif %}"
)

MISTRAL = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{% if m.role == 'user' %}[INST] "
    "{% if loop.index0 == 1 and messages[0].role == 'system' %}{{ messages[0].content }}" + NL + NL + "{% endif %}"
    "{{ m.content }} [/INST]"
    "{% elif m.role == 'assistant' %}{{ m.content }}{{ eos_token }}"
    "{% elif m.role == 'system' and loop.index0 == 0 %}"
    "{% else %}{{ raise_exception('Only system, user and assistant roles are supported') }}{% endif %}"
    "{% endfor %}"
)

FAMILIES = {
    # name: (template, special tokens added, bos, eos)
    "chatml-thinking": (CHATML_THINKING, ["<|im_start|>", "<|im_end|>"], None, "<|im_end|>"),
    "chatml": (CHATML, ["<|im_start|>", "<|im_end|>"], None, "<|im_end|>"),
    "llama3": (LLAMA3, ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
               "<|begin_of_text|>", "<|eot_id|>"),
    "gemma": (GEMMA, ["<bos>", "<start_of_turn>", "<end_of_turn>"], "<bos>", "<end_of_turn>"),
    "mistral": (MISTRAL, ["<s>", "</s>", "[INST]", "[/INST]"], "<s>", "</s>"),
}


def chat_tokenizer(base_dir: str | Path, family: str, out_dir: str | Path):
    """The tokenizer of `base_dir` with `family`'s special tokens and chat template, saved to `out_dir`."""
    from transformers import AutoTokenizer

    template, specials, bos, eos = FAMILIES[family]
    tok = AutoTokenizer.from_pretrained(str(base_dir))
    have = set(tok.get_vocab())
    tok.add_special_tokens({"additional_special_tokens": [s for s in specials if s not in have]})
    if bos is not None:
        tok.bos_token = bos
    tok.eos_token = eos
    tok.chat_template = template
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(out_dir))
    return AutoTokenizer.from_pretrained(str(out_dir))


WORDS = ("the cache stores teacher log-probs per position so a student can learn from them later; "
         "alignment cuts two tokenizations into chunks of the same text, and 123 + 4567 = 4690 "
         "while a byte-level merge keeps naïve café 東京 intact").split()


def _sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def chat_corpus(n: int, *, seed: int = 0, tools_every: int = 3, max_turns: int = 3) -> list[dict]:
    """`n` conversations `{"messages": [...], ("tools": [...])}` with system prompts, 1 to `max_turns`
    turns, reasoning on assistant turns and, every `tools_every`-th row, a tool call and its result."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        msgs = []
        if rng.random() < 0.6:
            msgs.append({"role": "system", "content": "You are a careful assistant. " + _sentence(rng, 5)})
        row: dict = {}
        for turn in range(rng.randint(1, max_turns)):
            msgs.append({"role": "user", "content": _sentence(rng, rng.randint(4, 14)) + "?"})
            if tools_every and i % tools_every == 0 and turn == 0:
                row["tools"] = [{"type": "function", "function": {
                    "name": "lookup", "description": "Look a word up.",
                    "parameters": {"type": "object", "properties": {"word": {"type": "string"}}}}}]
                msgs.append({"role": "assistant", "content": "Let me look that up.",
                             "tool_calls": [{"type": "function", "function": {
                                 "name": "lookup", "arguments": {"word": rng.choice(WORDS)}}}]})
                msgs.append({"role": "tool", "name": "lookup", "content": _sentence(rng, 6)})
            m = {"role": "assistant", "content": _sentence(rng, rng.randint(6, 30)) + "."}
            if rng.random() < 0.5:
                m["reasoning_content"] = "First, " + _sentence(rng, rng.randint(3, 10))
            msgs.append(m)
        row["messages"] = msgs
        rows.append(row)
    return rows


def write_chat_jsonl(path: str | Path, rows: list[dict]) -> Path:
    path = Path(path)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


DOC_CONVERSATION = {
    "tools": [{"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"word": {"type": "string"}}}}}],
    "messages": [
        {"role": "user", "content": "What does café mean?"},
        {"role": "assistant", "content": "Let me check.",
         "tool_calls": [{"type": "function", "function": {"name": "lookup", "arguments": {"word": "café"}}}]},
        {"role": "tool", "name": "lookup", "content": "a small restaurant"},
        {"role": "assistant", "reasoning_content": "The tool answered.", "content": "A small restaurant. "},
    ]}
DOC_BEGIN = "<!-- generated by `python -m xtcache.testing.chat`: do not edit by hand -->"
DOC_END = "<!-- end of generated example -->"


def write_prompts(src: str | Path | list[dict], out: str | Path, rows=None) -> Path:
    """Prompts for `xtcache generate` and `policy-eval`: the conversations of `src` (a chat JSONL or a
    list of rows), those at indices `rows` (every one when None), each cut after its last user
    message, written to `out` as JSONL."""
    if not isinstance(src, list):
        src = [json.loads(line) for line in Path(src).read_text(encoding="utf-8").splitlines()]
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    lines = []
    for row in (src if rows is None else [src[i] for i in rows]):
        last_user = max(i for i, m in enumerate(row["messages"]) if m["role"] == "user")
        lines.append(json.dumps({**row, "messages": row["messages"][:last_user + 1]}, ensure_ascii=False) + "\n")
    out.write_text("".join(lines), encoding="utf-8")
    return out


def doc_example(teacher_tok, student_tok) -> str:
    """The example of docs/conversations.md: DOC_CONVERSATION rendered in the ChatML-style template
    (teacher) and the Llama-3-style one (student), and how the two renderings are laid out."""
    t = renderings(teacher_tok, [render(teacher_tok, DOC_CONVERSATION)], [DOC_CONVERSATION])
    s = renderings(student_tok, [render(student_tok, DOC_CONVERSATION)], [DOC_CONVERSATION])

    def cell(x: str) -> str:
        return ("`" + x.replace("\n", "\\n").replace("|", "\\|") + "`") if x else ""

    lines = [DOC_BEGIN, "", "The conversation (JSON, as the store keeps it):", "", "```json",
             json.dumps(DOC_CONVERSATION, ensure_ascii=False, indent=1), "```", "",
             "Teacher template (ChatML style, thinking and tool calls):", "", "```text", t.texts[0], "```", "",
             "Student template (Llama-3 style: a default system text, trimmed content, no thinking, a tool call "
             "replaces the content):", "", "```text", s.texts[0], "```", "",
             "How the two renderings are laid out for alignment (in order; `trained` is `--train-on assistant`, "
             "`last` marks the last assistant message; KD and trained refer to the student's tokens):", "",
             "| student text | teacher text | kind | role | KD | trained |", "| --- | --- | --- | --- | --- | --- |"]
    for s_text, t_text, kind, role in segments(s, t, DOC_CONVERSATION):
        name = ROLE_NAMES[role & 0x7F] + (" (last)" if role & LAST_ASSISTANT else "")
        kd = "yes" if kind in ("content", "turn end") else "no"
        trained = "yes" if role & 0x7F == 3 and s_text else ""
        lines.append(f"| {cell(s_text)} | {cell(t_text)} | {kind} | {name} | {kd} | {trained} |")
    return "\n".join(lines + ["", DOC_END])


def main() -> None:
    """Print the example of docs/conversations.md (built on the test suite's toy tokenizers)."""
    import tempfile

    setup = toy.build_toy_setup(TEST_CACHE, TEST_SPEC)
    with tempfile.TemporaryDirectory() as tmp:
        teacher = chat_tokenizer(setup.teacher_tokenizer, "chatml-thinking", Path(tmp) / "t")
        student = chat_tokenizer(setup.student_tokenizer, "llama3", Path(tmp) / "s")
        print(doc_example(teacher, student))


if __name__ == "__main__":
    main()


def build_chat_setup(base, root: str | Path, *, num_train: int, num_heldout: int, teacher_steps: int,
                     teacher_hidden: int = 128, seed: int = 0):
    """A chat version of a toy setup (`toy.ToySetup`): the teacher's tokenizer with a ChatML-style
    template, the student's with a Llama-3-style one, a tiny Qwen2 teacher pre-trained on
    conversations rendered in its template, a fresh tiny Llama student, and train / held-out chat
    JSONL files. Built once under `root` (a DONE marker is written last), reused afterwards."""
    root = Path(root)
    setup = toy.ToySetup(root=root, train_jsonl=root / "corpus" / "train.jsonl",
                         heldout_jsonl=root / "corpus" / "heldout.jsonl", teacher_tokenizer=root / "teacher_tokenizer",
                         student_tokenizer=root / "student_tokenizer", teacher_model=root / "teacher",
                         student_model=root / "student")
    toy.build_once(root, lambda: _build_chat_setup(base, setup, num_train=num_train, num_heldout=num_heldout,
                                                   teacher_steps=teacher_steps, teacher_hidden=teacher_hidden,
                                                   seed=seed))
    return setup


def _build_chat_setup(base, setup, *, num_train: int, num_heldout: int, teacher_steps: int, teacher_hidden: int,
                      seed: int) -> str:
    root = setup.root
    (root / "corpus").mkdir(parents=True, exist_ok=True)
    train = chat_corpus(num_train, seed=seed, max_turns=4)
    write_chat_jsonl(setup.train_jsonl, train)
    write_chat_jsonl(setup.heldout_jsonl, chat_corpus(num_heldout, seed=seed + 1000, max_turns=4))
    teacher_tok = chat_tokenizer(base.teacher_tokenizer, "chatml-thinking", setup.teacher_tokenizer)
    chat_tokenizer(base.student_tokenizer, "llama3", setup.student_tokenizer)
    build_tiny_model("qwen2", setup.teacher_tokenizer, setup.teacher_model, hidden=teacher_hidden, layers=2,
                     intermediate=teacher_hidden * 3, seed=seed)
    build_tiny_model("llama", setup.student_tokenizer, setup.student_model, hidden=64, layers=2, intermediate=192,
                     seed=seed + 1)
    if teacher_steps > 0:
        train_tiny_lm(setup.teacher_model, [render(teacher_tok, c) for c in train], steps=teacher_steps,
                      seq_len=256, seed=seed)
    return json.dumps({"num_train": num_train, "num_heldout": num_heldout, "teacher_steps": teacher_steps,
                       "seed": seed})
