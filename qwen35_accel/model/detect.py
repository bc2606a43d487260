"""Is this a Qwen3.5 model, of which family, and where are its parts?

Two families share the hybrid GatedDeltaNet + gated full attention stack: dense
(Transformers' `qwen3_5`: a dense MLP per layer) and MoE (`qwen3_5_moe`: a sparse MoE block
per layer; its GatedDeltaNet, attention and norms are the dense ones' source under other
class names, `tests/test_moe.py` holds that premise). `is_dense_qwen35` answers for the dense
family, which every feature takes; `qwen35_family` for both; `qwen35_parts` locates the
parts of the families a caller takes (`families`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from torch import nn
from transformers.modeling_layers import GenericForSequenceClassification, GenericForTokenClassification
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf_moe
from transformers.models.qwen3_next import modeling_qwen3_next as hf_next
from transformers.models.qwen4_exp import modeling_qwen4_exp as hf_qwen4

# The classes `PARALLELIZER.apply` knows how to shard, by name for error messages.
SUPPORTED_CLASSES: tuple[type[nn.Module], ...] = (
    hf.Qwen3_5ForCausalLM,
    hf.Qwen3_5ForConditionalGeneration,
    hf.Qwen3_5TextModel,
    hf.Qwen3_5Model,
)
# The MoE family's classes, in the same roles.
MOE_CLASSES: tuple[type[nn.Module], ...] = (
    hf_moe.Qwen3_5MoeForCausalLM,
    hf_moe.Qwen3_5MoeForConditionalGeneration,
    hf_moe.Qwen3_5MoeTextModel,
    hf_moe.Qwen3_5MoeModel,
)
# Qwen3-Next (`qwen3_next`): the same hybrid stack, its GatedDeltaNet's projections laid out per key-head
# group (`in_proj_qkvz`, `in_proj_ba`), a sparse MoE block with a shared expert; a causal LM and its text
# model (no VLM).
NEXT_CLASSES: tuple[type[nn.Module], ...] = (hf_next.Qwen3NextForCausalLM, hf_next.Qwen3NextModel)
# Qwen4-Exp (`qwen4_exp`): GatedDeltaNet (Qwen3.5's) and QSA indexed attention inside 4-stream hyper-connections,
# per-layer n-gram embeddings, 512 experts (docs/qwen4_exp_design.md); its causal LM and text model so far.
QWEN4_CLASSES: tuple[type[nn.Module], ...] = (hf_qwen4.Qwen4ExpForCausalLM, hf_qwen4.Qwen4ExpTextModel)
FAMILIES: tuple[str, ...] = ("dense", "moe", "next", "qwen4")
# The sparse MoE blocks of the MoE families (router `gate`, routed `experts`, `shared_expert`).
MOE_BLOCK_CLASSES: tuple[type[nn.Module], ...] = (
    hf_moe.Qwen3_5MoeSparseMoeBlock, hf_next.Qwen3NextSparseMoeBlock, hf_qwen4.Qwen4ExpTextSparseMoeBlock,
)
# Their routers: each returns (router_logits, scores, chosen experts).
ROUTER_CLASSES: tuple[type[nn.Module], ...] = (
    hf_moe.Qwen3_5MoeTopKRouter, hf_next.Qwen3NextTopKRouter, hf_qwen4.Qwen4ExpTextTopKRouter,
)
# Heads on a Qwen3.5 backbone (reward models, classifiers): Transformers' generic heads, whose
# backbone (`model.model`) is a text or base class of either family. Transformers 5.25 builds
# `Qwen3_5TextForSequenceClassification`, `Qwen3_5ForSequenceClassification` (the VLM's backbone)
# and `Qwen3_5ForTokenClassification` from them; a head a user builds the same way counts too.
HEAD_CLASSES: tuple[type, ...] = (GenericForSequenceClassification, GenericForTokenClassification)


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


def head_backbone(model: nn.Module) -> nn.Module | None:
    """The backbone of a generic classification head (`model.model`, its `base_model_prefix`), or
    None when `model` is no such head."""
    if not isinstance(model, HEAD_CLASSES):
        return None
    backbone = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    return backbone if isinstance(backbone, nn.Module) else None


def is_sequence_classifier(model: nn.Module) -> bool:
    """A Qwen3.5 model whose head scores a whole row from its last real token (reward models)."""
    inner = unwrap_qwen35(model)
    return isinstance(inner, GenericForSequenceClassification) and qwen35_family(inner) is not None


def is_token_classifier(model: nn.Module) -> bool:
    """A Qwen3.5 model whose head labels every token where it stands (labels not shifted)."""
    inner = unwrap_qwen35(model)
    return isinstance(inner, GenericForTokenClassification) and qwen35_family(inner) is not None


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
    """True if `model` is one of the dense Qwen3.5 classes in `SUPPORTED_CLASSES`, or a
    classification head on one of them (`HEAD_CLASSES`).

    Wrappers (FSDP2 keeps the class name prefixed, `torch.compile` wraps in `_orig_mod`,
    PEFT in `PeftModel` / `LoraModel`) are looked through; subclasses of the supported
    classes count.
    """
    return qwen35_family(model) == "dense"


def qwen35_family(model: nn.Module) -> str | None:
    """"dense", "moe", "next" (Qwen3-Next), "qwen4" (Qwen4-Exp), or None for a model of no family here (wrappers looked
    through; a classification head takes its backbone's family)."""
    inner = unwrap_qwen35(model)
    inner = head_backbone(inner) or inner
    if isinstance(inner, SUPPORTED_CLASSES):
        return "dense"
    if isinstance(inner, MOE_CLASSES):
        return "moe"
    if isinstance(inner, NEXT_CLASSES):
        return "next"
    return "qwen4" if isinstance(inner, QWEN4_CLASSES) else None


def supported_class_names(families: tuple[str, ...] = ("dense",)) -> str:
    classes = ((SUPPORTED_CLASSES if "dense" in families else ()) + (MOE_CLASSES if "moe" in families else ())
               + (NEXT_CLASSES if "next" in families else ()) + (QWEN4_CLASSES if "qwen4" in families else ()))
    return ", ".join(cls.__name__ for cls in classes) + " and classification heads on them"


@dataclass(frozen=True)
class Qwen35Parts:
    """The modules of a Qwen3.5 model that the parallelizer treats specially.

    `decoder_layers` are in execution order; `vision_blocks` is empty for text models;
    `family`: "dense", "moe", "next" or "qwen4" (`qwen35_family`); `moe_blocks`: a MoE model's sparse blocks
    (router `gate`, routed `experts`, `shared_expert`), one per sparse decoder layer (empty for dense).
    """

    text_model: nn.Module
    decoder_layers: tuple[nn.Module, ...]
    layer_types: tuple[str, ...]
    embed_tokens: nn.Module
    final_norm: nn.Module
    lm_head: nn.Module | None
    vision_model: nn.Module | None
    vision_blocks: tuple[nn.Module, ...]
    family: str = "dense"
    moe_blocks: tuple[nn.Module, ...] = ()
    head: nn.Module | None = None  # a classification head's `score` (lm_head is None then)


def qwen35_parts(model: nn.Module, families: tuple[str, ...] = ("dense",)) -> Qwen35Parts:
    """Locate the parts of a Qwen3.5 model of one of `families` (looked up inside wrappers,
    see `unwrap_qwen35`); TypeError for anything else."""
    model = unwrap_qwen35(model)
    family = qwen35_family(model)
    if family not in families:
        what = "dense Qwen3.5 models" if families == ("dense",) else "Qwen3.5 models"
        more = " (the MoE family has no vocab-parallel lm_head: see docs/moe.md)" if family == "moe" else ""
        raise TypeError(
            f"qwen35_accel supports {what} here ({supported_class_names(families)}); "
            f"got {type(model).__module__}.{type(model).__name__}{more}. For other models use Accelerate's own FSDP2 path."
        )
    head = getattr(model, "score", None) if head_backbone(model) is not None else None
    if head is not None:
        model = head_backbone(model)
    if family in ("next", "qwen4"):  # a causal LM or its text model
        text = hf_next.Qwen3NextModel if family == "next" else hf_qwen4.Qwen4ExpTextModel
        return _parts(model if isinstance(model, text) else model.model, model, None, family, head)
    # The four classes of each family, in the order of SUPPORTED_CLASSES / MOE_CLASSES.
    _causal, conditional, text, base = SUPPORTED_CLASSES if family == "dense" else MOE_CLASSES
    if isinstance(model, text):
        text_model, vision = model, None
    elif isinstance(model, base):
        text_model, vision = model.language_model, model.visual
    elif isinstance(model, conditional):
        text_model, vision = model.model.language_model, model.model.visual
    else:  # the causal LM
        text_model, vision = model.model, None
    return _parts(text_model, model, vision, family, head)


def _parts(text_model: nn.Module, model: nn.Module, vision: nn.Module | None, family: str, head: nn.Module | None) -> Qwen35Parts:
    layers = tuple(text_model.layers)
    return Qwen35Parts(
        text_model=text_model,
        decoder_layers=layers,
        layer_types=tuple(getattr(layer, "block_type", None) or layer.layer_type for layer in layers),
        embed_tokens=text_model.embed_tokens,
        # Qwen4-Exp has no final norm: its hyper-connection mixer (a grouped RMSNorm and the streams' mix) runs there.
        final_norm=getattr(text_model, "norm", None) or text_model.hyper_connection_mixer,
        lm_head=getattr(model, "lm_head", None),
        vision_model=vision,
        vision_blocks=tuple(vision.blocks) if vision is not None else (),
        family=family,
        moe_blocks=tuple(layer.mlp for layer in layers if isinstance(getattr(layer, "mlp", None), MOE_BLOCK_CLASSES)),
        head=head,
    )
