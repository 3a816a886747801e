"""ConfigError: bad user input, as one line that names the flag (or field) and the fix.

Upstream's config checks raise ``AssertionError`` (its ``assert`` statements) or ``ValueError``, and
code ported from upstream catches those. A ConfigError is both, so ``pytest.raises(AssertionError)``,
``except ValueError`` and pretrain.py's one-line ``pretrain.py: error: ...`` all see the same error.
Unlike a bare ``assert`` it survives ``python -O``. It lives here, below the config package, because
the parts the config builds while validating (the tokenizers) raise it too.
"""

from __future__ import annotations


class ConfigError(ValueError, AssertionError):
    """Bad user input. ``str(err)`` is the one line shown to the user: the flag and the fix."""

    def __init__(self, flag: str, message: str):
        super().__init__(f"{flag}: {message}")
        self.flag = flag


class ConfigTypeError(ConfigError, TypeError):
    """Bad user input of the wrong type, where upstream raises TypeError."""


class MissingPackageError(ConfigError, ModuleNotFoundError):
    """A logger is configured whose package is not installed (upstream raises ModuleNotFoundError)."""


class UnexpectedFieldError(ConfigError, TypeError):
    """A field given that this config refuses, worded as Python's unexpected-keyword TypeError."""


def require(condition: object, flag: str, message: str) -> None:
    """``assert condition, message`` that raises a ConfigError naming ``flag`` instead."""
    if not condition:
        raise ConfigError(flag, message)
