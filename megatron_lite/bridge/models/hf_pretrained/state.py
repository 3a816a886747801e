"""Megatron-Bridge's state accessors over a model's tensors: ``StateDict`` (a mapping queried by name,
list, glob or regex) over a ``StateSource`` (an in-memory dict, or a directory's safetensors files read
one tensor at a time). ``SafeTensorsStateSource.save_generator`` writes a stream of tensors back in the
source's own file layout. Local directories only; the format holds no code.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_lite.bridge.models.hf_pretrained.safe_config_loader import local_model_dir
from megatron_lite.bridge.models.hf_pretrained.safe_tensors import INDEX, SINGLE, ShardedWriter, _opened

_GLOB = re.compile(r"[*?\[]")


class StateSource(ABC, Mapping):
    """Where tensors come from: all their names, and a few of them loaded on request."""

    @abstractmethod
    def get_all_keys(self) -> list[str]: ...

    @abstractmethod
    def load_tensors(self, keys: list[str]) -> dict[str, torch.Tensor]: ...

    def __getitem__(self, key: str) -> torch.Tensor:
        tensors = self.load_tensors([key])
        if key not in tensors:
            raise KeyError(f"Key not found in source: {key}")
        return tensors[key]

    def __iter__(self):
        return iter(self.get_all_keys())

    def __len__(self) -> int:
        return len(self.get_all_keys())

    def has_glob(self, pattern: str) -> bool:
        return any(fnmatch.fnmatch(key, pattern) for key in self.get_all_keys())


class DictStateSource(StateSource):
    """Tensors already in memory (a loaded model's ``state_dict()``)."""

    def __init__(self, state_dict: dict[str, torch.Tensor]):
        self._dict = state_dict

    def get_all_keys(self) -> list[str]:
        return sorted(self._dict)

    def load_tensors(self, keys: list[str]) -> dict[str, torch.Tensor]:
        return {key: self._dict[key] for key in keys if key in self._dict}


class StateDict(Mapping):
    """``state["name"]`` one tensor; ``state[[...]]``, ``state["*.bias"]``, ``state[re.compile(...)]``
    a dict of them; ``state()`` all of them. Only what is asked for is read."""

    def __init__(self, source):
        if isinstance(source, dict):
            source = DictStateSource(source)
        if not isinstance(source, StateSource):
            raise TypeError(f"StateDict source must be a dict or a StateSource, got {type(source)}")
        self.source = source

    def _match_keys(self, pattern) -> list[str]:
        keys = self.source.get_all_keys()
        if isinstance(pattern, re.Pattern):
            return [k for k in keys if pattern.search(k)]
        if _GLOB.search(pattern):
            return [k for k in keys if fnmatch.fnmatch(k, pattern)]
        return [pattern] if pattern in keys else []

    def __getitem__(self, key):
        if isinstance(key, re.Pattern) or (isinstance(key, str) and _GLOB.search(key)):
            matched = self._match_keys(key)
            if not matched:
                what = f"regex pattern: {key.pattern}" if isinstance(key, re.Pattern) else f"pattern: {key}"
                raise KeyError(f"No keys match {what}")
            return self.source.load_tensors(matched)
        if isinstance(key, str):
            if key not in self.source.get_all_keys():
                raise KeyError(f"Key not found: {key}")
            return self.source.load_tensors([key])[key]
        if isinstance(key, list):
            known = set(self.source.get_all_keys())
            missing = [k for k in key if k not in known]
            if missing:
                raise KeyError(f"Keys not found: {missing}")
            return self.source.load_tensors(key)
        raise TypeError(f"Key must be str, list of str, or compiled regex, got {type(key)}")

    def __call__(self) -> dict[str, torch.Tensor]:
        return self.source.load_tensors(self.source.get_all_keys())

    def keys(self) -> list[str]:
        return self.source.get_all_keys()

    def __contains__(self, key) -> bool:
        return key in self.source.get_all_keys()

    def get(self, key: str, default=None):
        return self.source.load_tensors([key])[key] if key in self else default

    def __iter__(self):
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self.keys())

    def has_glob(self, pattern: str) -> bool:
        return self.source.has_glob(pattern)

    def __repr__(self) -> str:
        try:
            return f"<StateDict with {len(self)} entries>"
        except Exception:  # a source that cannot be read still prints
            return "<StateDict (not accessible)>"


