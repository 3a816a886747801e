"""LoRA out to Hugging Face: tiny models (made by ``transformers`` from configs, nothing downloaded)
imported into megatron_lite, LoRA applied with random adapters (B non-zero), then exported. The merged
export loads in ``transformers`` with our merged model's logits, the adapter export
(``adapter_config.json`` + ``adapter_model.safetensors``) loads with ``peft`` onto the Hugging Face
base with our LoRA model's logits, each within 1e-5: a Llama at tp 2 and at pp 2, a Mixtral (grouped
experts, one adapter shared by them) at tp 2, in one 2-rank gloo world. So does a LoRA model's plain
export, which folds the adapters in as the weights stream out (Bridge's ``merge_adapter_weights``).
A Hugging Face directory as ``--pretrained-checkpoint`` loads into a LoRA-wrapped model at ep 2, and
a LoRA run's checkpoint exports through tools/checkpoint_conversion.py both ways."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from bridge_helpers import VOCAB, pipeline_logits, relative_error, tokens
from corpus_helpers import _tool
from dist_helpers import REPO, ok, run_pretrain, run_script, run_world
from safetensors.torch import load_file

CONVERT = REPO / "tools" / "checkpoint_conversion.py"
CASES = (("llama", 2, 1), ("llama", 1, 2), ("mixtral", 2, 1))  # (model, tp, pp)
DIM, ALPHA = 8, 16
_SHAPE = dict(vocab_size=VOCAB, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=32, tie_word_embeddings=False)  # fmt: skip
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**_SHAPE, hidden_size=64, intermediate_size=96),
    "mixtral": lambda: transformers.MixtralConfig(
        **_SHAPE, hidden_size=32, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2
    ),
}
TARGETS = {
    "llama": ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"],
    "mixtral": ["k_proj", "o_proj", "q_proj", "v_proj", "w1", "w2", "w3"],
}


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """Random tiny models (grouped-query attention, untied) saved as Hugging Face directories."""
    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    for name, config in CONFIGS.items():
        transformers.AutoModelForCausalLM.from_config(config()).save_pretrained(root / name)
    return {name: str(root / name) for name in CONFIGS}


@pytest.fixture(scope="module")
def hf_dir(hf_dirs):
    return hf_dirs["llama"]


def _lora_model(hf_dir: str):
    """This rank's stage of the model with LoRA on the four linears (the experts' too: grouped, one
    adapter for all of them), adapters drawn at random."""
    from megatron_lite.bridge import AutoBridge
    from megatron_lite.core import parallel_state
    from megatron_lite.peft import LoRA

    provider = AutoBridge.from_hf_pretrained(hf_dir).to_megatron_provider()
    provider.tensor_model_parallel_size = parallel_state.get_tensor_model_parallel_world_size()
    provider.pipeline_model_parallel_size = parallel_state.get_pipeline_model_parallel_world_size()
    provider.seq_length = 32
    provider.moe_grouped_gemm = bool(provider.num_moe_experts)
    lora = LoRA(dim=DIM, alpha=ALPHA)
    [chunk] = lora([provider.provide()], training=True)
    chunk.eval()
    torch.manual_seed(5)  # every rank the same draws: replicated adapter weights agree
    with torch.no_grad():
        for name, param in chunk.named_parameters():
            if ".adapter." in name:
                param.copy_(torch.randn_like(param) * 0.2)
    return chunk, lora


def _export_all(rank, world, hf_dirs, out_root):
    from megatron_lite.bridge import AutoBridge
    from megatron_lite.core import parallel_state
    from megatron_lite.peft.lora_merge import merge_lora_model

    results = {}
    for model, tp, pp in CASES:
        parallel_state.initialize_model_parallel(tp, pp)
        groups = (
            parallel_state.get_pipeline_model_parallel_group(),
            parallel_state.get_tensor_model_parallel_group(),
        )
        chunk, lora = _lora_model(hf_dirs[model])
        lora_logits = pipeline_logits(chunk, *groups)
        bridge = AutoBridge.from_hf_pretrained(hf_dirs[model])
        out = f"{out_root}/{model}_tp{tp}pp{pp}"
        bridge.save_hf_adapter([chunk], f"{out}/adapter", lora, show_progress=False)
        bridge.save_hf_pretrained([chunk], f"{out}/merged_on_export", show_progress=False)
        [merged] = merge_lora_model([chunk])
        merged_logits = pipeline_logits(merged, *groups)
        bridge.save_hf_pretrained([merged], f"{out}/merged", show_progress=False)
        if lora_logits is not None and rank == world - 1:
            results[(model, tp, pp)] = (lora_logits, merged_logits)
        parallel_state.destroy_model_parallel()
    results["ep2"] = _hf_directory_at_ep2(hf_dirs["mixtral"])
    return results


def _hf_directory_at_ep2(hf_dir: str):
    """--pretrained-checkpoint's load of a Hugging Face directory (what pretrain.py registers): the
    Mixtral's weights into a LoRA-wrapped model (B zero: the base's logits) at expert parallel size 2,
    each rank reading its own experts."""
    from megatron_lite.bridge import AutoBridge
    from megatron_lite.core import parallel_state
    from megatron_lite.peft import LoRA
    from megatron_lite.training.checkpointing.hf_directory import is_hf_directory, load_hf_directory

    assert is_hf_directory(hf_dir)
    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=2)
    provider = AutoBridge.from_hf_pretrained(hf_dir).to_megatron_provider(load_weights=False)
    provider.expert_model_parallel_size, provider.seq_length = 2, 32
    chunks = LoRA(dim=DIM, alpha=ALPHA)([provider.provide()], training=True)
    load_hf_directory(hf_dir, chunks, provider)
    chunks[0].eval()
    logits = pipeline_logits(
        chunks[0],
        parallel_state.get_pipeline_model_parallel_group(),
        parallel_state.get_tensor_model_parallel_group(),
    )
    parallel_state.destroy_model_parallel()
    return logits


def _logits(path, adapter=None) -> torch.Tensor:
    from peft import PeftModel

    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    model = (PeftModel.from_pretrained(model, adapter) if adapter else model).eval()
    with torch.no_grad():
        return model(input_ids=tokens()).logits


@pytest.mark.world
def test_merged_export_loads_in_transformers_and_adapter_export_in_peft(hf_dirs, tmp_path):
    [_, results] = run_world(_export_all, 2, hf_dirs, str(tmp_path))
    assert relative_error(results.pop("ep2"), _logits(hf_dirs["mixtral"])) <= 1e-5
    assert set(results) == set(CASES)
    for (model, tp, pp), (lora_logits, merged_logits) in results.items():
        case, out = (model, tp, pp), tmp_path / f"{model}_tp{tp}pp{pp}"
        # The adapters change the model: the comparisons below are not of the base with itself.
        assert relative_error(lora_logits, _logits(hf_dirs[model])) > 1e-2, case
        assert relative_error(_logits(out / "merged"), merged_logits) <= 1e-5, case
        assert relative_error(_logits(out / "merged_on_export"), lora_logits) <= 1e-5, case
        assert relative_error(_logits(hf_dirs[model], out / "adapter"), lora_logits) <= 1e-5, case
        adapter_config = json.loads((out / "adapter" / "adapter_config.json").read_text())
        assert adapter_config["peft_type"] == "LORA"
        assert (adapter_config["r"], adapter_config["lora_alpha"]) == (DIM, ALPHA)
        assert adapter_config["base_model_name_or_path"] == hf_dirs[model]
        assert adapter_config["target_modules"] == TARGETS[model]
    keys = load_file(tmp_path / "llama_tp2pp1" / "adapter" / "adapter_model.safetensors")
    assert "base_model.model.model.layers.1.self_attn.k_proj.lora_B.weight" in keys
    assert len(keys) == 2 * 7 * 2  # A and B of seven projections in two layers
    keys = load_file(tmp_path / "mixtral_tp2pp1" / "adapter" / "adapter_model.safetensors")
    assert "base_model.model.model.layers.0.block_sparse_moe.experts.3.w3.lora_A.weight" in keys
    assert len(keys) == 2 * (4 + 4 * 3) * 2  # attention's four, each expert's three, in two layers


def _export(*args, cwd):
    return ok(run_script(CONVERT, ["export", *args, "--quiet"], cwd))


@pytest.mark.world
def test_a_lora_runs_checkpoint_exports_merged_and_as_a_peft_adapter(hf_dir, tmp_path, capsys):
    """pretrain.py fine-tunes the Hugging Face directory with LoRA at tp 2 (torch_dist); the tool
    exports its adapters-only checkpoint with the base it names, merged and as a PEFT adapter, which
    give the same logits in transformers and peft; bad input is one line before any worker. A torch
    format checkpoint saved at pp 2 exports its trained adapters, the second stage's too."""
    from peft import PeftModel

    ok(run_pretrain([
        "--pretrained-checkpoint", hf_dir, "--use-checkpoint-args", "--peft", "lora", "--lora-dim", str(DIM),
        "--lora-alpha", str(ALPHA), "--tensor-model-parallel-size", "2", "--mock-data", "--seq-length", "32",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "2", "--lr", "1e-2",
        "--min-lr", "1e-3", "--save", "lora", "--save-interval", "2", "--ckpt-format", "torch_dist",
    ], tmp_path))  # fmt: skip
    convert = _tool("checkpoint_conversion")
    common = ["--hf-model", hf_dir, "--megatron-path", str(tmp_path / "lora")]
    missing = str(tmp_path / "missing")
    assert convert.main(["export", *common, "--hf-path", "x", "--base-checkpoint", missing]) == 2
    err = capsys.readouterr().err
    assert f"--base-checkpoint {missing}: holds neither" in err and len(err.strip().splitlines()) == 1, err
    _export(*common, "--hf-path", "merged", cwd=tmp_path)
    _export(*common, "--hf-path", "adapter", "--adapter-only", cwd=tmp_path)
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    base = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    fresh = transformers.AutoModelForCausalLM.from_pretrained(hf_dir)
    adapted = PeftModel.from_pretrained(fresh, tmp_path / "adapter").eval()
    with torch.no_grad():
        base_logits, merged_logits = base(input_ids=tokens()).logits, merged(input_ids=tokens()).logits
        assert relative_error(merged_logits, base_logits) > 1e-4  # the trained adapters are in
        assert relative_error(adapted(input_ids=tokens()).logits, merged_logits) <= 1e-5
    # The torch format, saved at pp 2: each stage's shard holds its layers' adapters.
    ok(run_pretrain([
        "--pretrained-checkpoint", hf_dir, "--use-checkpoint-args", "--peft", "lora", "--lora-dim", str(DIM),
        "--pipeline-model-parallel-size", "2", "--mock-data", "--seq-length", "32", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--train-iters", "1", "--lr", "1e-2", "--save", "lora_pp2",
    ], tmp_path))  # fmt: skip
    _export("--hf-model", hf_dir, "--megatron-path", "lora_pp2", "--hf-path", "adapter_pp2", "--adapter-only",
            cwd=tmp_path)  # fmt: skip
    keys = load_file(tmp_path / "adapter_pp2" / "adapter_model.safetensors")
    # B starts at zero: every one trained (and read back) on either stage is non-zero.
    assert len(keys) == 2 * 7 * 2 and all(t.abs().max() > 0 for n, t in keys.items() if "lora_B" in n)


