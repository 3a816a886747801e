"""Tiny Hugging Face models of each family the bridge takes, made by ``transformers`` from configs
(nothing downloaded) and saved as model directories, and their logits beside ours."""

from __future__ import annotations

import torch
import torch.distributed as dist
import transformers  # the dev extra's independent implementation

from megatron_lite.bridge import AutoBridge

SEQ, VOCAB = 24, 250  # 250: not a multiple of the TP-padded vocabulary, so padding rows are exercised
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4)
_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
_GPT2 = dict(
    vocab_size=VOCAB,
    n_positions=SEQ,
    n_embd=64,
    n_layer=4,
    n_head=4,
    resid_pdrop=0.0,
    embd_pdrop=0.0,
    attn_pdrop=0.0,
)
CONFIGS = {
    # GQA, untied, Llama 3.1's rope scaling (a small original context so that it changes the angles)
    "llama": lambda: transformers.LlamaConfig(
        **_COMMON, num_attention_heads=8, num_key_value_heads=2, head_dim=16, max_position_embeddings=SEQ,
        rope_theta=500000.0, rope_scaling={**_LLAMA3, "original_max_position_embeddings": 8192},
        tie_word_embeddings=False,
    ),
    "qwen2": lambda: transformers.Qwen2Config(  # query-key-value bias, tied
        **_COMMON, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
        tie_word_embeddings=True,
    ),
    "mistral": lambda: transformers.MistralConfig(
        **_COMMON, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ, sliding_window=None
    ),
    "gpt2": lambda: transformers.GPT2Config(**_GPT2),
    "gpt2_untied": lambda: transformers.GPT2Config(**_GPT2, tie_word_embeddings=False),  # its own lm_head
}  # fmt: skip


def save_family(family: str, path) -> transformers.PreTrainedModel:
    """A random model of ``family`` (biases and norms randomised too) saved under ``path``."""
    torch.manual_seed(len(family))
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[family]()).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(path)
    return model


def tokens(batch: int = 2) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, SEQ), generator=torch.Generator().manual_seed(3))


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return ((ours - reference).abs().max() / reference.abs().max()).item()


def reference_logits(path) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        return model(input_ids=tokens()).logits


def pipeline_logits(chunk, pp_group, tp_group) -> torch.Tensor | None:
    """Logits [b, s, vocab] of one model chunk per stage, the activations passed stage to stage;
    on the last stage, gathered over the TP ranks. Collective over both groups."""
    ids = tokens()
    positions = torch.arange(SEQ).expand_as(ids)
    rank, size = dist.get_rank(pp_group), dist.get_world_size(pp_group)
    with torch.no_grad():
        if rank > 0:
            received = torch.empty(SEQ, ids.shape[0], chunk.config.hidden_size)
            dist.recv(received, dist.get_global_rank(pp_group, rank - 1), group=pp_group)
            chunk.set_input_tensor(received)
        out = chunk(ids, positions)
        if rank < size - 1:
            dist.send(out.contiguous(), dist.get_global_rank(pp_group, rank + 1), group=pp_group)
            return None
        parts = [torch.empty_like(out) for _ in range(dist.get_world_size(tp_group))]
        dist.all_gather(parts, out.contiguous(), group=tp_group)
    return torch.cat(parts, dim=-1).transpose(0, 1)[..., :VOCAB]


def import_model(path):
    """This rank's stage of the model in ``path``, its weights loaded by the bridge."""
    from megatron_lite.core import parallel_state

    provider = AutoBridge.from_hf_pretrained(path).to_megatron_provider()
    provider.tensor_model_parallel_size = parallel_state.get_tensor_model_parallel_world_size()
    provider.pipeline_model_parallel_size = parallel_state.get_pipeline_model_parallel_world_size()
    provider.seq_length = SEQ
    return provider.provide().eval()
