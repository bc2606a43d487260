"""Checkpoint patch points: full-state-dict loading into a tensor-parallel model, for
`Accelerator.load_state` (`load_fsdp_model`) and the Trainer's resume
(`Trainer._load_from_checkpoint`), and `Trainer.save_model` with a sharded state dict type."""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .targets import is_tensor_parallel_qwen35

logger = logging.getLogger(__name__)

def _full_checkpoint_file(fsdp_plugin: Any, input_dir: str, model_index: int = 0) -> str | None:
    """The `pytorch_model_fsdp[_i].bin` Accelerate writes for FULL_STATE_DICT, if that is
    the plugin's type and `input_dir` holds it."""
    from accelerate.utils.constants import FSDP_MODEL_NAME
    from torch.distributed.fsdp.fully_sharded_data_parallel import StateDictType

    if fsdp_plugin is None or fsdp_plugin.state_dict_type != StateDictType.FULL_STATE_DICT:
        return None
    name = f"{FSDP_MODEL_NAME}.bin" if model_index == 0 else f"{FSDP_MODEL_NAME}_{model_index}.bin"
    path = os.path.join(input_dir, name)
    return path if os.path.isfile(path) else None


def _load_full_checkpoint_tensor_parallel(accelerator: Any, model: nn.Module, path: str) -> None:
    """Accelerate's FULL_STATE_DICT model loading for a tensor-parallel Qwen3.5 model.

    torch's `set_model_state_dict(full_state_dict=True)` copies the full tensors into the
    per-head slices (a shape error); here rank 0 reads the file, every tensor is broadcast
    and the model's load hooks keep each rank's slice. With SHARDED_STATE_DICT, Accelerate's
    own DCP loading already works: it goes through the model's and the optimizer's
    Transformers-layout state dicts, which slice on load.
    """
    from ..parallel.tensor_parallel import load_full_state_dict

    logger.info("Loading model from %s (tensor parallel)", path)
    # As Accelerate's load_fsdp_model does; its optimizer loading reads the same options.
    config = accelerator.state.fsdp_plugin.state_dict_config
    config.offload_to_cpu = config.rank0_only = accelerator.num_processes > 1
    state_dict = torch.load(path, weights_only=True, map_location="cpu") if accelerator.is_main_process else None
    load_full_state_dict(model, state_dict)


def load_fsdp_model(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(fsdp_plugin: Any, accelerator: Any, model: nn.Module, input_dir: str, model_index: int = 0,
                *args: Any, **kwargs: Any) -> Any:
        if is_tensor_parallel_qwen35(model):
            path = _full_checkpoint_file(fsdp_plugin, input_dir, model_index)
            if path is not None:
                return _load_full_checkpoint_tensor_parallel(accelerator, model, path)
        return original(fsdp_plugin, accelerator, model, input_dir, model_index, *args, **kwargs)

    return wrapper


def trainer_load_from_checkpoint(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(self: Any, resume_from_checkpoint: str, model: Any = None) -> Any:
        target = model if model is not None else self.model
        if is_tensor_parallel_qwen35(target):
            plugin = getattr(self.accelerator.state, "fsdp_plugin", None)
            path = _full_checkpoint_file(plugin, resume_from_checkpoint)
            if path is not None:
                return _load_full_checkpoint_tensor_parallel(self.accelerator, target, path)
        return original(self, resume_from_checkpoint, model)

    return wrapper


def trainer_save_model(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(self: Any, output_dir: str | None = None, _internal_call: bool = False) -> None:
        accelerator = getattr(self, "accelerator", None)
        plugin = getattr(getattr(accelerator, "state", None), "fsdp_plugin", None)
        if (
            not _internal_call  # periodic checkpoints stay DCP-sharded (resume reads them)
            and plugin is not None
            and getattr(accelerator, "is_fsdp2", False)
            and "FULL_STATE_DICT" not in str(plugin.state_dict_type)
            and getattr(self.model, "_qwen35_accel_prepared", False)
        ):
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            state_dict = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            self._save(output_dir or self.args.output_dir, state_dict=state_dict)
            return
        original(self, output_dir, _internal_call)

    return wrapper
