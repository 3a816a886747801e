"""Embeddings."""
