"""A word-level Hugging Face tokenizer in a directory (optionally with a chat template), for the SFT tests:
each whitespace-separated word is one id, so expected ids can be written by hand."""

from __future__ import annotations

import json
from pathlib import Path

from megatron_lite.training.tokenizers.tokenizer import HuggingFaceTokenizer

WORDS = ["</s>", "<unk>", "System:", "User:", "Assistant:", "<system>", "<user>", "<assistant>", "<end>"]
WORDS += [
    "be",
    "brief",
    "hi",
    "hello",
    "there",
    "what",
    "is",
    "two",
    "plus",
    "four",
    "bye",
    "ok",
    "a",
    "b",
    "c",
]

# Renders turn by turn: "<role> content <end>" per message, "<assistant>" as the generation prompt.
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} <end> {% endfor %}"
    "{% if add_generation_prompt %}<assistant> {% endif %}"
)


def word_tokenizer(root: Path, chat_template: str | None = None) -> HuggingFaceTokenizer:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    root.mkdir(parents=True, exist_ok=True)
    tok.save(str(root / "tokenizer.json"))
    config = {"eos_token": "</s>"}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    return HuggingFaceTokenizer(str(root))


def ids(*words: str) -> list[int]:
    return [WORDS.index(w) for w in words]


def write_jsonl(path: Path, records) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def records(n: int = 30) -> list[dict]:
    """``n`` short examples of both formats (odd ones conversations, even ones input / output pairs)."""
    words = ["a", "b", "c", "hi", "hello", "there", "ok"]
    out = []
    for i in range(n):
        user, answer = " ".join(words[: 1 + i % 6]), " ".join(words[i % 3 : 4 + i % 4])
        turns = [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
        out.append({"messages": turns} if i % 2 else {"input": user, "output": answer})
    return out
