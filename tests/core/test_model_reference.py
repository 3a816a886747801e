"""Our GPTModel's logits equal an independent implementation's (Hugging Face ``transformers``, built
from a config, no download) when the same weights are copied in: Llama-shaped (RoPE, RMSNorm, SwiGLU,
GQA, untied embeddings, no biases; Llama 3.x's rope scaling) and GPT-2-shaped (the default, with the
exact GELU or GPT-2's own tanh one)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers  # the dev extra's independent implementation
from dist_helpers import run_world

from megatron_lite.core.activations import openai_gelu
from megatron_lite.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron_lite.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron_lite.core.models.gpt.gpt_model import GPTModel
from megatron_lite.core.process_groups_config import ProcessGroupCollection
from megatron_lite.core.transformer.transformer_config import TransformerConfig
from megatron_lite.core.utils import cp_positions

HIDDEN, HEADS, GROUPS, HEAD_DIM, LAYERS, FFN, VOCAB, SEQ = 64, 8, 2, 16, 3, 96, 256, 24


def _relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return ((ours - reference).abs().max() / reference.abs().max()).item()


def _tokens(batch: int = 3, seq: int = SEQ) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(7))


def _llama_config() -> TransformerConfig:
    return TransformerConfig(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_query_groups=GROUPS,
        kv_channels=HEAD_DIM,  # 16 * 8 = 128 != hidden: the query projection is not square
        ffn_hidden_size=FFN,
        normalization="RMSNorm",
        layernorm_epsilon=1e-6,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
    )


def _llama(rotary_base: int = 10000, pg_collection=None, **rope_scaling) -> GPTModel:
    return GPTModel(
        _llama_config(),
        VOCAB,
        SEQ,
        position_embedding_type="rope",
        rotary_base=rotary_base,
        share_embeddings_and_output_weights=False,
        pg_collection=pg_collection,
        **rope_scaling,
    ).eval()


def _llama_pair(rotary_base: int = 10000, rope_scaling_factor: float | None = None):
    """Ours and transformers' Llama with the same weights; Llama 3.x rope scaling by the factor if given."""
    scaled = rope_scaling_factor is not None
    ours = _llama(
        rotary_base, **(dict(rope_scaling=True, rope_scaling_factor=rope_scaling_factor) if scaled else {})
    )
    llama3 = {"rope_type": "llama3", "factor": rope_scaling_factor, "low_freq_factor": 1.0}
    llama3.update(high_freq_factor=4.0, original_max_position_embeddings=8192)
    reference = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            intermediate_size=FFN,
            num_hidden_layers=LAYERS,
            num_attention_heads=HEADS,
            num_key_value_heads=GROUPS,
            head_dim=HEAD_DIM,
            max_position_embeddings=SEQ,
            rms_norm_eps=1e-6,
            rope_theta=float(rotary_base),
            rope_scaling=llama3 if scaled else None,
            tie_word_embeddings=False,
            attention_bias=False,
            mlp_bias=False,
        )
    ).eval()
    per_group = HEADS // GROUPS
    with torch.no_grad():
        reference.model.embed_tokens.weight.copy_(ours.embedding.word_embeddings.weight)
        for mine, theirs in zip(ours.decoder.layers, reference.model.layers):
            # Our QKV rows are group-major: per group, its query heads, its key head, its value head.
            qkv = mine.self_attention.linear_qkv.weight.view(GROUPS, per_group + 2, HEAD_DIM, HIDDEN)
            theirs.self_attn.q_proj.weight.copy_(qkv[:, :per_group].reshape(-1, HIDDEN))
            theirs.self_attn.k_proj.weight.copy_(qkv[:, per_group].reshape(-1, HIDDEN))
            theirs.self_attn.v_proj.weight.copy_(qkv[:, per_group + 1].reshape(-1, HIDDEN))
            theirs.self_attn.o_proj.weight.copy_(mine.self_attention.linear_proj.weight)
            gate, up = mine.mlp.linear_fc1.weight.chunk(2, dim=0)
            theirs.mlp.gate_proj.weight.copy_(gate)
            theirs.mlp.up_proj.weight.copy_(up)
            theirs.mlp.down_proj.weight.copy_(mine.mlp.linear_fc2.weight)
            theirs.input_layernorm.weight.copy_(torch.rand(HIDDEN) + 0.5)
            theirs.post_attention_layernorm.weight.copy_(torch.rand(HIDDEN) + 0.5)
            mine.input_layernorm.weight.copy_(theirs.input_layernorm.weight)
            mine.pre_mlp_layernorm.weight.copy_(theirs.post_attention_layernorm.weight)
        reference.model.norm.weight.copy_(torch.rand(HIDDEN) + 0.5)
        ours.decoder.final_layernorm.weight.copy_(reference.model.norm.weight)
        reference.lm_head.weight.copy_(ours.output_layer.weight)
    return ours, reference


