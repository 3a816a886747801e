"""The docstrings of config fields (the string right after a field's annotation, as the config
dataclasses write them): a flag's help text, written once, on its field."""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Each field of dataclass ``cls`` (its bases' too) that has a docstring: the docstring, on one line."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body
        for node, after in zip(body, body[1:]):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[node.target.id] = " ".join(after.value.value.split())
    return docs
