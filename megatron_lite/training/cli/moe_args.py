"""The mixture-of-experts flags a table row cannot map (config.flags has their rows): 0 experts, the
--moe-layer-freq expression, upstream's lists of one value and a negative capacity factor, as
upstream's validate_args maps them. Whether the result is a run megatron_lite can do is
config/validate/moe.py's check."""

from __future__ import annotations

import argparse
import ast

from megatron_lite.training.errors import ConfigError

# Longest pattern the expression may build: bounds "[1]*10000000000" before it is built.
_MAX_PATTERN_LENGTH = 100_000


def moe_from_args(args: argparse.Namespace, m) -> None:
    """The MoE fields the table copied from the flags, finished as upstream's validate_args does."""
    if args.num_experts == 0:
        m.num_moe_experts = None  # upstream: 0 experts is a dense model
    if args.moe_layer_freq is not None:
        m.moe_layer_freq = parse_moe_layer_freq(args.moe_layer_freq)
    for name in ("moe_router_load_balancing_type", "moe_aux_loss_coeff"):
        value = getattr(m, name)
        if isinstance(value, list) and len(value) == 1:
            setattr(m, name, value[0])  # upstream: a list of one is that value (more: validate refuses)
    capacity = m.moe_expert_capacity_factor
    if capacity is not None and capacity < 0:
        m.moe_expert_capacity_factor = None  # upstream: a negative factor means no capacity limit
    if m.num_moe_experts is not None and m.moe_ffn_hidden_size is None:
        m.moe_ffn_hidden_size = m.ffn_hidden_size  # upstream's default


def parse_moe_layer_freq(text: str) -> int | list[int]:
    """--moe-layer-freq: an integer, or a list expression of 0/1 literals joined by ``+``, repeated
    by ``*`` an integer literal, in parentheses: ``"([1]*3+[0]*1)*3"``. Upstream evals the text; this
    walks its syntax tree, so nothing else can run."""
    try:
        return int(text)
    except ValueError:
        pass
    flag = "--moe-layer-freq"
    try:
        pattern = _evaluate(ast.parse(text.strip(), mode="eval").body)
    except _TooLong:
        raise ConfigError(flag, f"{text!r} gives more than {_MAX_PATTERN_LENGTH} layers") from None
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        pattern = None
    if not isinstance(pattern, list):
        raise ConfigError(
            flag,
            f"{text!r} is not an integer or a list of 0/1 such as '([1]*3+[0]*1)*3' (literals, + and *)",
        )
    return pattern


def _evaluate(node: ast.expr) -> list[int] | int:
    """A list of 0/1 or an integer literal, from the few nodes the pattern syntax allows."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.List):
        items = [_evaluate(item) for item in node.elts]
        if any(isinstance(item, list) or item not in (0, 1) for item in items):
            raise ValueError("list items must be 0 or 1")
        return items
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Add) and isinstance(left, list) and isinstance(right, list):
            return _bounded(left, len(left) + len(right)) + right
        if isinstance(node.op, ast.Mult) and isinstance(left, list) != isinstance(right, list):
            pattern, times = (left, right) if isinstance(left, list) else (right, left)
            return _bounded(pattern, len(pattern) * times) * times  # measured before it is built
    raise ValueError("not a 0/1 list expression")


class _TooLong(ValueError):
    pass


def _bounded(pattern: list[int], length: int) -> list[int]:
    if length > _MAX_PATTERN_LENGTH:
        raise _TooLong
    return pattern
