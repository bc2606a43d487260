"""Is this a dense Qwen3.5 model, and where are its parts?

Dense Qwen3.5 means the Transformers `qwen3_5` family (hybrid GatedDeltaNet + gated full
attention, dense MLP); the `qwen3_5_moe` family is a different model and is not detected.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from torch import nn
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

# The classes `PARALLELIZER.apply` knows how to shard, by name for error messages.
SUPPORTED_CLASSES: tuple[type[nn.Module], ...] = (
    hf.Qwen3_5ForCausalLM,
    hf.Qwen3_5ForConditionalGeneration,
    hf.Qwen3_5TextModel,
    hf.Qwen3_5Model,
)


def peft_base_model(model: nn.Module) -> nn.Module | None:
    """The model a PEFT adapter wrapper holds (`PeftModel` → its tuner → `.model`; a tuner such
    as `LoraModel` → `.model`), or None when `model` is not such a wrapper. Prompt-learning
    wrappers (no tuner layers in the model) are not looked through."""
    if "peft" not in sys.modules:  # a PEFT object implies PEFT is imported; never import it here
        return None
    from peft import PeftModel
    from peft.tuners.tuners_utils import BaseTuner

    if isinstance(model, PeftModel):
        model = model.base_model
    return model.model if isinstance(model, BaseTuner) else None


def unwrap_qwen35(model: nn.Module) -> nn.Module:
    """`model` without the wrappers detection looks through: `torch.compile`'s `_orig_mod`
    and PEFT adapter wrappers (`peft_base_model`). Returns `model` itself when unwrapped."""
    while True:
        inner = model.__dict__.get("_modules", {}).get("_orig_mod")
        if inner is None:
            inner = peft_base_model(model)
        if inner is None:
            return model
        model = inner


def is_dense_qwen35(model: nn.Module) -> bool:
    """True if `model` is one of the dense Qwen3.5 classes in `SUPPORTED_CLASSES`.

    Wrappers (FSDP2 keeps the class name prefixed, `torch.compile` wraps in `_orig_mod`,
    PEFT in `PeftModel` / `LoraModel`) are looked through; subclasses of the supported
    classes count.
    """
    return isinstance(unwrap_qwen35(model), SUPPORTED_CLASSES)


def supported_class_names() -> str:
    return ", ".join(cls.__name__ for cls in SUPPORTED_CLASSES)


@dataclass(frozen=True)
class Qwen35Parts:
    """The modules of a dense Qwen3.5 model that the parallelizer treats specially.

    `decoder_layers` are in execution order; `vision_blocks` is empty for text models.
    """

    text_model: nn.Module
    decoder_layers: tuple[nn.Module, ...]
    layer_types: tuple[str, ...]
    embed_tokens: nn.Module
    final_norm: nn.Module
    lm_head: nn.Module | None
    vision_model: nn.Module | None
    vision_blocks: tuple[nn.Module, ...]


def qwen35_parts(model: nn.Module) -> Qwen35Parts:
    """Locate the parts of a dense Qwen3.5 model (looked up inside wrappers, see
    `unwrap_qwen35`); TypeError for anything else."""
    model = unwrap_qwen35(model)
    if not is_dense_qwen35(model):
        raise TypeError(
            f"qwen35_accel supports dense Qwen3.5 models ({supported_class_names()}); "
            f"got {type(model).__module__}.{type(model).__name__}. For other models use Accelerate's own FSDP2 path."
        )
    if isinstance(model, hf.Qwen3_5TextModel):
        text_model, vision = model, None
    elif isinstance(model, hf.Qwen3_5Model):
        text_model, vision = model.language_model, model.visual
    elif isinstance(model, hf.Qwen3_5ForConditionalGeneration):
        text_model, vision = model.model.language_model, model.model.visual
    else:  # Qwen3_5ForCausalLM
        text_model, vision = model.model, None
    layers = tuple(text_model.layers)
    return Qwen35Parts(
        text_model=text_model,
        decoder_layers=layers,
        layer_types=tuple(layer.block_type for layer in layers),
        embed_tokens=text_model.embed_tokens,
        final_norm=text_model.norm,
        lm_head=getattr(model, "lm_head", None),
        vision_model=vision,
        vision_blocks=tuple(vision.blocks) if vision is not None else (),
    )