class SafeTensorsStateSource(StateSource):
    """The tensors of a local model directory: ``model.safetensors.index.json``'s files, or every
    ``*.safetensors`` file in it. Each read opens the tensor's file for that read only."""

    def __init__(self, path: str | os.PathLike):
        self.model_name_or_path = path
        self._key_to_filename_map_cache: dict[str, str] | None = None

    @property
    def path(self) -> Path:
        return local_model_dir(self.model_name_or_path)

    @property
    def key_to_filename_map(self) -> dict[str, str]:
        """tensor name -> file name (relative to ``path``)."""
        if self._key_to_filename_map_cache is None:
            index = self.path / INDEX
            if index.exists():
                with open(index) as f:
                    weight_map = json.load(f).get("weight_map") or {}
                for name, file in weight_map.items():
                    if not isinstance(file, str) or os.path.isabs(file) or ".." in Path(file).parts:
                        raise ValueError(
                            f"{index}: {name} names the file {file!r} outside the model directory"
                        )
            else:
                weight_map = {}
                for file in sorted(self.path.glob("*.safetensors")):
                    weight_map.update(dict.fromkeys(_opened(str(file), lambda f: list(f.keys())), file.name))
            self._key_to_filename_map_cache = weight_map
        return self._key_to_filename_map_cache

    def get_all_keys(self) -> list[str]:
        keys = sorted(self.key_to_filename_map)
        if not keys:
            raise FileNotFoundError(f"No .safetensors files or index found in {self.model_name_or_path}")
        return keys

    def load_tensors(self, keys_to_load: list[str]) -> dict[str, torch.Tensor]:
        by_file: dict[str, list[str]] = {}
        missing = set()
        for key in keys_to_load:
            file = self.key_to_filename_map.get(key)
            if file is None:
                missing.add(key)
            else:
                by_file.setdefault(file, []).append(key)
        if missing:
            raise KeyError(f"Keys not found in safetensors from {self.model_name_or_path}: {missing}")
        loaded = {}
        for file, keys in by_file.items():
            loaded.update(
                _opened(str(self.path / file), lambda f, keys=keys: {k: f.get_tensor(k) for k in keys})
            )
        return loaded

    def has_glob(self, pattern: str) -> bool:
        return any(fnmatch.fnmatch(key, pattern) for key in self.key_to_filename_map)

    def save_generator(
        self,
        generator: Iterable[tuple[str, torch.Tensor]],
        output_path: str | os.PathLike,
        strict: bool = True,
        distributed_save: bool = False,
        save_every_n_ranks: int = 1,
        ignored_source_key_prefixes: Iterable[str] | None = None,
    ) -> None:
        """Write the tensors of ``generator`` as safetensors files in the source's layout (each file
        once all its tensors arrived; the index when the source has one). Every rank must consume the
        generator (its tensors may come from collectives); rank 0 writes. ``strict``: a tensor the
        source does not hold, or one it holds that never came, is an error; else a warning.
        ``distributed_save`` is refused: one writer here."""
        if distributed_save:
            raise ValueError("save_generator(distributed_save=True) is not supported by megatron_lite")
        if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
            for _ in generator:
                pass
            return
        output = Path(output_path)
        output.mkdir(parents=True, exist_ok=True)
        prefixes = tuple(ignored_source_key_prefixes or ())
        layout = {
            k: f for k, f in self.key_to_filename_map.items() if not (prefixes and k.startswith(prefixes))
        }
        if not layout:  # no source layout to follow: one file, or shards of the writer's size
            writer = ShardedWriter(str(output), 5 * 1024**3)
            for name, tensor in generator:
                writer.add(name, tensor)
            writer.close()
            return
        pending = {}
        for key, file in layout.items():
            pending.setdefault(file, set()).add(key)
        buffered, written, total = {}, {}, 0
        for name, tensor in generator:
            if name not in layout:
                if strict:
                    raise KeyError(
                        f"Tensor '{name}' from generator not found in the original model structure. "
                        "Re-run with strict=False to save the partial checkpoint instead of failing."
                    )
                print(
                    f"Warning: tensor '{name}' from generator not found in original model structure. Skipping."
                )
                continue
            file = layout[name]
            buffered.setdefault(file, {})[name] = tensor
            pending.get(file, set()).discard(name)
            if file in pending and not pending[file]:
                total += _write_file(output, file, buffered.pop(file), written)
                del pending[file]
        if pending and strict:
            unsaved = sorted(k for keys in pending.values() for k in keys)
            raise RuntimeError(
                f"{len(unsaved)} tensors from the original checkpoint were not written (first: {unsaved[0]}). "
                "Re-run with strict=False to save the partial checkpoint instead of failing."
            )
        for file in pending:  # strict=False: the files as far as they came
            if buffered.get(file):
                total += _write_file(output, file, buffered.pop(file), written)
        if (self.path / INDEX).exists() and written:
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(written.items()))}
            with open(output / INDEX, "w") as f:
                json.dump(index, f, indent=4)


def _write_file(output: Path, file: str, tensors: dict[str, torch.Tensor], written: dict) -> int:
    """One safetensors file of ``tensors``; records them in ``written``; returns their bytes."""
    from safetensors.torch import save_file

    target = output / file
    target.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: t.detach().cpu().contiguous() for k, t in tensors.items()}, str(target))
    written.update(dict.fromkeys(tensors, file))
    return sum(t.numel() * t.element_size() for t in tensors.values())


__all__ = ["StateDict", "StateSource", "DictStateSource", "SafeTensorsStateSource", "SINGLE", "INDEX"]
