"""Validation: forward-only passes over held-out synthetic batches."""

from __future__ import annotations

import math

import torch

from megatron_lite.core import parallel_state
from megatron_lite.core.pipeline_parallel import get_forward_backward_func
from megatron_lite.training.config import ConfigContainer
from megatron_lite.training.forward_step_func_types import prepare_forward_step_func
from megatron_lite.training.metrics import VALIDATION, MetricsWriter, StepMetrics
from megatron_lite.training.state import GlobalState
from megatron_lite.training.utils.loss_reduction import accumulate_loss_reports, reduce_loss_reports
from megatron_lite.training.utils.train_utils import print_rank_last


def evaluate(
    forward_step_func, data_iterator, model, config: ConfigContainer, global_state: GlobalState, pg_collection
) -> dict[str, float]:
    """Forward-only over eval_iters global batches; returns the loss averaged over them and DP ranks.
    Collective over the pipeline and data-parallel groups."""
    m = config.model
    forward_backward = get_forward_backward_func(
        m.pipeline_model_parallel_size, m.virtual_pipeline_model_parallel_size
    )
    chunks = model if isinstance(model, list) else [model]
    forward_step_func = prepare_forward_step_func(forward_step_func, global_state)
    totals: dict[str, torch.Tensor] = {}
    for chunk in chunks:
        chunk.eval()  # no dropout while validating
    with torch.no_grad():
        v = config.validation  # eval batch sizes: resolved from train's by ConfigContainer.validate
        eval_mbs = v.eval_micro_batch_size or config.train.micro_batch_size
        eval_gbs = v.eval_global_batch_size or config.train.global_batch_size
        for _ in range(v.eval_iters):
            losses = forward_backward(
                forward_step_func=forward_step_func,
                data_iterator=data_iterator,
                model=model,
                num_microbatches=eval_gbs // (eval_mbs * config.data_parallel_size),
                seq_length=config.model.seq_length,
                micro_batch_size=eval_mbs,
                forward_only=True,
                pg_collection=pg_collection,
            )
            global_state.train_state.consumed_valid_samples += eval_gbs
            accumulate_loss_reports(totals, losses)
    for chunk in chunks:
        chunk.train()
    if not parallel_state.is_pipeline_last_stage():
        return {}
    return {k: v.item() for k, v in reduce_loss_reports(totals, pg_collection.dp_cp).items()}


def evaluate_and_print_results(forward_step_func, data_iterator, model, config, global_state, pg_collection):
    results = evaluate(forward_step_func, data_iterator, model, config, global_state, pg_collection)
    iteration = global_state.train_state.step
    if results:
        line = f" validation loss at iteration {iteration} |"
        # Upstream's tags: the loss, against the step and the consumed samples; the perplexity too with
        # --log-validation-ppl-to-tensorboard.
        metrics = StepMetrics(iteration, samples=global_state.train_state.consumed_train_samples)
        for key, value in results.items():
            ppl = math.exp(min(20.0, value))
            line += f" {key} value: {value:.6E} | {key} PPL: {ppl:.6E} |"
            metrics.add({f"{key} validation": value}, vs_samples=True, kind=VALIDATION)
            if config.logger.log_validation_ppl_to_tensorboard:
                metrics.add({f"{key} validation ppl": ppl}, vs_samples=True, kind=VALIDATION)
        print_rank_last(line)
        MetricsWriter.from_state(global_state).write_step(metrics)
