"""The checkpoint's `A_log` / `dt_bias` for gates that were loaded in a lower precision.

`from_pretrained(..., dtype=torch.bfloat16)` (or `dtype="auto"` on a bf16 config) rounds
every parameter while loading, the GatedDeltaNet gates included, before `install_fp32_gate`
can move them into their fp32 holders. The gates are tiny ([num_v_heads] per layer), so
the holders take them back from the checkpoint the model was loaded from: its safetensors
files (`model.safetensors` or a sharded `model.safetensors.index.json`), in a local
directory or in the Hugging Face cache (read offline, never downloaded). Checkpoint keys
map to the model's names as Transformers maps them when loading (its conversion mapping:
a `Qwen3_5ForCausalLM` loads `model.language_model.layers.N…` keys of a VLM checkpoint).

A gate is restored only when the checkpoint holds it in another dtype than the one it
arrived in and the model's value is exactly the checkpoint's value rounded to that dtype
(the model still holds what it loaded). Otherwise one warning says what was not restored,
the rounding it keeps, and how to load in fp32.

Each rank decides alone, from the files it sees, and that is safe without a shared
filesystem: nothing here communicates, and no collective depends on the outcome (the count
restored feeds rank 0's note only). The files are `name_or_path`'s, which the rank's own
`from_pretrained` read on its own node, so every rank that loaded them finds them again (a
model without such files warns on every rank alike); ranks whose weights are on the meta
device (`fsdp_cpu_ram_efficient_loading`) list nothing here and receive rank 0's restored
values by broadcast later.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

logger = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
GATE_SUFFIXES = (".A_log", ".dt_bias")
_STORED_ROUNDED = "stored rounded"
_warned: set[str] = set()


@dataclass
class _Gate:
    """One gate parameter to restore: its state-dict key in the loaded model, the
    parameter (fp32 holder storage by now) and the dtype it was loaded in."""

    key: str
    param: nn.Parameter
    arrived: torch.dtype


def restore_checkpoint_gates(model: nn.Module, arrived: Mapping[nn.Module, Mapping[str, torch.dtype]]) -> int:
    """Overwrite gates that arrived rounded with the checkpoint's values, bitwise.

    `model`: the module `install_fp32_gate` converted (a PEFT wrapper around the
    Transformers model is fine). `arrived`: for each converted GatedDeltaNet, the gate
    parameters (`"A_log"`, `"dt_bias"`) that were loaded in a dtype other than fp32, with
    that dtype; their holders already store them in fp32 (upcast, exact). Parameters on
    the meta device must not be listed (their values come later, from another rank).
    Returns the number of gate parameters restored; logs one line when it restored some,
    warns once per distinct problem when some stay rounded.
    """
    from transformers import PreTrainedModel

    root = next((m for m in model.modules() if isinstance(m, PreTrainedModel)), model)  # the outermost
    names = {module: name for name, module in root.named_modules()}
    gates = [
        _Gate(f"{names[module]}.{param_name}", getattr(module, param_name), dtype)
        for module, params in arrived.items()
        for param_name, dtype in params.items()
        if module in names
    ]
    if not gates:
        return 0
    source = getattr(root, "name_or_path", "") or getattr(getattr(root, "config", None), "_name_or_path", "")
    if not source:
        _warn_rounded(gates, "the model does not record where it was loaded from (its `name_or_path` is empty: built from a config?)")
        return 0
    checkpoint = _checkpoint_gate_keys(str(source), getattr(root.config, "_commit_hash", None))
    if checkpoint is None:
        _warn_rounded(
            gates,
            f"no safetensors checkpoint was found for {source!r} ({SINGLE_FILE} or {INDEX_FILE} in that directory, "
            "or in the Hugging Face cache, looked up offline)",
        )
        return 0
    located = _locate(root, checkpoint, [gate.key for gate in gates])
    restored, lower, problems = 0, 0, []
    with contextlib.ExitStack() as stack:
        opened: dict[str, Any] = {}
        for gate in gates:
            if gate.key not in located:
                problems.append((gate, f"the checkpoint ({source}) has no tensor that loads into `{gate.key}`"))
                continue
            checkpoint_key, path = located[gate.key]
            if path not in opened:
                opened[path] = stack.enter_context(safe_open(path, framework="pt", device="cpu"))
            problem = _restore(gate, opened[path], checkpoint_key, path)
            if problem is None:
                restored += 1
            elif problem == _STORED_ROUNDED:
                lower += 1
            else:
                problems.append((gate, problem))
    if restored:
        logger.info(
            "qwen35_accel: restored %d GatedDeltaNet gate parameters (A_log/dt_bias) loaded in %s to the checkpoint's values from %s",
            restored,
            gates[0].arrived,
            source,
        )
    if lower:
        logger.debug("qwen35_accel: %d gate parameters are stored in %s in the checkpoint itself; nothing to restore", lower, gates[0].arrived)
    if problems:
        _warn_rounded([gate for gate, _ in problems], problems[0][1])
    return restored


def _restore(gate: _Gate, checkpoint: Any, key: str, path: str) -> str | None:
    """Copy checkpoint tensor `key` into `gate.param`; None when done, else why not
    (`_STORED_ROUNDED`: the checkpoint holds the dtype the gate arrived in)."""
    if _SAFETENSORS_DTYPES.get(checkpoint.get_slice(key).get_dtype()) == gate.arrived:
        return _STORED_ROUNDED
    value = checkpoint.get_tensor(key)
    if tuple(value.shape) != tuple(gate.param.shape):
        return f"`{key}` in {path} has shape {list(value.shape)}, the model's is {list(gate.param.shape)}"
    if not torch.equal(value.to(gate.arrived).to(torch.float32), gate.param.detach().cpu()):
        return f"`{key}` in {path}, rounded to {gate.arrived}, is not the model's value (changed after loading?)"
    with torch.no_grad():
        gate.param.copy_(value.to(torch.float32))
    return None


def _checkpoint_gate_keys(source: str, revision: str | None) -> dict[str, str] | None:
    """{checkpoint key: local file} for every gate tensor (`….A_log`, `….dt_bias`) of
    `source`'s safetensors checkpoint, or None when its files are not found locally."""
    if os.path.isdir(source):
        resolve = lambda name: os.path.join(source, name) if os.path.isfile(os.path.join(source, name)) else None  # noqa: E731
    else:
        resolve = lambda name: _cached(source, name, revision)  # noqa: E731
    index = resolve(INDEX_FILE)
    if index is not None:
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        gates = {key: shard for key, shard in weight_map.items() if key.endswith(GATE_SUFFIXES)}
        paths = {shard: resolve(shard) for shard in set(gates.values())}  # only the shards holding gates
        if any(path is None for path in paths.values()):
            return None
        return {key: paths[shard] for key, shard in gates.items()}  # type: ignore[misc]
    single = resolve(SINGLE_FILE)
    if single is None:
        return None
    with safe_open(single, framework="pt", device="cpu") as f:
        return {key: single for key in f.keys() if key.endswith(GATE_SUFFIXES)}


