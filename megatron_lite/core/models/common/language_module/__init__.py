"""Base class of the language models: the loss over a vocabulary split across tensor-parallel ranks."""