def test_llama_shaped_logits_match_transformers_llama():
    ours, reference = _llama_pair(rotary_base=500000)
    tokens = _tokens()
    positions = torch.arange(SEQ).expand_as(tokens)
    with torch.no_grad():
        mine = ours(tokens, positions).transpose(0, 1)  # [s, b, v] -> [b, s, v]
        theirs = reference(input_ids=tokens).logits
    assert mine.shape == theirs.shape
    assert _relative_error(mine, theirs) <= 1e-5


@pytest.mark.parametrize("factor", [8.0, 32.0])
def test_llama3_rope_scaling_logits_match_transformers(factor):
    """``--use-rope-scaling`` is transformers' ``llama3`` rope. Head dim 16 and base 500000 put
    wavelengths past 8192 (divided by the factor), between 2048 and 8192 (blended) and below 2048
    (kept), so every branch of the formula is compared; 256 positions (rotary angles need no table)
    turn the slowed channels far enough to move the logits well past the tolerance."""
    ours, reference = _llama_pair(rotary_base=500000, rope_scaling_factor=factor)
    unscaled, scaled = _llama(500000).rotary_pos_emb.inv_freq, ours.rotary_pos_emb.inv_freq
    assert (scaled < unscaled).sum() >= 2 and (scaled == unscaled).any()
    torch.testing.assert_close(scaled, reference.model.rotary_emb.inv_freq)
    tokens = _tokens(batch=1, seq=256)
    with torch.no_grad():
        mine = ours(tokens, None).transpose(0, 1)
        theirs = reference(input_ids=tokens).logits
        ours.rotary_pos_emb.inv_freq = unscaled
        without_scaling = ours(tokens, None).transpose(0, 1)
    assert _relative_error(mine, theirs) <= 1e-5
    # Unscaled frequencies miss by more than ten times that: the match above is not by chance.
    assert _relative_error(without_scaling, theirs) > 1e-4


def _split_logits_in_world(rank: int, world: int, split: str) -> float:
    """Relative error of this rank's logits, with the world as the TP or the CP group, against the
    same model (same seed: the init does not depend on the layout) in one process."""
    group = dist.new_group(list(range(world)))
    whole = _llama()
    split_model = _llama(pg_collection=ProcessGroupCollection(**{split: group}))
    tokens = _tokens(batch=2)
    with torch.no_grad():
        expected = whole(tokens, None)  # [s, b, v]
        if split == "tp":
            vocab = VOCAB // world
            return _relative_error(
                split_model(tokens, None), expected[..., rank * vocab : (rank + 1) * vocab]
            )
        positions = cp_positions(SEQ, rank, world)
        return _relative_error(split_model(tokens[:, positions], None), expected[positions])


@pytest.mark.world
@pytest.mark.parametrize("split", ["tp", "cp"])
def test_llama_shaped_logits_are_the_same_split_over_two_ranks(split):
    """Query groups split over TP ranks and rotary angles of each CP rank's global positions give
    every rank exactly the logits one process computes for its vocabulary slice or positions."""
    assert max(run_world(_split_logits_in_world, 2, split)) <= 1e-5


def test_llama_shaped_model_has_llama_parameters_only():
    ours, reference = _llama_pair()
    names = {name for name, _ in ours.named_parameters()}
    assert not any("bias" in name or "position_embeddings" in name for name in names), names
    # Same parameter count as the reference: no extra (or missing) weights hide in either.
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in reference.parameters())


