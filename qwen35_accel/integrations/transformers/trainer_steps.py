"""The Trainer's per-step points: the batch padded for context parallelism and its labels kept where
they belong (`Trainer._prepare_context_parallel_inputs`), and each batch counted once by the ranks that
share it (`_track_num_input_tokens`, `floating_point_ops`)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..targets import accelerator_cp_mesh, prepared_by_accelerate
from ..trl.trainers import (
    TRL_LOGPROB_TRAINERS,
    TRL_SAMPLING_TRAINERS,
    trl_trainer,
    trl_under_cp_error,
    trl_under_tp_error,
)


def prepare_context_parallel_inputs(original: Callable[..., Any]) -> Callable[..., Any]:
    """`Trainer._prepare_context_parallel_inputs`: under our cp, pad the batch to a multiple
    of 2·cp first (padding-free collators such as `DataCollatorWithFlattening` make rows of
    any length; only here are the keys, and so each buffer's pad value, known). TRL's DPO and
    KTO trainers, and GRPO and RLOO (TRL 1.16), are not sharded here: they compute per-sequence
    quantities from the fused head's per-token fields of whole rows, which the head's call shards
    and gathers back itself (`trl_whole_rows`); the batch stays whole on every cp rank. With
    another TRL they are refused here on every rank (with a reference model earlier, when TRL
    prepares it); GRPO/RLOO under tp > 1 too, before they generate: stock TRL samples per
    process, so the ranks of a tp group would see different tokens (`trl_sampling` makes
    each group one replica for TRL 1.16)."""

    @functools.wraps(original)
    def wrapper(self: Any, model: Any, inputs: dict[str, Any]) -> Any:
        accelerator = getattr(self, "accelerator", None)
        cp_mesh = accelerator_cp_mesh(accelerator)
        whole_rows = False
        if cp_mesh is not None and (trainer := trl_trainer(self, TRL_LOGPROB_TRAINERS)) is not None:
            from ..trl.whole_rows import whole_rows_supported

            whole_rows, trl_version = whole_rows_supported(trainer)
            if not whole_rows:
                raise trl_under_cp_error(trainer, cp_mesh.size(), trl_version)
        tp_size = getattr(getattr(accelerator, "parallelism_config", None), "tp_size", 1) or 1
        if tp_size > 1 and (trainer := trl_trainer(self, TRL_SAMPLING_TRAINERS)) is not None and any(
            prepared_by_accelerate(m) for m in getattr(accelerator, "_models", [])
        ):
            from ..activation import TRL

            supported, trl_version = TRL.check()
            if not supported:
                raise trl_under_tp_error(trainer, tp_size, trl_version)
        _refuse_logits_consumers_of_vocab_slices(self, accelerator)
        if whole_rows:
            return contextlib.nullcontext, inputs
        row_labels, token_labels = None, False
        if cp_mesh is not None and isinstance(inputs, Mapping) and (  # collators may return a BatchEncoding
            inputs.get("input_ids") is not None or inputs.get("inputs_embeds") is not None
        ):
            from ...context_parallel import pad_batch_for_context_parallel

            # The CP context shards its buffers in place: hand it new tensor objects, so the
            # training loop's batch stays whole for what it counts after the step (tokens seen).
            inputs = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
            classifier = _sequence_classifier_pad_token(model)
            if classifier is not None:  # per-row labels: whole on every rank, neither shifted nor sharded
                row_labels = inputs.pop("labels", None)
            elif _is_token_classifier(model) and inputs.get("labels") is not None:
                # Per-token labels where they stand: handed over as the labels the stock preparation
                # shards as they are (it would shift `labels`), given back their name below.
                inputs["shift_labels"] = inputs.pop("labels")
                token_labels = True
            length = (inputs.get("input_ids") if inputs.get("input_ids") is not None else inputs["inputs_embeds"]).shape[1]
            inputs = pad_batch_for_context_parallel(inputs, cp_mesh.size())
            if classifier is not None and inputs.get("input_ids") is not None:
                inputs["input_ids"][:, length:] = classifier  # the head pools the last token that is not the pad token
        context, inputs = original(self, model, inputs)
        if row_labels is not None:
            inputs["labels"] = row_labels
        if token_labels:  # the same tensor object: the CP context shards it in place when entered
            inputs["labels"] = inputs.pop("shift_labels")
        return context, inputs

    return wrapper


def _is_token_classifier(model: Any) -> bool:
    from ...model.detect import is_token_classifier

    inner = getattr(model, "module", model)
    return isinstance(inner, torch.nn.Module) and is_token_classifier(inner)


def _sequence_classifier_pad_token(model: Any) -> int | None:
    """The pad token of a Qwen3.5 sequence classifier (reward model) the Trainer trains, None for any
    other model; ValueError for a classifier without one (the row's last position would be CP's
    padding)."""
    from ...model.detect import is_sequence_classifier, unwrap_qwen35

    inner = getattr(model, "module", model)
    if not isinstance(inner, torch.nn.Module) or not is_sequence_classifier(inner):
        return None
    pad_token_id = unwrap_qwen35(inner).config.get_text_config().pad_token_id
    if pad_token_id is None:
        raise ValueError(
            f"{type(unwrap_qwen35(inner)).__name__} under context parallelism needs config.pad_token_id: it scores each "
            "row from its last token that is not the pad token, and the rows are padded to a multiple of 2 x cp. Set "
            "model.config.pad_token_id (the tokenizer's pad token)."
        )
    return int(pad_token_id)


def _refuse_logits_consumers_of_vocab_slices(trainer: Any, accelerator: Any) -> None:
    """NotImplementedError (every rank, each step) when the Trainer would compute its loss from
    `outputs.logits` of a model whose lm_head is vocab-parallel: those logits are this rank's
    vocab slice, so label smoothing or a `compute_loss_func` would see a part of the vocabulary."""
    from ...model.state import state_of

    users = [
        what
        for what, present in (
            ("label smoothing (label_smoothing_factor > 0)", getattr(trainer, "label_smoother", None) is not None),
            ("a compute_loss_func", getattr(trainer, "compute_loss_func", None) is not None),
        )
        if present
    ]
    if not users:
        return
    from ...model.detect import unwrap_qwen35

    for model in getattr(accelerator, "_models", []):
        if prepared_by_accelerate(model) and state_of(unwrap_qwen35(model)).vocab_group is not None:
            raise NotImplementedError(
                f"{' and '.join(users)} computes the loss from the model's logits, which with "
                "QWEN35_ACCEL_VOCAB_PARALLEL_LM_HEAD=1 hold this rank's slice of the vocabulary (a wrong loss). "
                "Turn vocab_parallel_lm_head off, or drop the label smoothing / compute_loss_func."
            )


def track_num_input_tokens(original: Callable[..., Any]) -> Callable[..., Any]:
    """`Trainer._track_num_input_tokens`: the Trainer sums every process's count of its batch,
    but ranks that differ only in their cp or tp coordinate hold the same batch (Accelerate's
    data loader), so each batch is counted cp·tp times: the increment is divided by cp·tp
    (exact: every rank of such a group counts the same whole batch)."""

    @functools.wraps(original)
    def wrapper(self: Any, inputs: Any) -> None:
        accelerator = getattr(self, "accelerator", None)
        shared = _ranks_sharing_a_batch(accelerator)
        if shared == 1:
            return original(self, inputs)
        before = self.state.num_input_tokens_seen
        original(self, inputs)
        counted = self.state.num_input_tokens_seen - before
        self.state.num_input_tokens_seen = before + counted // shared

    return wrapper


def floating_point_ops(original: Callable[..., Any]) -> Callable[..., Any]:
    """`Trainer.floating_point_ops`: the Trainer sums every process's estimate for its batch
    (6 × positions × `num_parameters(exclude_embeddings=True)`), but the ranks of a cp×tp
    group hold the same batch, and under tp `num_parameters` counts this rank's slices of
    the split parameters. The group's first rank (cp and tp coordinates 0) gives the stock
    estimate with the unsplit model's parameter count, the others 0: the sum is exactly
    what the data-parallel ranks alone would log. Under DeepSpeed, `num_parameters` does not see
    the gates the plugin keeps outside the engine: they are counted in the same way."""

    @functools.wraps(original)
    def wrapper(self: Any, inputs: dict[str, Any]) -> int:
        accelerator = getattr(self, "accelerator", None)
        shared = _ranks_sharing_a_batch(accelerator)
        hidden = _hidden_gate_numel(self.model)
        if shared == 1 and not hidden:
            return original(self, inputs)
        from ...parallel.mesh import has_dim
        from ...parallel.tensor_parallel import tensor_parallel_numel_elsewhere

        mesh = getattr(accelerator, "torch_device_mesh", None)
        if shared > 1 and any(has_dim(mesh, name) and mesh[name].get_local_rank() != 0 for name in ("cp", "tp")):
            return 0
        flops = original(self, inputs)
        uncounted = hidden + (tensor_parallel_numel_elsewhere(self.model) if shared > 1 else 0)
        if not flops or not uncounted:
            return flops
        # The stock estimate is a multiple of this rank's count: scaled exactly.
        local = self.model.num_parameters(exclude_embeddings=True)
        return flops * (local + uncounted) // local

    return wrapper


def _hidden_gate_numel(model: Any) -> int:
    """The elements of the gates kept outside a DeepSpeed engine (`integrations/deepspeed/gates.py`), else 0."""
    from ...model.state import find_state

    state = find_state(model) if isinstance(model, torch.nn.Module) else None
    gates = state.deepspeed_gates if state is not None else None
    return sum(p.numel() for p in gates.params) if gates is not None else 0


def _ranks_sharing_a_batch(accelerator: Any) -> int:
    """cp × tp of the accelerator's mesh when it prepared a dense Qwen3.5 model, else 1."""
    from ...parallel.mesh import mesh_dim_size

    mesh = getattr(accelerator, "torch_device_mesh", None)
    if mesh is None or not any(prepared_by_accelerate(m) for m in getattr(accelerator, "_models", [])):
        return 1
    return mesh_dim_size(mesh, "cp") * mesh_dim_size(mesh, "tp")
