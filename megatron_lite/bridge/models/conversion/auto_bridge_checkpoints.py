"""AutoBridge's megatron-checkpoint side (Megatron-Bridge's ``AutoBridge`` methods of the same names):
a bridge from a checkpoint's recorded model, the model of a checkpoint, and the import / export of
whole checkpoints outside a run (a one-rank gloo world unless one is running)."""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import Self

import torch.distributed as dist

from megatron_lite.bridge.models.conversion.errors import BridgeError
from megatron_lite.bridge.models.hf_pretrained.architectures import _drop_readonly_config_properties
from megatron_lite.bridge.models.hf_pretrained.safe_config_loader import REMOTE_CODE_REFUSED
from megatron_lite.training.checkpointing.layout import TRACKER


class MegatronCheckpoints:
    """Mixed into AutoBridge (``from_hf_pretrained``, ``from_hf_config``, ``to_megatron_model`` and
    ``save_hf_pretrained`` are its)."""

    @classmethod
    def from_auto_config(cls, megatron_path, hf_model_id, trust_remote_code: bool = False) -> Self:
        """A config-only bridge whose Hugging Face config is the megatron checkpoint's model (its
        ``run_config.yaml``, in the root or the latest ``iter_*``) written in ``hf_model_id``'s keys."""
        from megatron_lite.bridge.models.conversion import utils as conversion_utils
        from megatron_lite.training import model_load_save

        checkpoint = Path(megatron_path)
        if not checkpoint.exists():
            raise FileNotFoundError(f"Megatron checkpoint not found: {checkpoint}")
        run_config = checkpoint / "run_config.yaml"
        if not run_config.exists():
            iters = [d for d in checkpoint.iterdir() if d.is_dir() and d.name.startswith("iter_")]
            if iters:
                run_config = (
                    max(iters, key=lambda d: int(d.name[5:]) if d.name[5:].isdigit() else -1)
                    / "run_config.yaml"
                )
        if not run_config.exists() and (checkpoint / TRACKER).exists():
            run_config = checkpoint / TRACKER  # megatron_lite's own: the checkpoint records its model
        if not run_config.exists():
            raise FileNotFoundError(
                f"Could not find run_config.yaml in {checkpoint}. Ensure this is a valid Megatron checkpoint."
            )
        megatron_cfg, _ = model_load_save.load_model_config(str(run_config.parent))
        if trust_remote_code:
            raise BridgeError(f"from_auto_config: {REMOTE_CODE_REFUSED}")
        import transformers

        hf_cfg = transformers.AutoConfig.from_pretrained(hf_model_id, trust_remote_code=False)
        values = cls.from_hf_config(hf_cfg)._model_bridge.megatron_to_hf_config(megatron_cfg)
        values = conversion_utils.conform_config_to_reference(values, hf_cfg.to_dict())
        synthesized = type(hf_cfg)(**_drop_readonly_config_properties(values, type(hf_cfg)))
        synthesized.name_or_path = hf_model_id
        bridge = cls.from_hf_config(synthesized)
        bridge.hf_model_id = hf_model_id
        bridge.trust_remote_code = trust_remote_code
        return bridge

    @staticmethod
    def get_hf_model_id_from_checkpoint(path) -> str | None:
        """The Hugging Face model a megatron checkpoint was imported from, where it recorded one."""
        from megatron_lite.training.utils import checkpoint_utils

        return checkpoint_utils.get_hf_model_id_from_checkpoint(path)

    # ---- megatron checkpoints ----
    def save_megatron_model(
        self, model, path, hf_tokenizer_path=None, low_memory_save=False, hf_tokenizer_kwargs=None
    ):
        try:
            from megatron_lite.training.model_load_save import save_megatron_model
        except ImportError:
            raise ImportError("megatron_lite.training is not available.") from None
        save_megatron_model(
            model, path, hf_tokenizer_path=hf_tokenizer_path, low_memory_save=low_memory_save,
            hf_tokenizer_kwargs=hf_tokenizer_kwargs,
        )  # fmt: skip

    def load_megatron_model(self, path, *, mp_overrides=None, **kwargs) -> list:
        """The model of a megatron checkpoint directory (its latest ``iter_*`` when it has several)."""
        try:
            from megatron_lite.training.model_load_save import load_megatron_model
        except ImportError:
            raise ImportError("megatron_lite.training is not available.") from None
        checkpoint = Path(path)
        iters = [d for d in checkpoint.iterdir() if d.is_dir() and d.name.startswith("iter_")]
        if iters:
            checkpoint = max(iters, key=lambda d: int(d.name[5:]) if d.name[5:].isdigit() else -1)
        in_world = dist.is_initialized()
        model = load_megatron_model(
            str(checkpoint), use_cpu_init=in_world and dist.get_backend() == "gloo",
            skip_temp_dist_context=in_world, mp_overrides=mp_overrides,
        )  # fmt: skip
        return model if isinstance(model, list) else [model]

    @classmethod
    def import_ckpt(cls, hf_model_id, megatron_path, *, low_memory_save: bool = False, **kwargs) -> None:
        """Hugging Face directory -> megatron checkpoint, in a one-process gloo world unless one runs."""
        from megatron_lite.training.model_load_save import temporary_distributed_context

        bridge = cls.from_hf_pretrained(hf_model_id, **kwargs)
        with nullcontext() if dist.is_initialized() else temporary_distributed_context(backend="gloo"):
            model = bridge.to_megatron_model(wrap_with_ddp=False, use_cpu_initialization=True)
            model_bridge_instance = bridge._model_bridge
            tokenizer_kwargs = None
            if hasattr(model_bridge_instance, "get_hf_tokenizer_kwargs"):
                tokenizer_kwargs = model_bridge_instance.get_hf_tokenizer_kwargs()
            tokenizer_kwargs = {} if tokenizer_kwargs is None else tokenizer_kwargs
            if kwargs.get("revision") is not None:
                tokenizer_kwargs.setdefault("revision", kwargs["revision"])
            bridge.save_megatron_model(
                model, megatron_path, hf_tokenizer_path=hf_model_id, hf_tokenizer_kwargs=tokenizer_kwargs,
                low_memory_save=low_memory_save,
            )  # fmt: skip

    def export_ckpt(
        self, megatron_path, hf_path, show_progress: bool = True, strict: bool = False, source_path=None
    ):
        """Megatron checkpoint -> Hugging Face directory, in a one-process gloo world unless one runs."""
        from megatron_lite.training.model_load_save import temporary_distributed_context

        with nullcontext() if dist.is_initialized() else temporary_distributed_context(backend="gloo"):
            model = self.load_megatron_model(megatron_path, wrap_with_ddp=False)
            self.save_hf_pretrained(
                model, hf_path, show_progress=show_progress, source_path=source_path, strict=strict
            )
