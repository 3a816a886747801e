"""Model providers (Megatron-Bridge style): configs that build models."""
