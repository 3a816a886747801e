"""Mixtral and Qwen2-MoE in and out of megatron_lite (Megatron-Bridge's MixtralBridge and Qwen2-MoE
mappings): with the same weights, a tiny ``transformers`` model and ours give the same logits, with
grouped and with sequential experts, and export gives back every Hugging Face tensor bitwise."""

from __future__ import annotations

import pytest
import torch
import transformers
from bridge_helpers import SEQ, VOCAB, pipeline_logits, reference_logits
from dist_helpers import run_world
from safetensors.torch import load_file

from megatron_lite.bridge import AutoBridge, BridgeError

pytestmark = pytest.mark.world  # every test here starts processes

_COMMON = dict(
    vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
    tie_word_embeddings=False,
)  # fmt: skip
_QWEN2_MOE = dict(
    **_COMMON, intermediate_size=48, moe_intermediate_size=16, shared_expert_intermediate_size=24, num_experts=4,
    num_experts_per_tok=2,
)  # fmt: skip
CONFIGS = {
    "mixtral": lambda: transformers.MixtralConfig(
        **_COMMON, intermediate_size=16, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2
    ),
    # norm_topk_prob False (the top-k of the softmax over all experts); layer 2 dense (mlp_only_layers)
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(**_QWEN2_MOE, num_hidden_layers=4, mlp_only_layers=[2]),
    # norm_topk_prob True (renormalised); every other layer dense (decoder_sparse_step)
    "qwen2_moe_step2": lambda: transformers.Qwen2MoeConfig(
        **_QWEN2_MOE, num_hidden_layers=4, decoder_sparse_step=2, norm_topk_prob=True
    ),
}
MOE_LAYERS = {"mixtral": 1, "qwen2_moe": [1, 1, 0, 1], "qwen2_moe_step2": [0, 1, 0, 1]}


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_moe")
    for i, (family, config) in enumerate(CONFIGS.items()):
        torch.manual_seed(i)
        model = transformers.AutoModelForCausalLM.from_config(config()).eval()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        model.save_pretrained(root / family)
    return {family: str(root / family) for family in CONFIGS}


def _compare(rank, world, dirs, layouts=(True, False), tp=1, ep=1):
    """Per family and expert layout (grouped or sequential): (max |logits difference|, max |reference
    logits|, the Hugging Face tensors the export does not give back bitwise, or its refusal, the
    provider's moe_layer_freq)."""
    from megatron_lite.core import parallel_state

    parallel_state.initialize_model_parallel(tp, 1, expert_model_parallel_size=ep)
    tp_group = parallel_state.get_tensor_model_parallel_group()
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    results = {}
    for family, path in dirs.items():
        reference, saved = reference_logits(path), load_file(f"{path}/model.safetensors")
        for grouped in layouts:
            bridge = AutoBridge.from_hf_pretrained(path)
            provider = bridge.to_megatron_provider()
            provider.tensor_model_parallel_size, provider.expert_model_parallel_size = tp, ep
            provider.seq_length = SEQ
            provider.moe_grouped_gemm = grouped
            chunk = provider.provide().eval()
            logits = pipeline_logits(chunk, pp_group, tp_group)
            try:
                exported = dict(bridge.export_hf_weights([chunk]))
                differ = sorted(set(saved) ^ set(exported))
                differ += [n for n in saved if n in exported and not torch.equal(saved[n], exported[n])]
            except BridgeError as err:
                differ = str(err)
            difference = (logits - reference).abs().max().item()
            results[family, grouped] = (
                difference,
                reference.abs().max().item(),
                differ,
                provider.moe_layer_freq,
            )
    return results


def test_logits_equal_transformers_and_export_is_bitwise(hf_dirs):
    [results] = run_world(_compare, 1, hf_dirs)
    assert set(results) == {(family, grouped) for family in CONFIGS for grouped in (True, False)}
    for (family, grouped), (difference, scale, differ, freq) in results.items():
        assert freq == MOE_LAYERS[family], (family, freq)
        assert scale > 0.1 and difference <= 1e-5, (family, grouped, difference, scale)
        assert differ == [], (family, grouped, differ[:5])


def test_tp2_splits_experts_and_shared_expert_and_exports_them_whole(hf_dirs):
    """At TP 2 (expert TP 2) each rank reads its rows or columns of every expert and of the shared
    expert; the export gathers them back whole."""
    dirs = {family: hf_dirs[family] for family in ("mixtral", "qwen2_moe")}
    for results in run_world(_compare, 2, dirs, (True,), 2, 1):
        assert {family for family, _ in results} == set(dirs)
        for (family, grouped), (difference, _, differ, _) in results.items():
            assert difference <= 1e-5 and differ == [], (family, grouped, difference, differ[:5])


def test_ep2_each_rank_reads_its_own_experts_by_global_index_and_export_is_refused(hf_dirs):
    """At EP 2 rank r holds experts 2r and 2r + 1 as its local 0 and 1; gathering experts back over
    EP is not done: the export is refused, in one line, on every rank."""
    for results in run_world(_compare, 2, {"qwen2_moe": hf_dirs["qwen2_moe"]}, (True, False), 1, 2):
        for (family, grouped), (difference, _, refusal, _) in results.items():
            assert difference <= 1e-5, (family, grouped, difference)
            assert "expert_model_parallel_size > 1 is not supported" in refusal and "\n" not in refusal
