"""The run's train and validation datasets and their iterators (Megatron-LM's pretrain_gpt provider).

Mock data: megatron_lite's synthetic sequences. A DatasetProvider: what its build_datasets returns.
Real data: GPTDataset / BlendedDataset through
BlendedMegatronDatasetBuilder, sized as upstream's get_train_valid_test_num_samples, their indices
cached under ``--data-cache-path`` (default: beside each prefix, as upstream). Either way each
iterator starts at the consumed-sample count restored from the checkpoint, so resume is exact.
"""

from __future__ import annotations

import copy

import torch.distributed as dist

from megatron_lite.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron_lite.core.datasets.gpt_dataset import GPTDataset, MockGPTDataset
from megatron_lite.data.base import DatasetBuildContext, DatasetProvider
from megatron_lite.data.samplers import build_pretraining_data_loader
from megatron_lite.utils.common_utils import print_rank_0


def get_train_valid_test_num_samples(config) -> tuple[int, int, int]:
    """Samples per split, as upstream: the training run's, one validation pass per eval interval
    plus the final one, and one pass for the test split."""
    t, v = config.train, config.validation
    train = t.train_samples or t.train_iters * t.global_batch_size
    eval_gbs = v.eval_global_batch_size or t.global_batch_size
    evals = (t.train_iters // v.eval_interval + 1) if v.eval_interval else 0
    return train, evals * v.eval_iters * eval_gbs, v.eval_iters * eval_gbs


def is_dataset_built_on_rank() -> bool:
    """Every rank builds and reads the datasets. Upstream builds them on tensor-parallel rank 0 of
    the first and last stages and broadcasts each batch over TP; reading the memory-mapped files
    everywhere is cheap and keeps every stage's data position equal without that broadcast."""
    return True


def train_valid_test_datasets_provider(train_val_test_num_samples, config, tokenizer) -> list:
    """``[train, valid, test]`` GPT datasets of ``config.dataset`` (None for an empty split), read
    with the run's ``tokenizer``. Collective over the world: rank 0 builds (and caches) the indices first."""
    dataset_config = copy.copy(config.dataset)  # the tokenizer stays out of the saved config
    dataset_config.tokenizer = tokenizer
    print_rank_0("> building train, validation, and test datasets for GPT ...")
    datasets = BlendedMegatronDatasetBuilder(
        GPTDataset, list(train_val_test_num_samples), is_dataset_built_on_rank, dataset_config
    ).build()
    print_rank_0("> finished creating GPT datasets ...")
    return datasets


def build_train_valid_datasets(config, pg_collection=None, tokenizer=None) -> tuple:
    """The training and validation datasets; real data and a DatasetProvider read with the run's
    ``tokenizer`` (the caller builds it: the tokenizers live above the data). Collective over the
    world with real data."""
    ds, m, t, v = config.dataset, config.model, config.train, config.validation
    if tokenizer is None and not isinstance(ds, DatasetProvider) and not ds.mock:
        raise ValueError(
            "build_train_valid_datasets: real data needs the run's tokenizer (get_tokenizer(config))"
        )
    if isinstance(ds, DatasetProvider):
        samples = get_train_valid_test_num_samples(config)
        context = DatasetBuildContext(*samples, tokenizer=tokenizer, pg_collection=pg_collection)
        train, valid, _test = ds.build_datasets(context)
        return train, valid
    if not ds.mock:
        train, valid, _test = train_valid_test_datasets_provider(
            get_train_valid_test_num_samples(config), config, tokenizer
        )
        return train, valid
    evals = (t.train_iters // v.eval_interval + 1) if v.eval_interval else 0
    eval_gbs = v.eval_global_batch_size or t.global_batch_size
    sizes = (t.train_iters * t.global_batch_size, max(evals * v.eval_iters * eval_gbs, 1))
    return tuple(
        MockGPTDataset(
            vocab_size=m.vocab_size,
            sequence_length=ds.sequence_length,
            seed=ds.random_seed + i,
            num_samples=n,
        )
        for i, n in enumerate(sizes)
    )


def build_data_iterator(dataset, consumed: int, micro_batch_size: int, config, dp_group):
    """This data-parallel rank's microbatches of ``dataset`` from ``consumed`` on; None when there
    is no dataset or nothing is left of it."""
    if dataset is None or len(dataset) <= consumed:
        return None
    loader = build_pretraining_data_loader(
        dataset,
        consumed,
        micro_batch_size,
        dist.get_rank(dp_group),
        dist.get_world_size(dp_group),
        num_workers=config.dataset.num_workers,
    )
    return iter(loader)
