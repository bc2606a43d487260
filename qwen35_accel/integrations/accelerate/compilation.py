"""torch.compile for a dense Qwen3.5 model the plugin prepares under Accelerate's `dynamo_config`
(or `TrainingArguments(torch_compile=True)`): per decoder layer instead of the whole model.

Accelerate compiles the model before its FSDP2 preparation (whole, an `OptimizedModule`, or each
repeated block in place with `use_regional_compilation`), so FSDP2's hooks would run inside the
compiled code and break the graph at every unit. The preparation undoes that (`take_over_compile`)
and hands its keyword arguments to the pipeline's compile step (`ParallelOptions.compile`), which
compiles the regions between unit boundaries once the model is sharded (`parallel.regional_compile`),
under every layout (with tp too: the regions compute on the head-parallel slices; the whole model
under tp broke the graph 15 times in a step of the tiny model).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from ...parallel.prepared import Preparation


def take_over_compile(accelerator: Any, model: nn.Module) -> tuple[nn.Module, dict[str, Any] | None]:
    """Where Accelerate's dynamo_config is set, it compiled `model` before this preparation: whole
    (an `OptimizedModule`) or, with `use_regional_compilation`, each decoder layer in place, FSDP2's
    hooks inside either way. The plugin compiles per layer instead (`parallel.regional_compile`,
    after sharding): returns the uncompiled model (Accelerate's list of prepared models updated to it)
    and the compile keyword arguments; without a dynamo_config (`model`, None)."""
    from accelerate.utils import DynamoBackend

    dynamo = getattr(accelerator.state, "dynamo_plugin", None)
    if dynamo is None or dynamo.backend == DynamoBackend.NO:
        return model, None
    inner = model.__dict__.get("_modules", {}).get("_orig_mod")
    if isinstance(inner, nn.Module) and isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        models = accelerator._models  # Accelerate appended the compiled wrapper before calling this preparation
        accelerator._models = [inner if m is model else m for m in models]
        model = inner
    from ...parallel.regional_compile import REGION_ATTR

    for module in model.modules():  # use_regional_compilation: Accelerate's per-block compile, undone (not ours)
        if module.__dict__.get("_compiled_call_impl") is not None and not module.__dict__.get(REGION_ATTR):
            module._compiled_call_impl = None
    return model, dynamo.to_kwargs()


def compile_note(prep: Preparation, *, compiled_whole: bool = False) -> str:
    """What the prepared line says about compilation ("" when nothing is compiled): the regions the
    pipeline's compile step compiled (`take_over_compile`'s keyword arguments became its `compile`
    option), or the whole model the script compiled itself (`compiled_whole`: `_orig_mod`)."""
    if prep.compiled:
        moe = ", the routers and routed experts" if prep.parts.family == "moe" else ""
        return (f", torch.compile (Accelerate's dynamo_config): per decoder layer, {prep.compiled}; eager: the FSDP2 units' "
                f"hooks, the gate holders, the loss head, CUDA kernels, packed rows' conv and rule, CP's collectives{moe}")
    if compiled_whole:  # the script compiled the model itself (no dynamo_config)
        return ", torch.compile: the whole model (Accelerate's dynamo_config; each FSDP2 unit's hooks break the graph)"
    return ""
