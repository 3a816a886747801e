"""Rendering one SFT example to token ids, with a flag per id saying whether it is answer text.

Conversations (``messages``) are rendered by the tokenizer's chat template when it has one (the
``chat_template`` of a Hugging Face tokenizer's ``tokenizer_config.json``, or its ``chat_template.jinja``),
in jinja2's sandboxed environment, so a template read from disk cannot run code. Each assistant turn's
text is what rendering the conversation up to and including that turn adds to rendering it up to the
turn with ``add_generation_prompt=True`` (so the assistant header is prompt, the answer and the
template's end-of-turn marker are answer). Without a chat template, the documented default::

    System: {content}\\n\\n        (prompt)
    User: {content}\\n\\n          (prompt)
    Assistant: {content}<eod>     ("Assistant: " is prompt; the content and <eod> are answer)

Megatron-Bridge's ``input`` / ``output`` pairs use its GPTSFTDataset default ``"{input} {output}"`` with
eos: the input is prompt, the space, the output and <eod> are answer (``answer_only_loss``).

Each piece is tokenized on its own and the ids concatenated, so the prompt / answer boundary is
exact (a token never straddles it).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np

from megatron_lite.data.sft.examples import SFTExample, sft_error
from megatron_lite.training.errors import ConfigError


@dataclass(frozen=True)
class TokenizedExample:
    """An example's token ids and, per id, whether it is answer text (learned)."""

    ids: np.ndarray
    """int32 [L]."""
    answer: np.ndarray
    """bool [L]: True where ids[i] is assistant / output text (or the eod that ends it)."""
    source: str

    @property
    def segment_length(self) -> int:
        """Positions the example takes in a row: L - 1 (inputs ids[:-1], labels ids[1:])."""
        return len(self.ids) - 1


def _tokenizer_directory(tokenizer) -> str | None:
    model = getattr(tokenizer, "unique_identifiers", {}).get("tokenizer_model")
    if not model:
        return None
    return model if os.path.isdir(model) else os.path.dirname(model)


def load_chat_template(tokenizer) -> tuple[str | None, dict[str, str]]:
    """The tokenizer's chat template (None if it has none) and its special tokens' text
    (``bos_token``, ``eos_token``, ...) that templates refer to."""
    directory = _tokenizer_directory(tokenizer)
    if directory is None:
        return None, {}
    config_path = os.path.join(directory, "tokenizer_config.json")
    config = {}
    if os.path.isfile(config_path):
        try:
            with open(config_path, encoding="utf-8") as f:
                config = json.load(f)
        except (OSError, ValueError) as err:
            raise ConfigError("--tokenizer-model", f"{config_path}: not readable JSON ({err})") from None
    special = {}
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = config.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            special[key] = value
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    jinja_path = os.path.join(directory, "chat_template.jinja")
    if template is None and os.path.isfile(jinja_path):
        with open(jinja_path, encoding="utf-8") as f:
            template = f.read()
    return (template if isinstance(template, str) else None), special


def _generation_blocks():
    """The ``{% generation %}`` ... ``{% endgeneration %}`` tags some chat templates mark answers with
    (transformers' assistant masks): rendered as their body, since the answers are found turn by turn."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class GenerationBlocks(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    return GenerationBlocks


def compile_chat_template(template: str):
    """A jinja2 template in the sandboxed environment, with the globals transformers gives chat
    templates (``raise_exception``, ``strftime_now``) and its ``tojson``."""
    from datetime import datetime

    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_generation_blocks()]
    )
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    try:
        return env.from_string(template)
    except TemplateError as err:
        raise ConfigError("--tokenizer-model", f"the chat template does not compile: {err}") from None


class PromptRenderer:
    """Renders and tokenizes examples with ``tokenizer`` (its chat template, else the default)."""

    def __init__(self, tokenizer, use_chat_template: bool = True):
        self.tokenizer = tokenizer
        template, self.special_tokens = load_chat_template(tokenizer) if use_chat_template else (None, {})
        self.template = compile_chat_template(template) if template is not None else None

    @property
    def uses_chat_template(self) -> bool:
        return self.template is not None

    def _render(self, source: str, messages, add_generation_prompt: bool) -> str:
        from jinja2 import TemplateError

        try:
            return self.template.render(
                messages=[{"role": r, "content": c} for r, c in messages],
                add_generation_prompt=add_generation_prompt,
                **self.special_tokens,
            )
        except TemplateError as err:
            raise sft_error(source, f"the chat template refuses this conversation: {err}") from None
        except Exception as err:  # a template's own bug (a bad operand, a missing key): still one line
            raise sft_error(
                source, f"the chat template fails on this conversation ({type(err).__name__}: {err})"
            ) from None

    def pieces(self, example: SFTExample) -> list[tuple[str | int, bool]]:
        """``(text or token id, is_answer)`` pieces whose concatenation is the rendered example."""
        eod = self.tokenizer.eod
        if example.messages is None:
            return [(example.input.strip(" "), False), (" " + example.output.strip(" "), True), (eod, True)]
        if self.template is None:
            pieces: list[tuple[str | int, bool]] = []
            for role, content in example.messages:
                if role == "assistant":
                    pieces += [("Assistant: ", False), (content, True), (eod, True)]
                else:
                    pieces.append((f"{role.capitalize()}: {content}\n\n", False))
            return pieces
        return self._template_pieces(example)

    def _template_pieces(self, example: SFTExample) -> list[tuple[str, bool]]:
        pieces, done = [], ""
        messages = example.messages
        for i, (role, _content) in enumerate(messages):
            if role != "assistant":
                continue
            prompt = self._render(example.source, messages[:i], add_generation_prompt=True)
            full = self._render(example.source, messages[: i + 1], add_generation_prompt=False)
            if not (prompt.startswith(done) and full.startswith(prompt)):
                raise sft_error(
                    example.source,
                    "the chat template does not render this conversation turn by turn (each rendering "
                    "must extend the previous), so its answers cannot be found",
                )
            pieces += [(prompt[len(done) :], False), (full[len(prompt) :], True)]
            done = full
        rest = self._render(example.source, messages, add_generation_prompt=False)
        if not rest.startswith(done):
            raise sft_error(example.source, "the chat template renders the whole conversation differently")
        pieces.append((rest[len(done) :], False))
        return pieces

    def tokenize(self, example: SFTExample) -> TokenizedExample:
        ids, answer = [], []
        for piece, is_answer in self.pieces(example):
            piece_ids = [piece] if isinstance(piece, int) else self.tokenizer.tokenize(piece) if piece else []
            ids += piece_ids
            answer += [is_answer] * len(piece_ids)
        return TokenizedExample(np.asarray(ids, np.int32), np.asarray(answer, bool), example.source)
