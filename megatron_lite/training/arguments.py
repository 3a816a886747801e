"""Upstream's path (``megatron.training.arguments``) to the command line, which lives in training/cli/:
the flag tables, their ranges, the parser and the flags' mapping onto a validated ConfigContainer."""

from megatron_lite.training.cli.parser import build_parser, config_from_args, config_from_argv, parse_args

__all__ = ["build_parser", "config_from_args", "config_from_argv", "parse_args"]
