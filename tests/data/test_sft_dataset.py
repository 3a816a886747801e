"""SFT examples: reading, rendering, the loss mask (checked against hand-computed ids) and bad input."""

from __future__ import annotations

import pytest
import torch
from sft_helpers import CHAT_TEMPLATE, ids, word_tokenizer, write_jsonl

from megatron_lite.data.sft.build import load_jsonl
from megatron_lite.data.sft.dataset import GPTSFTDataset, fit_examples
from megatron_lite.data.sft.examples import SFTExample, read_examples
from megatron_lite.data.sft.packing import build_row
from megatron_lite.data.sft.prompt import PromptRenderer
from megatron_lite.training.errors import ConfigError

CONVERSATION = {
    "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "what is two plus two"},
        {"role": "assistant", "content": "four"},
    ]
}


def test_default_format_masks_system_and_user_tokens(tmp_path):
    tok = word_tokenizer(tmp_path / "tok")
    example = read_examples(str(write_jsonl(tmp_path / "d.jsonl", [CONVERSATION])))[0]
    out = PromptRenderer(tok).tokenize(example)
    # System: be brief | User: what is two plus two | Assistant: | four </s>   (by hand)
    prompt = ids("System:", "be", "brief", "User:", "what", "is", "two", "plus", "two", "Assistant:")
    answer = ids("four", "</s>")
    assert out.ids.tolist() == prompt + answer
    assert out.answer.tolist() == [False] * len(prompt) + [True] * len(answer)


def test_row_of_one_conversation_learns_only_the_answer(tmp_path):
    tok = word_tokenizer(tmp_path / "tok")
    example = PromptRenderer(tok).tokenize(
        read_examples(str(write_jsonl(tmp_path / "d.jsonl", [CONVERSATION])))[0]
    )
    row = build_row([(example.ids, example.answer)], 16, pad_id=tok.eod)
    full = example.ids.tolist()  # 12 ids: 11 positions, then a pad tail of 5
    assert row["tokens"].tolist() == full[:-1] + [tok.eod] * 5
    assert row["labels"].tolist() == full[1:] + [tok.eod] * 5
    # Position 9 holds "Assistant:" and predicts "four"; position 10 holds "four" and predicts </s>.
    expected_mask = [0.0] * 9 + [1.0, 1.0] + [0.0] * 5
    assert row["loss_mask"].tolist() == expected_mask
    assert row["position_ids"].tolist() == list(range(11)) + list(range(5))
    assert row["cu_seqlens"].tolist() == [0, 11, 16] + [-1] * 15
    assert row["cu_seqlens"].dtype == torch.int32 and row["cu_seqlens_argmin"].item() == 3
    assert row["max_seqlen"].item() == 11 and row["max_seqlen"].dtype == torch.int32
    assert row["loss_mask"].dtype == torch.float32 and row["tokens"].dtype == torch.int64


def test_chat_template_marks_the_assistant_turns_and_their_end_marker(tmp_path):
    tok = word_tokenizer(tmp_path / "tok", CHAT_TEMPLATE)
    record = {
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "bye"},
            {"role": "assistant", "content": "ok"},
        ]
    }
    out = PromptRenderer(tok).tokenize(read_examples(str(write_jsonl(tmp_path / "d.jsonl", [record])))[0])
    words = [
        "<user>",
        "hi",
        "<end>",
        "<assistant>",
        "hello",
        "<end>",
        "<user>",
        "bye",
        "<end>",
        "<assistant>",
        "ok",
        "<end>",
    ]
    assert out.ids.tolist() == ids(*words)
    assert out.answer.tolist() == [w in ("hello", "ok") or (i in (5, 11)) for i, w in enumerate(words)]


def test_chat_template_matches_transformers(tmp_path):
    import transformers  # the dev extra's oracle

    tok = word_tokenizer(tmp_path / "tok", CHAT_TEMPLATE)
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tok" / "tokenizer.json"))
    hf.chat_template = CHAT_TEMPLATE
    example = read_examples(str(write_jsonl(tmp_path / "d.jsonl", [CONVERSATION])))[0]
    out = PromptRenderer(tok).tokenize(example)
    assert out.ids.tolist() == hf.apply_chat_template(CONVERSATION["messages"], tokenize=True)


def test_input_output_pairs_learn_the_output_and_eod(tmp_path):
    tok = word_tokenizer(tmp_path / "tok", CHAT_TEMPLATE)
    example = read_examples(
        str(write_jsonl(tmp_path / "d.jsonl", [{"input": "what is a", "output": "b c"}]))
    )[0]
    out = PromptRenderer(tok).tokenize(example)
    assert out.ids.tolist() == ids("what", "is", "a", "b", "c", "</s>")
    assert out.answer.tolist() == [False] * 3 + [True] * 3


