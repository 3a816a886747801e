"""--pipeline-model-parallel-layout: which layers each (virtual) pipeline stage holds, spelled out.

A layout is a list of ``pp * vp`` stages in layer order (stage ``i`` is chunk ``i // pp`` of rank
``i % pp``), each a list of layer types; as a string, stages are split by ``|`` and each character is
a layer: ``E`` the embedding, ``t`` a transformer (decoder) layer, ``L`` the loss, ``m`` a
multi-token-prediction layer; ``x*n`` and ``(...)*n`` repeat, commas are cosmetic. ``"Ett|(tt|)*2,tL"``
at pp 4 is 2, 2, 2, 1 decoder layers. The embedding must come first and the loss last, once each.
"""

from __future__ import annotations

import re

from megatron_lite.core import parallel_state
from megatron_lite.core.transformer.enums import LayerType

_CHARACTERS = {"E": LayerType.embedding, "L": LayerType.loss, "t": LayerType.decoder, "m": LayerType.mtp}


class PipelineParallelLayerLayout:
    """A parsed layout for ``pipeline_model_parallel_size`` ranks; ``layout[pp_rank][vp_stage]`` is
    that chunk's list of LayerType. Malformed input raises ValueError naming the problem."""

    def __init__(self, layout: str | list, pipeline_model_parallel_size: int):
        self.input_data = layout
        stages = self.parse_str_to_list(layout) if isinstance(layout, str) else [list(s) for s in layout]
        pp = pipeline_model_parallel_size
        if len(stages) % pp:
            raise ValueError(f"its {len(stages)} stages do not divide over {pp} pipeline ranks")
        vp = len(stages) // pp
        self.pipeline_model_parallel_size, self.virtual_pipeline_model_parallel_size = pp, vp
        self.layout = [[[_layer_type(x) for x in stages[c * pp + r]] for c in range(vp)] for r in range(pp)]
        self.flatten_layout = [x for c in range(vp) for r in range(pp) for x in self.layout[r][c]]

    def __repr__(self) -> str:
        return self.input_data if isinstance(self.input_data, str) else str(self.input_data)

    @staticmethod
    def parse_str_to_list(layout_str: str) -> list[list[LayerType]]:
        """``"Ett|(tt|)*2,tL"`` -> E t t | t t | t t | t L as lists of LayerType (upstream's grammar:
        parenthesised groups are unrolled before single characters)."""
        text = layout_str.replace(",", "")
        for pattern in (r"\(([^)]+)\)\*(\d+)", r"(.)\*(\d+)"):
            text = re.sub(pattern, lambda m: m.group(1) * int(m.group(2)), text)
        stages = text.split("|")
        unknown = sorted({c for stage in stages for c in stage if c not in _CHARACTERS})
        if unknown:
            raise ValueError(f"{unknown[0]!r} is not a layer (E, t, L or m) in {layout_str!r}")
        return [[_CHARACTERS[c] for c in stage] for stage in stages]

    @staticmethod
    def get_num_stages_from_str(layout: str) -> int:
        """Number of pp x vp stages a layout string spells."""
        return len(PipelineParallelLayerLayout.parse_str_to_list(layout))

    @staticmethod
    def from_str(layout: str, pipeline_model_parallel_size: int) -> PipelineParallelLayerLayout:
        return PipelineParallelLayerLayout(layout, pipeline_model_parallel_size)

    def validate_layer_layout(self, num_layers: int, mtp_num_layers: int | None = None) -> bool:
        """Raise ValueError unless the embedding is the first layer and the loss the last (once each)
        and the layout holds exactly ``num_layers`` decoder layers. Returns whether MTP stands alone
        (always False: megatron_lite has no MTP layers)."""
        flat = self.flatten_layout
        if not flat or flat[0] != LayerType.embedding or flat.count(LayerType.embedding) != 1:
            raise ValueError("the embedding (E) must be its first layer, and appear once")
        if flat[-1] != LayerType.loss or flat.count(LayerType.loss) != 1:
            raise ValueError("the loss (L) must be its last layer, and appear once")
        if LayerType.mtp in flat or LayerType.encoder in flat or mtp_num_layers:
            raise ValueError("multi-token prediction (m) layers are not supported yet by megatron_lite")
        decoders = flat.count(LayerType.decoder)
        if decoders != num_layers:
            raise ValueError(f"it holds {decoders} transformer layers (t) but --num-layers is {num_layers}")
        return False

    def _chunk(self, vp_stage: int | None, pp_rank: int | None) -> tuple[int, int]:
        if pp_rank is None:
            pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        if vp_stage is None:
            if self.virtual_pipeline_model_parallel_size > 1:
                raise ValueError("vp_stage must be given when the layout has virtual stages")
            vp_stage = 0
        return vp_stage, pp_rank

    def get_num_layers_to_build(
        self,
        layer_type: LayerType = LayerType.decoder,
        vp_stage: int | None = None,
        pp_rank: int | None = None,
    ) -> int:
        """Layers of ``layer_type`` in chunk ``vp_stage`` of rank ``pp_rank``."""
        vp_stage, pp_rank = self._chunk(vp_stage, pp_rank)
        return self.layout[pp_rank][vp_stage].count(layer_type)

    def get_layer_offset(
        self,
        layer_type: LayerType = LayerType.decoder,
        vp_stage: int | None = None,
        pp_rank: int | None = None,
    ) -> int:
        """Layers of ``layer_type`` in every stage before chunk ``vp_stage`` of rank ``pp_rank``."""
        vp_stage, pp_rank = self._chunk(vp_stage, pp_rank)
        pp = self.pipeline_model_parallel_size
        before = [
            self.layout[r][c] for c in range(vp_stage + 1) for r in range(pp if c < vp_stage else pp_rank)
        ]
        return sum(stage.count(layer_type) for stage in before)

    def get_layer_id_list(
        self,
        layer_type: LayerType = LayerType.decoder,
        vp_stage: int | None = None,
        pp_rank: int | None = None,
    ) -> list[int]:
        offset = self.get_layer_offset(layer_type, vp_stage, pp_rank)
        return list(range(offset, offset + self.get_num_layers_to_build(layer_type, vp_stage, pp_rank)))


def _layer_type(x) -> LayerType:
    if isinstance(x, LayerType):
        return x
    if isinstance(x, str) and x.strip().lower() in LayerType.__members__:
        return LayerType[x.strip().lower()]
    raise ValueError(f"{x!r} is not a layer type ({', '.join(LayerType.__members__)})")
