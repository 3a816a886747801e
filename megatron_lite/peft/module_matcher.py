"""Which modules a PEFT method adapts (Megatron-Bridge's ``ModuleMatcher``).

``target_modules``: a module matches when its own name equals an entry (``linear_qkv``) or its full
name matches an entry with ``*`` wildcards (``*.layers.0.*.linear_qkv``). With no targets,
``exclude_modules`` is used instead: every tensor-parallel / expert linear layer (and
``nn.Linear``) matches unless its name equals, or its full name wildcard-matches, an entry. Giving
both is an error, as in Bridge. ``canonical_mapping`` (pattern -> aliases) takes precedence, as
Bridge's ``CanonicalLoRA`` uses it.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass, field

from torch import nn

from megatron_lite.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron_lite.core.transformer.moe.experts import ExpertLinear
from megatron_lite.peft.utils import wildcard_match

logger = logging.getLogger(__name__)


@dataclass
class ModuleMatcher:
    """Module selection by ``target_modules`` (names or wildcard patterns) or, with no targets, by
    ``exclude_modules`` over every linear layer."""

    target_modules: list[str] = field(
        default_factory=lambda: ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
    )
    """Modules to adapt: a module's own name (``linear_qkv``) or a full-name pattern with ``*``
    wildcards (``*.layers.0.*.linear_qkv``)."""
    exclude_modules: list[str] = field(default_factory=list)
    """With ``target_modules`` empty: adapt every linear layer except these (names or patterns)."""
    canonical_mapping: dict[str, set] = field(default_factory=lambda: defaultdict(set))
    """Pattern -> user aliases (Bridge's, for CanonicalLoRA); takes precedence when non-empty."""

    _pattern_to_alias: dict[str, set[str]] = field(
        default_factory=lambda: defaultdict(set), init=False, repr=False
    )
    _alias_to_pattern: dict[str, str] = field(default_factory=dict, init=False, repr=False)
    _alias_matches: dict[str, set[str]] = field(
        default_factory=lambda: defaultdict(set), init=False, repr=False
    )

    def _init_target_match_state(self) -> None:
        """Rebuild the alias bookkeeping from the current ``target_modules`` (recipes often change
        them after construction)."""
        self._pattern_to_alias.clear()
        self._alias_to_pattern.clear()
        self._alias_matches.clear()
        for target in self.target_modules or []:
            self.register_target_alias(target, target)

    def match(
        self, m: nn.Module, name: str | None = None, prefix: str | None = None
    ) -> tuple[str, str] | None:
        """``(matching pattern, full name)`` when module ``m`` (named ``name`` under ``prefix``) is
        selected, else None."""
        full_name = f"{prefix}.{name}" if prefix else name
        patterns = None
        if len(self.canonical_mapping or []) > 0:
            patterns = self.canonical_mapping
        elif len(self.target_modules or []) > 0:
            patterns = self.target_modules
        if patterns is not None:
            # Bridge's assertion (LoRA.validate refuses the combination first, in one line).
            which = "canonical_mapping" if patterns is self.canonical_mapping else "target_modules"
            if len(self.exclude_modules or []) > 0:
                raise AssertionError(f"exclude_modules should be empty when using {which}")
            for pattern in patterns:
                if name == pattern or wildcard_match(pattern, full_name):
                    self._record_match(pattern, full_name)
                    return pattern, full_name
            return None
        excluded = name in self.exclude_modules or any(
            wildcard_match(p, full_name) for p in self.exclude_modules
        )
        # Looked up at call time, as Bridge does (its tests patch these names).
        linear_types = (ColumnParallelLinear, RowParallelLinear, ExpertLinear, nn.Linear)
        if not excluded and isinstance(m, linear_types):
            self._record_match(name, full_name)
            return name, full_name
        return None

    def register_target_alias(self, alias: str, pattern: str) -> None:
        """Record that user entry ``alias`` is matched through ``pattern``."""
        if alias is None or pattern is None:
            return
        previous = self._alias_to_pattern.get(alias)
        if previous:
            self._pattern_to_alias[previous].discard(alias)
        self._alias_to_pattern[alias] = pattern
        self._pattern_to_alias[pattern].add(alias)
        self._alias_matches.setdefault(alias, set())

    def _record_match(self, pattern: str, full_name: str | None) -> None:
        for alias in self._pattern_to_alias.get(pattern, ()):
            self._alias_matches.setdefault(alias, set()).add(full_name or alias)

    def _reset_target_match_state(self) -> None:
        for alias in self._alias_matches:
            self._alias_matches[alias].clear()

    def _validate_target_matches(self) -> None:
        """Warn (as Bridge, not fail) about target entries that matched no module."""
        if not self._alias_to_pattern:
            return
        unmatched = sorted(a for a, matches in self._alias_matches.items() if not matches)
        if unmatched:
            logger.warning(
                "No modules matched the requested target_modules entries: %s", ", ".join(unmatched)
            )
