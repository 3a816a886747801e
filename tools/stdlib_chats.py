#!/usr/bin/env python
"""Write a JSONL of chat conversations for SFT (``--sft``) made from the Python standard library, with
nothing to download: one conversation per documented public function or method (a system line, the user
asking what ``module.function(args)`` does, the assistant answering with its docstring), read with
``ast`` (nothing is imported or run), in sorted file order.

    python tools/stdlib_chats.py --output data/chats.jsonl [--examples 2000]
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys
import sysconfig

SYSTEM = "You document the Python standard library."


def _public_functions(tree: ast.Module):
    """``(qualified name, node)`` of a module's public functions and its public classes' public methods."""
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
            yield node.name, node
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and not item.name.startswith("_"):
                    yield f"{node.name}.{item.name}", item


def write_conversations(path: str, limit: int) -> int:
    """One conversation per documented public function and method of the standard library, in sorted
    file order."""
    root = sysconfig.get_paths()["stdlib"]
    count = 0
    with open(path + ".tmp", "w", encoding="utf-8") as out:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(
                d for d in dirnames if d not in ("site-packages", "test", "tests", "idlelib")
            )
            for name in sorted(n for n in filenames if n.endswith(".py")):
                module = os.path.relpath(os.path.join(dirpath, name), root)[:-3].replace(os.sep, ".")
                try:
                    with open(os.path.join(dirpath, name), encoding="utf-8") as f:
                        tree = ast.parse(f.read())
                except (SyntaxError, UnicodeDecodeError, ValueError):
                    continue
                for qualname, node in _public_functions(tree):
                    doc = ast.get_docstring(node)
                    if not doc or len(doc) < 20:
                        continue
                    args = ", ".join(a.arg for a in node.args.args if a.arg != "self")
                    turns = [
                        {"role": "system", "content": SYSTEM},
                        {"role": "user", "content": f"What does {module}.{qualname}({args}) do?"},
                        {"role": "assistant", "content": doc},
                    ]
                    out.write(json.dumps({"messages": turns}) + "\n")
                    count += 1
                    if count == limit:
                        break
                if count == limit:
                    break
            if count == limit:
                break
    os.replace(path + ".tmp", path)
    return count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", required=True, help="JSONL file to write (Megatron-LM's messages).")
    parser.add_argument("--examples", type=int, default=2000, help="Conversations to write (at most).")
    args = parser.parse_args(argv)
    if args.examples < 1:
        parser.error(f"--examples must be >= 1, not {args.examples}")
    count = write_conversations(args.output, args.examples)
    print(f"wrote {count} conversations to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
