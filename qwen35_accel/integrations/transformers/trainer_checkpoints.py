"""The Trainer's checkpoint points: its resume (`Trainer._load_from_checkpoint`: a FULL_STATE_DICT file
into a tensor-parallel model, after `check_same_checkpoint_on_every_rank` has stopped a resume on every
rank when the nodes see different checkpoint files) and `Trainer.save_model` with a sharded state dict
type (a Hugging Face checkpoint from the gathered weights)."""

from __future__ import annotations

import functools
import hashlib
import os
import re
import socket
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from ..accelerate.fsdp_checkpoints import agreed_full_checkpoint, load_full_checkpoint_tensor_parallel
from ..targets import is_tensor_parallel_qwen35, prepared_by_accelerate


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
                    return load_full_checkpoint_tensor_parallel(self.accelerator, target, path)
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
