"""Llama 3's published Hugging Face ``config.json`` values (meta-llama/Meta-Llama-3-8B and
meta-llama/Meta-Llama-3-70B), the architecture Megatron-Bridge's recipes read from the hub."""

_LLAMA3_COMMON = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "max_position_embeddings": 8192,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 128256,
}

META_LLAMA_3_8B = {
    **_LLAMA3_COMMON,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
}

META_LLAMA_3_70B = {
    **_LLAMA3_COMMON,
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_attention_heads": 64,
    "num_hidden_layers": 80,
}