def test_a_hugging_face_directory_is_told_from_a_checkpoint(hf_dir, tmp_path):
    from megatron_lite.training.checkpointing.hf_directory import is_hf_directory

    assert is_hf_directory(hf_dir)
    assert not is_hf_directory(str(tmp_path))  # no config.json
    (tmp_path / "config.json").write_text("{}")
    assert not is_hf_directory(str(tmp_path))  # no weights
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert is_hf_directory(str(tmp_path))
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("0\n")
    assert not is_hf_directory(str(tmp_path))  # a megatron_lite checkpoint beside them


def test_use_checkpoint_args_takes_the_model_from_config_json(hf_dir):
    import megatron_lite.bridge  # noqa: F401  (registers the directory's reader, as pretrain.py does)
    from megatron_lite.training.arguments import parse_args

    config = parse_args([
        "--pretrained-checkpoint", hf_dir, "--use-checkpoint-args", "--mock-data", "--seq-length", "32",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3", "--min-lr", "1e-4",
    ])  # fmt: skip
    m = config.model
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.num_query_groups) == (2, 64, 4, 2)
    assert (m.ffn_hidden_size, m.vocab_size, m.normalization, m.gated_linear_unit) == (
        96,
        VOCAB,
        "RMSNorm",
        True,
    )
    assert not m.share_embeddings_and_output_weights and not m.add_bias_linear


def test_the_base_a_lora_checkpoint_names_is_checked_before_any_worker(hf_dir, tmp_path):
    """An imported checkpoint (iteration 0) or a Hugging Face directory is a base; anything else is
    one line naming the flag that fixes it."""
    from megatron_lite.bridge import BridgeError
    from megatron_lite.bridge.models.conversion.peft_checkpoints import base_of

    imported = tmp_path / "imported"
    imported.mkdir()
    (imported / "latest_checkpointed_iteration.txt").write_text("0\n")
    assert base_of("ckpt", {"pretrained_checkpoint": str(imported)}, None) == str(imported)
    assert base_of("ckpt", {"pretrained_checkpoint": str(imported)}, hf_dir) == hf_dir
    with pytest.raises(BridgeError, match="names the base .*; give the base as --base-checkpoint"):
        base_of("ckpt", {"pretrained_checkpoint": str(tmp_path / "moved")}, None)
    with pytest.raises(BridgeError, match="no base; give it as --base-checkpoint"):
        base_of("ckpt", {}, None)
