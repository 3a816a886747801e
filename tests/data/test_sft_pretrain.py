"""``pretrain.py --sft`` as a user runs it: packed SFT at pp 2 from an offline pack file, and bad input
stopped in the launcher in one line with nothing written. (Resuming needs nothing of its own: a row is
a function of its sample index, test_sft_config checks that, and the sampler resumes at the consumed
count as for pretraining.)"""

from __future__ import annotations

import re

import pytest
from corpus_helpers import _tool
from dist_helpers import loss_lines, run_pretrain
from sft_helpers import CHAT_TEMPLATE, records, word_tokenizer, write_jsonl

MODEL = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "32"]
MODEL += ["--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "4", "--log-interval", "1"]
MODEL += [
    "--pipeline-model-parallel-size",
    "2",
    "--split",
    "90,10,0",
    "--eval-interval",
    "2",
    "--eval-iters",
    "1",
]


def _ok(result):
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr
    return result


@pytest.mark.world
def test_packed_sft_at_pp2_trains_from_a_pack_file_and_bad_input_stops_the_launch(tmp_path):
    word_tokenizer(tmp_path / "tok", CHAT_TEMPLATE)
    tok = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tmp_path / "tok")]
    data = write_jsonl(tmp_path / "d.jsonl", records(60))
    packs = tmp_path / "d.safetensors"
    assert (
        _tool("prepare_sft_data").main(
            ["--input", str(data), "--output", str(packs), "--seq-length", "32", *tok]
        )
        == 0
    )
    args = ["--sft", "--data-path", str(packs), *tok, *MODEL]
    straight = _ok(run_pretrain(args, tmp_path))
    losses = loss_lines(straight.stdout)
    assert sorted(losses) == [1, 2, 3, 4]
    said = re.search(r"SFT train: (\d+) examples in (\d+) packs .* ([\d.]+)% padding", straight.stdout)
    assert said and int(said[1]) < 60 and float(said[3]) < 20  # the train split of the file's packs
    assert float(losses[4]) < float(losses[1])

    bad = write_jsonl(
        tmp_path / "bad.jsonl", [*records(5), {"messages": [{"role": "user", "content": "hi"}]}]
    )
    result = run_pretrain(["--sft", "--data-path", str(bad), *tok, *MODEL, "--save", "never"], tmp_path)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert f"{bad}:6: a conversation has no assistant turn" in lines[0]
    assert not (tmp_path / "never").exists() and "iteration" not in result.stdout
