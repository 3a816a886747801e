"""Reading SFT examples from JSONL, with every problem reported as one line naming the file and line.

Two formats, one per line, as upstream:
- Megatron-LM's ``{"messages": [{"role": "system" | "user" | "assistant", "content": "..."}, ...]}``.
  As Megatron-LM's SFTDataset, a line may hold several conversations one after another, each
  starting with a ``system`` message; each is one example.
- Megatron-Bridge's ``{"input": "...", "output": "..."}`` (GPTSFTDataset's prompt / answer pair).

Blank lines are skipped. Bad input (a line that is not JSON, a conversation without an assistant turn,
an unknown role, a missing key) raises ConfigError naming ``--data-path`` and ``file:line``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from megatron_lite.training.errors import ConfigError

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class SFTExample:
    """One example: ``messages`` (a conversation) or ``input`` / ``output`` (a pair), and where it
    was read (for error messages)."""

    source: str
    """``file:line`` of the JSONL line the example came from."""
    messages: tuple[tuple[str, str], ...] | None = None
    """(role, content) turns of a conversation; None for an input / output pair."""
    input: str | None = None
    output: str | None = None


def sft_error(source: str, message: str) -> ConfigError:
    """The one-line error for bad SFT input at ``source`` (``file:line``)."""
    return ConfigError("--data-path", f"{source}: {message}")


def split_conversations(messages: list[tuple[str, str]]) -> list[list[tuple[str, str]]]:
    """Megatron-LM's rule: each ``system`` message starts a new conversation."""
    conversations: list[list[tuple[str, str]]] = []
    for role, content in messages:
        if role == "system" or not conversations:
            conversations.append([])
        conversations[-1].append((role, content))
    return conversations


def _messages(source: str, value) -> list[tuple[str, str]]:
    if not isinstance(value, list) or not value:
        raise sft_error(source, '"messages" must be a non-empty list of {"role", "content"} objects')
    turns = []
    for i, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            raise sft_error(source, f'message {i} must be an object with a string "content"')
        role = message.get("role")
        if role not in ROLES:
            raise sft_error(source, f"message {i} has role {role!r}; roles are {', '.join(ROLES)}")
        turns.append((role, message["content"]))
    return turns


def parse_line(source: str, line: str) -> list[SFTExample]:
    """The examples of one JSONL line (several for a line of several conversations)."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise sft_error(source, f"malformed JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(record, dict):
        raise sft_error(source, "each line must be a JSON object")
    if "messages" in record:
        examples = []
        for conversation in split_conversations(_messages(source, record["messages"])):
            if not any(role == "assistant" for role, _ in conversation):
                raise sft_error(source, "a conversation has no assistant turn (nothing to learn)")
            examples.append(SFTExample(source, messages=tuple(conversation)))
        return examples
    if "input" in record or "output" in record:
        for key in ("input", "output"):
            if not isinstance(record.get(key), str):
                raise sft_error(source, f'"{key}" must be a string (Bridge\'s input / output pair)')
        if not record["output"].strip():
            raise sft_error(source, '"output" is empty (nothing to learn)')
        return [SFTExample(source, input=record["input"], output=record["output"])]
    raise sft_error(source, 'needs "messages" (Megatron-LM) or "input" and "output" (Megatron-Bridge)')


def read_examples(path: str) -> list[SFTExample]:
    """Every example of the JSONL file ``path``, in file order."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = list(f)
    except OSError as err:
        raise ConfigError("--data-path", f"{path}: cannot be read ({err.strerror})") from None
    except UnicodeDecodeError as err:
        raise ConfigError("--data-path", f"{path}: not UTF-8 text ({err.reason})") from None
    examples = []
    for number, line in enumerate(lines, start=1):
        if line.strip():
            examples.extend(parse_line(f"{path}:{number}", line))
    if not examples:
        raise ConfigError("--data-path", f"{path}: holds no examples")
    return examples
