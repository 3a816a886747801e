"""Modules shared by models."""
