"""Upstream's Python API end to end: a ConfigContainer built in code, with a mixed-precision recipe by
name and a custom DatasetProvider, handed to pretrain() unvalidated (as Megatron-Bridge's users do),
in a real one-rank gloo world."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from dist_helpers import run_world

from megatron_lite.core.datasets.gpt_dataset import MockGPTDataset
from megatron_lite.models.gpt_provider import GPTModelProvider
from megatron_lite.training.config import (
    ConfigContainer,
    DatasetBuildContext,
    DatasetProvider,
    LoggerConfig,
    TrainingConfig,
    ValidationConfig,
)

pytestmark = pytest.mark.world  # every test here starts processes

SEQ, VOCAB = 32, 128


@dataclass
class ArithmeticProvider(DatasetProvider):
    """A custom dataset with no seq_length field of its own (upstream's contract allows that)."""

    seed: int = 7

    def build_datasets(self, context: DatasetBuildContext):
        self.context = context
        train = MockGPTDataset(
            vocab_size=VOCAB, sequence_length=SEQ, seed=self.seed, num_samples=context.train_samples
        )
        return train, None, None


def _train(rank, world):
    import megatron_lite.training.pretrain as pretrain_module
    from megatron_lite.training.gpt_step import forward_step

    provider = ArithmeticProvider(num_workers=0)
    cfg = ConfigContainer(
        model=GPTModelProvider(
            num_layers=2,
            hidden_size=32,
            num_attention_heads=4,
            vocab_size=VOCAB,
            seq_length=SEQ,
            max_position_embeddings=SEQ,
        ),
        train=TrainingConfig(micro_batch_size=2, global_batch_size=4, train_iters=2),
        validation=ValidationConfig(eval_iters=0),
        dataset=provider,
        logger=LoggerConfig(log_interval=1),
        mixed_precision="bf16_mixed",
    )
    captured = {}
    real_setup = pretrain_module.setup

    def recording_setup(state):
        captured["s"] = real_setup(state)
        return captured["s"]

    pretrain_module.setup = recording_setup
    pretrain_module.pretrain(cfg, forward_step)
    dtypes = {p.dtype for chunk in captured["s"].model for p in chunk.module.parameters()}
    c = provider.context  # its process groups stay in the worker: report whether they came
    samples = (c.train_samples, c.valid_samples, c.test_samples, c.pg_collection is not None)
    return samples, cfg.model.bf16, dtypes, captured["s"].state.train_state.step


def test_unvalidated_config_with_recipe_name_and_custom_dataset_trains(capfd):
    [(samples, bf16, dtypes, steps)] = run_world(_train, 1)
    # runtime_config_update ran inside pretrain(): the recipe reached the model, and the provider was
    # asked for the run's samples (2 iterations of 4), with the run's process groups.
    assert bf16 and dtypes == {torch.bfloat16}
    assert samples == (8, 0, 0, True)
    assert steps == 2
    out = capfd.readouterr().out
    assert " iteration        2/       2 |" in out, out[-2000:]
