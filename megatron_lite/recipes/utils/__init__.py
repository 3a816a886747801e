"""Helpers the recipes share (``optimizer_utils``: optimizer and schedule pairs)."""
