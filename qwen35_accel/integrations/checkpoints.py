"""Checkpoint patch points: full-state-dict loading into a tensor-parallel model, for
`Accelerator.load_state` (`load_fsdp_model`) and the Trainer's resume
(`Trainer._load_from_checkpoint`), and `Trainer.save_model` with a sharded state dict type.

Which load path runs is decided alike on every rank, never from each rank's own view of
the filesystem (without a shared one, node 0 may hold a file node 1 lacks, and ranks on
different paths run collectives that do not match): `agreed_full_checkpoint` takes rank
0's answer (the rank that reads FULL_STATE_DICT files), `check_same_checkpoint_on_every_rank`
stops a Trainer resume on every rank when the nodes see different checkpoint files."""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import re
import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .targets import is_tensor_parallel_qwen35, prepared_by_accelerate

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


def _load_full_checkpoint_tensor_parallel(accelerator: Any, model: nn.Module, path: str) -> None:
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
    from ..parallel.tensor_parallel import load_full_state_dict

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
                return _load_full_checkpoint_tensor_parallel(accelerator, model, path)
        return original(fsdp_plugin, accelerator, model, input_dir, model_index, *args, **kwargs)

    return wrapper


def trainer_load_from_checkpoint(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(self: Any, resume_from_checkpoint: str, model: Any = None) -> Any:
        target = model if model is not None else self.model
        if prepared_by_accelerate(target):
            check_same_checkpoint_on_every_rank(resume_from_checkpoint)
            if is_tensor_parallel_qwen35(target):
                plugin = getattr(self.accelerator.state, "fsdp_plugin", None)
                path = agreed_full_checkpoint(plugin, resume_from_checkpoint)
                if path is not None:
                    return _load_full_checkpoint_tensor_parallel(self.accelerator, target, path)
        return original(self, resume_from_checkpoint, model)

    return wrapper


# Per-process RNG states, the Trainer's and Accelerate's: each rank reads its own, where it exists.
_PER_RANK_FILE = re.compile(r"rng_state(_\d+)?\.pth|random_states_\d+\.pkl")


def check_same_checkpoint_on_every_rank(directory: str) -> None:
    """Raise ValueError on every rank unless every rank sees the same files in `directory`.

    The Trainer's resume decides per rank, from the files it sees, what to load: the
    weights (`_load_from_checkpoint`), the optimizer and the scheduler
    (`_load_optimizer_and_scheduler` loads the optimizer only where its file exists, and
    that load is collective). Where a node lacks a file its ranks skip or fail a step the
    others run, and the collectives stop matching (a hang on NCCL). So the ranks compare
    their listings (top level and one level of subdirectories, the per-rank RNG states
    aside: each rank reads only its own, where it exists) before any of that: a digest, then
    the listings where the digests differ. Collective over the default group when
    distributed: call it on every rank.
    """
    listing = _listing(directory)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    # A digest first (a sharded checkpoint lists a file per rank); the listings only if they differ.
    digest = None if listing is None else hashlib.sha256("\0".join(sorted(listing)).encode()).hexdigest()
    digests: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(digests, digest)
    if len(set(digests)) == 1:
        return
    views: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(views, (listing, socket.gethostname()))
    (reference, host0), differ = views[0], []
    for rank, (names, host) in enumerate(views[1:], start=1):
        if names != reference:
            if names is None or reference is None:
                what = "has no such directory" if names is None else f"has it (rank 0 on {host0} does not)"
            else:
                lacks, extra = sorted(reference - names)[:6], sorted(names - reference)[:6]
                what = f"lacks {lacks}" + (f" and has {extra} that rank 0 lacks" if extra else "")
            differ.append(f"rank {rank} ({host}) {what}")
    if differ:
        raise ValueError(
            f"resuming from {directory}: the Trainer reads the checkpoint on every rank, and the ranks see different "
            f"files ({'; '.join(differ[:4])}; compared with rank 0 on {host0}). Resume from a directory every node reads "
            "alike (a shared filesystem), or copy the checkpoint to every node."
        )


def _listing(directory: str) -> frozenset[str] | None:
    """Relative paths under `directory` (files and one level of subdirectories), or None if it is no directory."""
    if not os.path.isdir(directory):
        return None
    names = set()
    for entry in os.scandir(directory):
        if _PER_RANK_FILE.fullmatch(entry.name):
            continue
        names.add(entry.name)
        if entry.is_dir():
            names.update(f"{entry.name}/{inner}" for inner in os.listdir(entry.path))
    return frozenset(names)


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
            and prepared_by_accelerate(self.model)
        ):
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            state_dict = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            self._save(output_dir or self.args.output_dir, state_dict=state_dict)
            return
        original(self, output_dir, _internal_call)

    return wrapper