@pytest.mark.parametrize("hf_activation,activation_func", [("gelu", F.gelu), ("gelu_new", openai_gelu)])
def test_gpt2_shaped_default_logits_match_transformers_gpt2(hf_activation, activation_func):
    """Megatron's default exact GELU, and --openai-gelu as GPT-2's own ``gelu_new``."""
    hidden, heads, layers = 64, 4, 2
    config = TransformerConfig(
        num_layers=layers, hidden_size=hidden, num_attention_heads=heads, activation_func=activation_func
    )
    ours = GPTModel(config, VOCAB, SEQ).eval()
    reference = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            vocab_size=VOCAB,
            n_positions=SEQ,
            n_embd=hidden,
            n_layer=layers,
            n_head=heads,
            n_inner=4 * hidden,
            activation_function=hf_activation,
            layer_norm_epsilon=1e-5,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
    ).eval()
    d = hidden // heads
    with torch.no_grad():
        emb = ours.embedding
        reference.transformer.wte.weight.copy_(emb.word_embeddings.weight)
        reference.transformer.wpe.weight.copy_(emb.position_embeddings.weight)
        for mine, theirs in zip(ours.decoder.layers, reference.transformer.h):
            for a, b in ((mine.input_layernorm, theirs.ln_1), (mine.pre_mlp_layernorm, theirs.ln_2)):
                b.weight.copy_(torch.rand(hidden) + 0.5)
                b.bias.copy_(torch.randn(hidden) * 0.1)
                a.weight.copy_(b.weight)
                a.bias.copy_(b.bias)
            qkv = mine.self_attention.linear_qkv
            qkv.bias.copy_(torch.randn_like(qkv.bias) * 0.1)
            # Ours [heads, 3, d] rows; GPT-2's Conv1D holds [in, out] with out = [q heads | k | v].
            weight = qkv.weight.view(heads, 3, d, hidden).permute(1, 0, 2, 3).reshape(3 * hidden, hidden)
            bias = qkv.bias.view(heads, 3, d).permute(1, 0, 2).reshape(-1)
            theirs.attn.c_attn.weight.copy_(weight.t())
            theirs.attn.c_attn.bias.copy_(bias)
            proj = mine.self_attention.linear_proj
            proj.bias.copy_(torch.randn_like(proj.bias) * 0.1)
            theirs.attn.c_proj.weight.copy_(proj.weight.t())
            theirs.attn.c_proj.bias.copy_(proj.bias)
            # fc1's bias puts the activation's inputs around +-1, where the exact and tanh GELU differ.
            mlp = ((mine.mlp.linear_fc1, theirs.mlp.c_fc, 1.0), (mine.mlp.linear_fc2, theirs.mlp.c_proj, 0.1))
            for a, b, scale in mlp:
                a.bias.copy_(torch.randn_like(a.bias) * scale)
                b.weight.copy_(a.weight.t())
                b.bias.copy_(a.bias)
        final = ours.decoder.final_layernorm
        final.weight.copy_(torch.rand(hidden) + 0.5)
        final.bias.copy_(torch.randn(hidden) * 0.1)
        reference.transformer.ln_f.weight.copy_(final.weight)
        reference.transformer.ln_f.bias.copy_(final.bias)
        assert reference.lm_head.weight.data_ptr() == reference.transformer.wte.weight.data_ptr()
        tokens = _tokens()
        mine = ours(tokens, torch.arange(SEQ).expand_as(tokens)).transpose(0, 1)
        theirs = reference(input_ids=tokens).logits
    assert _relative_error(mine, theirs) <= 1e-5


@pytest.mark.parametrize("rotary_percent", [1.0, 0.5])
def test_interleaved_rope_is_complex_rotation_of_adjacent_pairs(rotary_percent):
    """Interleaved RoPE (Meta's original Llama code) multiplies channel pairs (2i, 2i+1), as complex
    numbers, by exp(i * pos * base^(-2i / rot_dim)); channels past rot_dim are left alone."""
    seq, heads, d, base = 10, 3, 16, 10000
    config = TransformerConfig(
        num_layers=1, hidden_size=48, num_attention_heads=heads, rotary_interleaved=True
    )
    freqs = RotaryEmbedding(d, rotary_percent, rotary_interleaved=True, rotary_base=base)(seq)
    x = torch.randn(seq, 2, heads, d, dtype=torch.float64).float()
    rotated = apply_rotary_pos_emb(x, freqs, config)
    rot = int(d * rotary_percent)
    angle = torch.outer(torch.arange(seq, dtype=torch.float64), base ** (-torch.arange(0, rot, 2) / rot))
    pairs = torch.view_as_complex(x[..., :rot].double().reshape(seq, 2, heads, rot // 2, 2).contiguous())
    expected = torch.view_as_real(pairs * torch.polar(torch.ones_like(angle), angle)[:, None, None])
    torch.testing.assert_close(
        rotated[..., :rot].double(), expected.reshape(seq, 2, heads, rot), atol=1e-5, rtol=1e-5
    )
    torch.testing.assert_close(rotated[..., rot:], x[..., rot:])


@pytest.mark.parametrize("shape", ["gpt2", "llama", "qwen"])
def test_theoretical_parameter_count_is_the_model_s(shape):
    """The weight-and-optimizer prediction counts exactly the parameters the model builds."""
    from megatron_lite.models.gpt_provider import GPTModelProvider
    from megatron_lite.training.utils.theoretical_memory_utils import num_parameters_per_rank

    common = dict(num_layers=2, hidden_size=64, num_attention_heads=8, vocab_size=200, seq_length=SEQ)
    llama = dict(
        num_query_groups=2,
        kv_channels=16,
        ffn_hidden_size=96,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
    )
    extra = {
        "gpt2": {},
        "llama": {**llama, "add_bias_linear": False},
        "qwen": {**llama, "add_bias_linear": False, "add_qkv_bias": True},
    }
    provider = GPTModelProvider(**common, **extra[shape])
    model = GPTModel(
        provider,
        provider.padded_vocab_size,
        SEQ,
        position_embedding_type=provider.position_embedding_type,
        share_embeddings_and_output_weights=provider.share_embeddings_and_output_weights,
    )
    assert num_parameters_per_rank(provider, 0) == sum(p.numel() for p in model.parameters())
