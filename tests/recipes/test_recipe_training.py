"""Every recipe trains two iterations on CPU at a shrunk size, through the runner as a user runs it
(resolve, validate, save run_config.yaml, fork the workers, which read it back): the recipe's own
layout where two ranks hold it (context parallelism for Llama 3 8B, tensor parallelism for Qwen2 and
Llama 3 8B's SFT recipe, pipeline parallelism for 70B's, expert parallelism for Mixtral), its optimizer, precision and data kind otherwise.
The fine-tuning recipes train on a tiny JSONL with a word-level tokenizer, the LoRA ones from the
checkpoint the Llama 3 8B run saved."""

from __future__ import annotations

import os
import re
import warnings

import pytest
from dist_helpers import REPO, parse_losses, run_script
from sft_training_helpers import write_sft_data

from megatron_lite.recipes.runner import main

RUN_RECIPE = str(REPO / "scripts" / "training" / "run_recipe.py")

# Small enough for a second a run: 2 layers of width 64, 32 tokens, 2 microbatches of 1.
TINY = [
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.num_attention_heads=4",
    "model.num_query_groups=2",
    "model.ffn_hidden_size=128",
    "model.kv_channels=16",
    "model.vocab_size=64",
    "model.make_vocab_size_divisible_by=64",
    "tokenizer.vocab_size=63",
    *("-sl", "32", "-gb", "2", "-mb", "1", "-ms", "2", "--warmup_iters", "1"),
    "dataset.num_workers=0",
    "validation.eval_iters=0",
    "logger.log_interval=1",
    "logger.log_memory_to_tensorboard=false",
    "env_vars={}",  # the recipes' NCCL variables would be set in this (the test's) process
    "checkpoint.load=null",
    "checkpoint.save=null",
    "checkpoint.save_interval=null",
]
NO_SP = ["model.sequence_parallel=false"]  # sequence parallelism needs tp > 1
NULL_TOKENIZER = ["tokenizer.tokenizer_type=NullTokenizer", "tokenizer.tokenizer_model=null"]

# (recipe, its shrunk layout and what else it needs); the world is the layout's model-parallel size.
RUNS = [
    ("llama3_8b_pretrain_config", ["-cp", "2"]),  # the recipe's own cp 2
    (
        "llama3_70b_pretrain_config",
        ["-tp", "1", "-cp", "1", "-pp", "2", "-vp", "2", "model.num_layers=4", *NO_SP],
    ),
    ("qwen2_7b_pretrain_config", []),  # the recipe's own tp 2
    (
        "mixtral_8x7b_pretrain_config",
        [
            "-tp",
            "1",
            "-ep",
            "2",
            *NO_SP,
            "model.num_moe_experts=4",
            "model.moe_ffn_hidden_size=64",
            *NULL_TOKENIZER,
        ],
    ),
    # fp32: LayerNorm in bf16 takes a second an iteration on a CPU without bf16 units.
    ("vanilla_gpt_pretrain_config", ["mixed_precision=null", "optimizer.bf16=false"]),
    ("gpt2_small_pretrain_cpu_config", []),
]


def _run(argv: list[str], capfd) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code = main(argv, RUN_RECIPE)
    out, err = capfd.readouterr()
    assert code == 0, out[-3000:] + err[-3000:]
    return out


@pytest.mark.world
def test_every_recipe_trains_two_iterations_on_cpu_through_the_runner(tmp_path, capfd):
    trained = {}
    for recipe, extra in RUNS:
        tb = tmp_path / recipe / "tb"
        save = (
            ["checkpoint.save=" + str(tmp_path / "ck"), "checkpoint.save_interval=2"]
            if "8b" in recipe
            else []
        )
        out = _run(["--recipe", recipe, *TINY, *extra, f"logger.tensorboard_dir={tb}", *save], capfd)
        trained[recipe] = parse_losses(out)
        saved_beside = tmp_path if save else tmp_path / recipe  # the checkpoints' parent, else the logs'
        assert (saved_beside / "run_config.yaml").exists()
        world = re.search(r"world (\d+) = ", out)
        assert world and int(world[1]) == (1 if "gpt" in recipe else 2), out[-2000:]
    assert {r: sorted(losses) for r, losses in trained.items()} == {r: [1, 2] for r, _ in RUNS}

    # Fine-tuning: local JSONL and a word-level tokenizer (upstream downloads SQuAD and the model's).
    (tmp_path / "sft").mkdir()
    write_sft_data(str(tmp_path / "sft"))
    finetune = [
        f"tokenizer.tokenizer_model={tmp_path / 'sft'}",
        f"dataset.data_path=[{tmp_path / 'sft' / 'train.jsonl'}]",
    ]
    finetune += ["tokenizer.vocab_size=null"]
    for recipe, extra in [
        ("llama3_8b_sft_config", []),  # the recipe's own tp 2
        ("llama3_70b_sft_config", ["-tp", "1", "-pp", "2"]),
        ("llama3_8b_peft_config", [f"--pretrained_checkpoint={tmp_path / 'ck'}"]),
        ("llama3_70b_peft_config", ["-tp", "2", f"--pretrained_checkpoint={tmp_path / 'ck'}"]),
    ]:
        tb = tmp_path / recipe / "tb"
        out = _run(["--recipe", recipe, *TINY, *finetune, *extra, f"logger.tensorboard_dir={tb}"], capfd)
        assert sorted(parse_losses(out)) == [1, 2], out[-2000:]
        assert ("LoRA" in out or "adapter" in out) == ("peft" in recipe), out[-2000:]
    assert not os.path.exists(tmp_path / "nemo_experiments")


@pytest.mark.world
def test_the_script_refuses_bad_input_in_one_line_before_writing_anything(tmp_path):
    result = run_script(
        RUN_RECIPE, ["--recipe", "gpt2_small_pretrain_cpu_config", "model.hiden_size=8"], tmp_path
    )
    assert result.returncode == 2 and result.stdout == "", result.stdout[-2000:] + result.stderr
    assert result.stderr.startswith("run_recipe.py: error: model.hiden_size: GPTModelProvider has no field")
    assert result.stderr.count("\n") == 1 and os.listdir(tmp_path) == []
