"""Accelerate's checkpoint point: `load_fsdp_model` (`Accelerator.load_state`) loads a FULL_STATE_DICT
file into a tensor-parallel model, and the load path is decided alike on every rank.

Which load path runs is never decided from each rank's own view of the filesystem (without a shared
one, node 0 may hold a file node 1 lacks, and ranks on different paths run collectives that do not
match): `agreed_full_checkpoint` takes rank 0's answer (the rank that reads FULL_STATE_DICT files).
The Trainer's resume and save are in `transformers/trainer_checkpoints.py`, which uses these."""

from __future__ import annotations

import functools
import logging
import os
import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..targets import is_tensor_parallel_qwen35, prepared_by_accelerate

logger = logging.getLogger(__name__)


def _full_checkpoint_path(fsdp_plugin: Any, input_dir: str, model_index: int = 0) -> str | None:
    """The `pytorch_model_fsdp[_i].bin` Accelerate writes for FULL_STATE_DICT, if that is the
    plugin's type (whether the file exists or not)."""
    from accelerate.utils.constants import FSDP_MODEL_NAME
    from torch.distributed.fsdp.fully_sharded_data_parallel import StateDictType

    if fsdp_plugin is None or fsdp_plugin.state_dict_type != StateDictType.FULL_STATE_DICT:
        return None
    name = f"{FSDP_MODEL_NAME}.bin" if model_index == 0 else f"{FSDP_MODEL_NAME}_{model_index}.bin"
    return os.path.join(input_dir, name)


def agreed_full_checkpoint(fsdp_plugin: Any, input_dir: str, model_index: int = 0) -> str | None:
    """The FULL_STATE_DICT model file to load, decided alike on every rank.

    Global rank 0 alone reads a FULL_STATE_DICT file (the others receive its tensors), so
    the decision is rank 0's, and it must not be each rank's own `os.path.isfile`: without
    a shared filesystem the file may exist on node 0 only, and ranks taking different load
    paths run collectives that do not match (a hang on NCCL). Every rank reports its state
    dict type and whether it sees the file (one `all_gather_object` over the default group;
    collective when distributed: call it on every rank). Returns the path when rank 0 holds
    it, None when the plugin's type is not FULL_STATE_DICT or no rank holds the file (then
    the caller's other path runs, on every rank). Raises ValueError on every rank when the
    ranks' state dict types differ, or when the file exists on other ranks but not on rank 0,
    naming the ranks and their hosts.
    """
    path = _full_checkpoint_path(fsdp_plugin, input_dir, model_index)
    mine = (str(getattr(fsdp_plugin, "state_dict_type", None)), path is not None and os.path.isfile(path), socket.gethostname())
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return path if mine[1] else None
    views: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(views, mine)
    if len({kind for kind, _, _ in views}) > 1:
        kinds = ", ".join(f"rank {r} ({host}): {kind}" for r, (kind, _, host) in enumerate(views))
        raise ValueError(
            f"loading the checkpoint in {input_dir}: the ranks' FSDP state_dict_type differ ({kinds}); every node must "
            "run the same configuration"
        )
    holders = [r for r, (_, has, _) in enumerate(views) if has]
    if path is None or not holders:
        return None
    if holders[0] != 0:
        where = ", ".join(f"{r} ({views[r][2]})" for r in holders)
        raise ValueError(
            f"{path}: a FULL_STATE_DICT checkpoint is read by global rank 0 (on {views[0][2]}) for every rank, and rank 0 "
            f"does not have this file; ranks {where} do. Put the checkpoint where node 0 can read it (the node of "
            "machine_rank 0; a shared filesystem, or copy it there)."
        )
    return path


def load_full_checkpoint_tensor_parallel(accelerator: Any, model: nn.Module, path: str) -> None:
    """Accelerate's FULL_STATE_DICT model loading for a tensor-parallel Qwen3.5 model.

    torch's `set_model_state_dict(full_state_dict=True)` copies the full tensors into the
    per-head slices (a shape error); here rank 0 reads the file, every tensor is broadcast
    and the model's load hooks keep each rank's slice. With SHARDED_STATE_DICT, Accelerate's
    own DCP loading already works: it goes through the model's and the optimizer's
    Transformers-layout state dicts, which slice on load.

    Rank 0 maps the file (`torch.load(mmap=True)`) instead of reading it whole: the other
    ranks wait in the first broadcast while rank 0 reads, and a whole large checkpoint can
    take longer than the process group's timeout (NCCL's default: 10 minutes); mapped, each
    tensor is read as it is broadcast, so no collective waits longer than one tensor's read.
    """
    from ...parallel.tensor_parallel import load_full_state_dict

    logger.info("Loading model from %s (tensor parallel)", path)
    # As Accelerate's load_fsdp_model does; its optimizer loading reads the same options.
    config = accelerator.state.fsdp_plugin.state_dict_config
    config.offload_to_cpu = config.rank0_only = accelerator.num_processes > 1
    state_dict = _map_checkpoint(path) if accelerator.is_main_process else None
    load_full_state_dict(model, state_dict)


def _map_checkpoint(path: str) -> dict[str, torch.Tensor]:
    """`torch.load` of a checkpoint file whose tensors are read from disk when first used."""
    try:
        return torch.load(path, weights_only=True, map_location="cpu", mmap=True)
    except RuntimeError as error:  # a file of torch's legacy (pre-zip) format cannot be mapped
        if "mmap" not in str(error):
            raise
        return torch.load(path, weights_only=True, map_location="cpu")


def load_fsdp_model(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(fsdp_plugin: Any, accelerator: Any, model: nn.Module, input_dir: str, model_index: int = 0,
                *args: Any, **kwargs: Any) -> Any:
        if prepared_by_accelerate(model):
            path = agreed_full_checkpoint(fsdp_plugin, input_dir, model_index)
            wanted = _full_checkpoint_path(fsdp_plugin, input_dir, model_index)
            if path is None and wanted is not None:
                # Accelerate's own loading would fail on rank 0 alone while the others wait for its tensors.
                raise FileNotFoundError(f"{wanted}: no such file on any rank (a FULL_STATE_DICT checkpoint, read by rank 0)")
            if path is not None and is_tensor_parallel_qwen35(model):
                return load_full_checkpoint_tensor_parallel(accelerator, model, path)
        return original(fsdp_plugin, accelerator, model, input_dir, model_index, *args, **kwargs)

    return wrapper
