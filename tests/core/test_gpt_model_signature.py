"""GPTModel takes upstream's signature (a layer spec second) and megatron_lite's older one (the
vocabulary size second), and its sharded_state_dict places every entry under upstream's keys."""

import torch

from megatron_lite.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron_lite.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron_lite.core.models.gpt.gpt_model import GPTModel
from megatron_lite.core.transformer.transformer_config import TransformerConfig


def _config(**kwargs):
    return TransformerConfig(
        num_layers=2, hidden_size=16, num_attention_heads=4, use_cpu_initialization=True, **kwargs
    )


def test_the_older_form_keeps_its_tied_output_layer_and_the_upstream_form_is_untied():
    older = GPTModel(_config(), 64, 8)
    upstream = GPTModel(_config(), get_gpt_layer_local_spec(), 64, 8)
    assert older.vocab_size == upstream.vocab_size == 64
    assert older.share_embeddings_and_output_weights and not upstream.share_embeddings_and_output_weights
    assert "output_layer.weight" in upstream.state_dict() and "output_layer.weight" not in older.state_dict()


def test_sharded_state_dict_covers_the_state_dict_with_upstream_checkpoint_keys():
    model = GPTModel(_config(gated_linear_unit=True), get_gpt_layer_local_spec(), 64, 8)
    metadata = {}
    sharded = model.sharded_state_dict(metadata=metadata)
    assert set(sharded) == set(model.state_dict()) and "dp_cp_group" in metadata
    norm = sharded["decoder.layers.1.input_layernorm.weight"]
    assert isinstance(norm, ShardedTensor)
    assert norm.key == "decoder.layers.self_attention.linear_qkv.layer_norm_weight"
    assert norm.global_shape == (2, 16) and norm.global_offset == (1, 0) and norm.prepend_axis_num == 1
    assert sharded["embedding.word_embeddings.weight"].allow_shape_mismatch
    fc1 = sharded["decoder.layers.0.mlp.linear_fc1.weight"]  # gated: its gate and up halves
    assert isinstance(fc1, ShardedTensorFactory)
    assert torch.equal(fc1.merge_fn([t.data for t in fc1.build()]), fc1.data)