def test_a_line_of_several_conversations_splits_at_each_system_message(tmp_path):
    turns = CONVERSATION["messages"] * 2
    examples = read_examples(str(write_jsonl(tmp_path / "d.jsonl", [{"messages": turns}])))
    assert [len(e.messages) for e in examples] == [3, 3]
    assert all(e.source.endswith("d.jsonl:1") for e in examples)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"messages": [', "d.jsonl:2: malformed JSON"),
        (
            {"messages": [{"role": "user", "content": "hi"}]},
            "d.jsonl:2: a conversation has no assistant turn",
        ),
        ({"messages": [{"role": "bot", "content": "hi"}]}, "d.jsonl:2: message 0 has role 'bot'"),
        ({"text": "hi"}, 'd.jsonl:2: needs "messages"'),
        ({"input": "hi", "output": " "}, 'd.jsonl:2: "output" is empty'),
    ],
)
def test_bad_input_is_one_line_naming_file_and_line(tmp_path, line, message):
    path = write_jsonl(tmp_path / "d.jsonl", [CONVERSATION, line])
    with pytest.raises(ConfigError) as err:
        read_examples(str(path))
    assert str(err.value).startswith("--data-path: ") and message in str(err.value)
    assert "\n" not in str(err.value)


def test_an_example_longer_than_the_pack_is_refused_or_truncated(tmp_path):
    tok = word_tokenizer(tmp_path / "tok")
    path = write_jsonl(tmp_path / "d.jsonl", [CONVERSATION, {"input": "a", "output": "b c"}])
    with pytest.raises(
        ConfigError, match=r"d\.jsonl:1: the example is 12 tokens \(11 positions\), longer than the pack"
    ):
        load_jsonl(str(path), tok, 8, "error", 1, True)
    examples, stats, _ = load_jsonl(str(path), tok, 10, "right", 1, True)
    # The conversation keeps 10 positions: its answer is cut but "Assistant:" -> "four" stays learned.
    assert (stats.examples, stats.truncated, stats.dropped) == (2, 1, 0)
    assert examples.segment_lengths.tolist() == [10, 3]
    _, stats, _ = load_jsonl(str(path), tok, 9, "right", 1, True)
    assert (stats.truncated, stats.dropped) == (1, 1)  # nothing of the answer is left to learn


def test_unpacked_dataset_pads_each_example_to_the_row(tmp_path):
    tok = word_tokenizer(tmp_path / "tok")
    renderer = PromptRenderer(tok)
    pairs = [SFTExample("x:1", input="a", output="b"), SFTExample("x:2", input="a b c", output="c")]
    examples, _ = fit_examples([renderer.tokenize(e) for e in pairs], 8, "error")
    ds = GPTSFTDataset(examples, 8, tok.eod, num_samples=5, seed=3)
    rows = [ds[i] for i in range(5)]
    assert len(ds) == 5
    assert sorted(r["cu_seqlens"][:3].tolist() for r in rows[:2]) == [[0, 2, 8], [0, 4, 8]]
    assert all(r["loss_mask"].sum().item() == 2 for r in rows)  # each answer token and its eod
    assert torch.utils.data.default_collate(rows)["cu_seqlens"].shape == (5, 10)


CHATML = (
    "{% for m in messages %}{% if loop.first and m['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are helpful.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' }}"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] + '<|im_end|>\\n' }}{% endgeneration %}"
    "{% else %}{{ m['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_a_chatml_template_gives_transformers_ids_and_assistant_mask(tmp_path):
    """A byte-level BPE with ChatML's special tokens: the ids are transformers' apply_chat_template's and
    the answer flags its assistant mask (the template's {% generation %} blocks)."""
    import json

    import transformers  # the dev extra's oracle
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from megatron_lite.training.tokenizers.tokenizer import HuggingFaceTokenizer

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=special, initial_alphabet=alphabet)
    tok.train_from_iterator(
        ["You are helpful. What is two plus two? It is four. Say hi."] * 20, trainer=trainer
    )
    (tmp_path / "tok").mkdir()
    tok.save(str(tmp_path / "tok" / "tokenizer.json"))
    config = {"eos_token": "<|im_end|>", "chat_template": CHATML}
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps(config))
    messages = [
        {"role": "user", "content": "What is two plus two?"},
        {"role": "assistant", "content": "It is four."},
        {"role": "user", "content": "Say hi."},
        {"role": "assistant", "content": "hi"},
    ]
    example = read_examples(str(write_jsonl(tmp_path / "d.jsonl", [{"messages": messages}])))[0]
    ours = PromptRenderer(HuggingFaceTokenizer(str(tmp_path / "tok"))).tokenize(example)
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tok" / "tokenizer.json"))
    hf.chat_template = CHATML
    theirs = hf.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    assert ours.ids.tolist() == theirs["input_ids"]
    assert ours.answer.astype(int).tolist() == theirs["assistant_masks"]
    assert 0 < ours.answer.sum() < len(ours.ids)