def _cached(repo_id: str, filename: str, revision: str | None) -> str | None:
    """`filename` of hub repo `repo_id` from the local Hugging Face cache, or None (no network)."""
    from huggingface_hub import try_to_load_from_cache

    try:
        path = try_to_load_from_cache(repo_id, filename, revision=revision)
    except ValueError:  # not a repo id (HFValidationError), e.g. a path that does not exist
        return None
    return path if isinstance(path, str) else None


def _locate(root: nn.Module, checkpoint: Mapping[str, str], keys: list[str]) -> dict[str, tuple[str, str]]:
    """{model key: (checkpoint key, file)} for `keys`, renaming the checkpoint's gate keys
    ({key: file}) the way Transformers' `from_pretrained` does for `root`."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    transforms = get_model_conversion_mapping(root)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    wanted = dict.fromkeys(keys, True)  # what `rename_source_key` consults for base-model prefixes
    prefix = getattr(root, "base_model_prefix", None) or None
    located: dict[str, tuple[str, str]] = {}
    for checkpoint_key, path in checkpoint.items():
        renamed, _ = rename_source_key(checkpoint_key, renamings, converters, prefix, wanted)
        if renamed not in wanted and checkpoint_key in wanted:  # as Transformers: the key was right as it was
            renamed = checkpoint_key
        if renamed in wanted:
            located[renamed] = (checkpoint_key, path)
    return located


def _warn_rounded(gates: list[_Gate], reason: str) -> None:
    dtype = gates[0].arrived
    short = str(dtype).removeprefix("torch.")
    bound = torch.finfo(dtype).eps / 2  # round to nearest: half a unit in the last place
    message = (
        f"qwen35_accel: {len(gates)} GatedDeltaNet gate parameters (A_log/dt_bias) hold {dtype} values "
        f"(from_pretrained(..., dtype={dtype}), or dtype=\"auto\" on a {short} config, rounds them while loading) "
        f"and the checkpoint's values cannot be restored: {reason}. The fp32 gate holders keep the rounded values "
        f"(relative error up to 2^{int(math.log2(bound))} = {bound:.1e} each), which set every token's per-head decay. "
        f"To train from the checkpoint's fp32 values, load with from_pretrained(..., dtype=torch.float32) and let "
        f"FSDP2's mixed precision compute in bf16 (Accelerate's `mixed_precision: bf16`, or `mp_policy` in "
        f"PARALLELIZER.apply); a model built from a config: create it in fp32."
    )
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, stacklevel=4)
