"""How the decoder's layers split over pipeline stages and their model chunks, Megatron's rules:

- even: ``num_layers / pp`` per stage, where ``account_for_embedding_in_pipeline_split`` /
  ``account_for_loss_in_pipeline_split`` count the embedding (first chunk of the first stage) and
  the loss (last chunk of the last stage) as one layer each, so those chunks build one layer fewer;
- uneven: ``num_layers_in_first_pipeline_stage`` / ``num_layers_in_last_pipeline_stage`` fix the
  ends and the other stages share the rest evenly (what lightens the stage that also holds the
  embedding or the output layer and the loss).

With ``vp`` chunks per stage each chunk holds ``1 / vp`` of its stage's layers, and chunk ``c`` of
rank ``r`` follows every chunk ``c' < c`` and chunk ``c`` of every rank ``r' < r`` in layer order.
``pipeline_model_parallel_layout`` instead spells out every chunk's layers (and vp) in that order.
"""

from __future__ import annotations

from megatron_lite.core.transformer.enums import LayerType
from megatron_lite.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout


def pipeline_layout(config) -> PipelineParallelLayerLayout | None:
    """``config.pipeline_model_parallel_layout`` parsed (a string or list set after construction
    included), or None."""
    layout = getattr(config, "pipeline_model_parallel_layout", None)
    if layout is None or isinstance(layout, PipelineParallelLayerLayout):
        return layout
    return PipelineParallelLayerLayout(layout, config.pipeline_model_parallel_size)


def pipeline_layer_counts(config) -> list[list[int]]:
    """``counts[vp_stage][pp_rank]``: transformer layers built by each model chunk. Raises ValueError
    naming the rule broken when the layers do not split that way."""
    pp, vp = config.pipeline_model_parallel_size, config.virtual_pipeline_model_parallel_size or 1
    first = config.num_layers_in_first_pipeline_stage
    last = config.num_layers_in_last_pipeline_stage
    embedding = config.account_for_embedding_in_pipeline_split
    loss = config.account_for_loss_in_pipeline_split
    layout = pipeline_layout(config)
    if layout is not None:
        return _layout_counts(config, layout, first, last, embedding, loss)
    if first is not None or last is not None:
        if embedding or loss:
            raise ValueError(
                "an uneven first / last stage cannot be combined with accounting for the embedding "
                "or the loss in the pipeline split"
            )
        if pp == 1:
            raise ValueError("an uneven first / last stage needs pipeline parallelism")
        fixed = {rank: n for rank, n in ((0, first), (pp - 1, last)) if n is not None}
        if any(n <= 0 for n in fixed.values()):
            raise ValueError("the first and last stages must hold at least one layer each")
        middle_stages, rest = pp - len(fixed), config.num_layers - sum(fixed.values())
        ends = " + ".join(map(str, fixed.values()))
        if middle_stages == 0 and rest:
            raise ValueError(
                f"the first and last stages' {ends} layers must add up to the {config.num_layers} layers"
                " (no other stage is left)"
            )
        if rest < 0:
            raise ValueError(
                f"the first and last stages' {ends} layers exceed the {config.num_layers} layers"
            )
        # As upstream: middle stages, if any, hold at least one layer each.
        if middle_stages and (rest == 0 or rest % middle_stages):
            raise ValueError(
                f"the {rest} layers left after the first and last stages do not split evenly over "
                f"the {middle_stages} other stage(s)"
            )
        per_stage = [fixed.get(rank, rest // max(middle_stages, 1)) for rank in range(pp)]
    else:
        slots = config.num_layers + int(embedding) + int(loss)
        if slots % pp:
            counted = " and ".join(name for name, on in (("embedding", embedding), ("loss", loss)) if on)
            accounted = f" (the {counted} counted as one layer{' each' if embedding and loss else ''})"
            accounted = accounted if counted else ""
            raise ValueError(f"{slots} layers{accounted} do not split evenly over {pp} stages")
        per_stage = [slots // pp] * pp
    uneven = [n for n in per_stage if n % vp]
    if uneven:
        raise ValueError(f"a stage's {uneven[0]} layers do not split evenly into {vp} model chunks")
    counts = [[n // vp for n in per_stage] for _ in range(vp)]
    if embedding:
        counts[0][0] -= 1
    if loss:
        counts[-1][-1] -= 1
    return counts


def _layout_counts(config, layout, first, last, embedding, loss) -> list[list[int]]:
    if first is not None or last is not None or embedding or loss:
        raise ValueError(
            "a pipeline layout cannot be combined with an uneven first / last stage or with accounting "
            "for the embedding or the loss in the split"
        )
    vp = config.virtual_pipeline_model_parallel_size or 1
    if layout.virtual_pipeline_model_parallel_size != vp:
        raise ValueError(
            f"its {layout.virtual_pipeline_model_parallel_size} stage(s) per rank conflict with a virtual "
            f"pipeline size of {vp}"
        )
    layout.validate_layer_layout(config.num_layers, getattr(config, "mtp_num_layers", None))
    pp = config.pipeline_model_parallel_size
    return [[layout.layout[r][c].count(LayerType.decoder) for r in range(pp)] for c in range(vp)]


def layers_per_pipeline_stage(config) -> list[int]:
    """Transformer layers on each pipeline stage, over all its model chunks."""
    counts = pipeline_layer_counts(config)
    return [sum(row[rank] for row in counts) for rank in range(config.pipeline_model_parallel_size)]


def chunk_layer_offset(config, vp_stage: int, pp_rank: int) -> int:
    """Global index of the first layer of chunk ``vp_stage`` of stage ``pp_rank``."""
    counts = pipeline_layer_counts(config)
    return sum(map(sum, counts[:vp_stage])) + sum(counts[vp_stage][:pp_rank])
