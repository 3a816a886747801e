"""AutoBridge's LoRA-adapter side (Megatron-Bridge's ``AutoBridge.export_adapter_weights`` and
``save_hf_adapter``): the adapters of a megatron_lite model as a Hugging Face PEFT adapter directory
(``adapter_config.json`` + ``adapter_model.safetensors``) that ``peft.PeftModel.from_pretrained``
loads onto the Hugging Face base model."""

from __future__ import annotations

import json
import os
import shutil

import torch.distributed as dist

from megatron_lite.bridge.models.conversion import peft_bridge
from megatron_lite.bridge.models.conversion.errors import raise_rank0_error
from megatron_lite.utils.atomic_io import replace_directory, write_error_line

ADAPTER_CONFIG_NAME = "adapter_config.json"
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"


def _rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _write_adapter_directory(path: str, adapter_config: dict, state: dict) -> None:
    """Both files into a directory beside ``path``, moved into place only once complete."""
    from safetensors.torch import save_file

    final = os.path.abspath(path)
    tmp = f"{os.path.dirname(final)}/.{os.path.basename(final)}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        os.makedirs(tmp)
        with open(os.path.join(tmp, ADAPTER_CONFIG_NAME), "w") as f:
            json.dump(adapter_config, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        save_file(state, os.path.join(tmp, ADAPTER_WEIGHTS_NAME), metadata={"format": "pt"})
        with open(os.path.join(tmp, ADAPTER_WEIGHTS_NAME), "rb") as f:
            os.fsync(f.fileno())
        replace_directory(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


class AdapterExport:
    """Mixed into AutoBridge (``_model_bridge`` and ``hf_pretrained`` are its)."""

    def export_adapter_weights(
        self, model, cpu: bool = True, show_progress: bool = True, exclude_adapter_base_prefixes=None,
        expand_shared_outer: bool = False,
    ):  # fmt: skip
        """(Hugging Face LoRA name, whole tensor) of every adapter, unmerged, on every rank: names as
        ``model.layers.0.self_attn.q_proj.lora_A.weight``; the layers under
        ``exclude_adapter_base_prefixes`` (megatron names) left out. Collective over TP and PP.
        ``expand_shared_outer`` (Bridge's) only concerns shared-outer expert adapters, which
        megatron_lite's LoRA refuses: it changes nothing here."""
        yield from self._model_bridge.stream_adapter_weights_megatron_to_hf(
            model, cpu=cpu, show_progress=show_progress,
            exclude_adapter_base_prefixes=exclude_adapter_base_prefixes, expand_shared_outer=expand_shared_outer,
        )  # fmt: skip

    def save_hf_adapter(
        self, model, path, peft_config, base_model_name_or_path=None, show_progress: bool = True,
        exclude_adapter_base_prefixes=None, expand_shared_outer: bool = False,
    ) -> None:  # fmt: skip
        """Write ``path`` as a Hugging Face PEFT adapter directory, atomically (a failed export leaves
        what was there). ``peft_config`` is the run's LoRA (``dim``, ``alpha``, ``dropout``);
        ``base_model_name_or_path`` defaults to this bridge's model directory. Collective: every rank
        streams, rank 0 writes; a failure is one BridgeError line on every rank."""
        weights = []  # every rank streams (collective); rank 0 keeps them to write
        for name, tensor in self.export_adapter_weights(
            model, True, show_progress, exclude_adapter_base_prefixes, expand_shared_outer
        ):
            if _rank0():
                weights.append((name, tensor.clone()))
        error = None
        if _rank0():
            if not weights:
                error = (
                    "the model holds no LoRA adapters: apply megatron_lite.peft.LoRA before save_hf_adapter"
                )
            else:
                if base_model_name_or_path is None:
                    base_model_name_or_path = str(
                        getattr(self.hf_pretrained, "model_name_or_path", "")
                        or getattr(self.hf_pretrained, "name_or_path", "")
                    )
                names = [name for name, _ in weights]
                adapter_config = peft_bridge.build_adapter_config_dict(
                    peft_config,
                    target_modules=peft_bridge.infer_target_modules_from_adapter_weights(names),
                    base_model_name_or_path=base_model_name_or_path,
                    fan_in_fan_out=getattr(self._model_bridge, "LORA_FAN_IN_FAN_OUT", False),
                    rank_pattern=peft_bridge.infer_rank_pattern_from_adapter_weights(
                        weights, default_rank=getattr(peft_config, "dim", 32)
                    ),
                )
                # PEFT's on-disk keys: the Hugging Face names under its wrapper's "base_model.model.".
                state = {f"base_model.model.{name}": tensor.contiguous() for name, tensor in weights}
                try:
                    _write_adapter_directory(os.fspath(path), adapter_config, state)
                except OSError as err:
                    error = f"{path}: cannot write the adapter ({write_error_line(err)})"
                except Exception as err:  # safetensors' own error for a failed write
                    reason = f"{type(err).__name__}: {err}".splitlines()[0]
                    error = f"{path}: writing the adapter failed ({reason})"
        raise_rank0_error(error)
