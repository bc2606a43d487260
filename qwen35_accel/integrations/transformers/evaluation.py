"""Evaluation and prediction patch points: `Trainer.evaluate`/`predict` under CP and TP equal one process.

Two things go wrong with stock Accelerate and the Trainer once ranks share a batch:

- Accelerate's data loader gives ranks that differ only in their cp or tp coordinate the
  same batch (`process_index // (tp * cp)`), but `gather_for_metrics` gathers over every
  process: each row comes back tp·cp times (and the last batch's `remainder` truncation then
  keeps duplicates instead of rows). `evaluation_loop` below gathers the loop's losses,
  predictions, labels and inputs over the data-parallel ranks only (`gather_over_data_parallel`),
  through the trainer's `gather_function` for the duration of the loop. Every other caller of
  `gather_for_metrics` keeps stock gathering over every process: TRL sums per-rank token
  counts through it, which under CP must include every cp rank (each holds other tokens of
  the same rows) and under TP are divided by the tp size by TRL itself.
- Under CP a forward returns this rank's sequence chunks (`[batch, seq / cp, vocab]` in the
  zigzag layout); with a vocab-parallel lm_head its vocab slice. `prediction_step` below
  assembles the whole logits (`[batch, seq, vocab]`, trimmed to the batch's own length) on
  every rank of the group, and runs label-less batches (`predict` on unlabeled data) through
  the CP context too (stock runs them unsharded). TRL's `SFTTrainer` overrides
  `prediction_step` without the CP context; `evaluation_loop` runs its loss-only evaluation
  inside it (`_sft_prediction_step`).

Memory: the assembled logits are what one process holds for the batch (batch × seq × vocab
in the logits' dtype) on every cp/tp rank, transiently, before `preprocess_logits_for_metrics`
and the gather. Nothing is gathered when no logits are asked for (`prediction_loss_only`,
or `evaluate()` without `compute_metrics`): the loss is reduced inside the model.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ...parallel.mesh import has_dim, sub_mesh
from ..targets import prepared_qwen35
from ..trl.trainers import trl_trainer


_STOCK = object()  # every rank holds its own batch: stock gathering


def _data_parallel_group(accelerator: Any) -> Any:
    """When some ranks share a batch (cp or tp > 1 on a prepared Qwen3.5 model): the group of
    ranks holding different batches (Accelerate's `dp` dim; None when there is none, i.e. one
    data-parallel rank). `_STOCK` otherwise."""
    if not any(prepared_qwen35(m) is not None for m in getattr(accelerator, "_models", [])):
        return _STOCK
    mesh = getattr(accelerator, "torch_device_mesh", None)
    if mesh is None:
        return _STOCK
    shared = 1
    for name in ("cp", "tp"):
        if has_dim(mesh, name):
            shared *= sub_mesh(mesh, name).size()
    if shared == 1:
        return _STOCK
    return sub_mesh(mesh, "dp").get_group() if has_dim(mesh, "dp") else None


def gather_over_data_parallel(data: Any, group: dist.ProcessGroup | None, use_gather_object: bool) -> Any:
    """`Accelerator.gather` (tensors: concatenated along dim 0, same shapes on every rank) or
    `gather_object` (lists flattened), over `group` only (None: this rank alone)."""
    from accelerate.utils import recursively_apply

    size = 1 if group is None else dist.get_world_size(group)
    if use_gather_object and size == 1:
        return list(data)
    if use_gather_object:
        parts: list[Any] = [None] * size
        dist.all_gather_object(parts, data, group=group)
        return [item for part in parts for item in part]
    if size == 1:
        return data

    def gather(tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.contiguous()
        if tensor.dim() == 0:
            tensor = tensor[None]
        out = [torch.empty_like(tensor) for _ in range(size)]
        dist.all_gather(out, tensor, group=group)
        return torch.cat(out, dim=0)

    return recursively_apply(gather, data, error_on_other_type=True)


def _gather_rows_once(accelerator: Any, input_data: Any, use_gather_object: bool = False) -> Any:
    """`accelerator.gather_for_metrics` with the ranks that share a batch counted once:
    gathered over the data-parallel ranks, the last batch cut to its rows as stock does.
    Decided per call: `evaluate()` before training prepares the model inside the loop."""
    from accelerate.utils import recursively_apply

    group = _data_parallel_group(accelerator)
    if group is _STOCK:
        return accelerator.gather_for_metrics(input_data, use_gather_object=use_gather_object)

    try:
        recursively_apply(lambda x: x, input_data, error_on_other_type=True)
        all_tensors = True
    except TypeError:
        all_tensors = False
    use_object = use_gather_object or not all_tensors
    data = gather_over_data_parallel(input_data, group, use_object)
    # As stock: the last batch of a sized dataset is cut to the rows that exist (the
    # data loader's `remainder` counts rows over the data-parallel ranks).
    remainder = accelerator.gradient_state.remainder if accelerator.gradient_state.end_of_dataloader else 0
    if remainder <= 0:
        return data
    if use_object:
        return data[:remainder]
    return recursively_apply(lambda t: t[:remainder], data)


def _assemble_logits(model: nn.Module, logits: Any, cp_mesh: Any, local_seq: int | None, seq: int | None) -> Any:
    """Every tensor of `logits` whose dim 1 is the local sequence: gathered over cp and cut to
    `seq`; a vocab-parallel lm_head's `[…, vocab / tp]` slice: gathered over tp."""
    from ...context_parallel import gather_sequence
    from ...model.state import state_of
    from ...parallel.tensor_parallel import gather_vocab_parallel_logits

    vocab_parallel = state_of(model).vocab_group is not None
    local_vocab = model.get_output_embeddings().weight.shape[0] if vocab_parallel else None  # type: ignore[union-attr]

    def assemble(tensor: Any) -> Any:
        if isinstance(tensor, (tuple, list)):
            return type(tensor)(assemble(t) for t in tensor)
        if not isinstance(tensor, torch.Tensor) or tensor.dim() < 2:
            return tensor
        if cp_mesh is not None and tensor.shape[1] == local_seq:
            tensor = gather_sequence(tensor.contiguous(), cp_mesh)[:, :seq]
        if vocab_parallel and tensor.dim() >= 3 and tensor.shape[-1] == local_vocab:
            tensor = gather_vocab_parallel_logits(model, tensor)
        return tensor

    return assemble(logits)


def prediction_step(original: Callable[..., Any]) -> Callable[..., Any]:
    """`Trainer.prediction_step` for a prepared Qwen3.5 model under cp > 1 or with a
    vocab-parallel lm_head: the logits of the whole sequence and vocab, as one process."""

    @functools.wraps(original)
    def wrapper(
        self: Any, model: nn.Module, inputs: dict[str, Any], prediction_loss_only: bool, ignore_keys: list[str] | None = None
    ) -> tuple[Any, Any, Any]:
        from ...model.state import state_of
        from ...parallel.context_parallel.model import context_parallel_mesh

        qwen = prepared_qwen35(model)
        cp_mesh = context_parallel_mesh(qwen) if qwen is not None else None
        if qwen is None or (cp_mesh is None and state_of(qwen).vocab_group is None):
            return original(self, model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        seq = local_seq = None
        if cp_mesh is not None and isinstance(inputs, Mapping) and inputs.get("input_ids") is not None:
            # The CP context shards its buffers in place and does not restore them: hand it
            # new tensor objects so the caller's batch (`include_for_metrics=["inputs"]`) stays whole.
            inputs = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
            seq = inputs["input_ids"].shape[1]
            cp = cp_mesh.size()
            local_seq = (seq + (-seq) % (2 * cp)) // cp
            if not _has_labels_or_loss(self, inputs):
                return _predict_unlabeled(self, model, qwen, inputs, prediction_loss_only, ignore_keys, cp_mesh, local_seq, seq)
        loss, logits, labels = original(self, model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        if cp_mesh is not None and loss is not None:
            # Each cp rank's loss is its chunks' share, scaled so that the mean over the cp ranks
            # is the batch's loss (stock gathering averaged the duplicated rows); every rank of
            # the group gets that mean, and the data-parallel gather sees it once per row.
            loss = loss.detach().clone()
            dist.all_reduce(loss, group=cp_mesh.get_group())
            loss = loss / cp_mesh.size()
        if logits is not None:
            applied = self.preprocess_logits_for_metrics
            if cp_mesh is not None and isinstance(applied, PerChunkPreprocess):
                logits = _preprocess_per_chunk(applied.original, logits, labels, cp_mesh, local_seq, seq)
            else:
                logits = _assemble_logits(qwen, logits, cp_mesh, local_seq, seq)
        return loss, logits, labels

    return wrapper


class PerChunkPreprocess:
    """Stands in for the Trainer's `preprocess_logits_for_metrics` during an evaluation loop
    with `QWEN35_ACCEL_CP_METRICS_PER_CHUNK=1`: `prediction_step` has already run
    `original` on each rank's chunks and assembled its output, so the loop's own call
    passes the result through."""

    def __init__(self, original: Callable[..., Any]) -> None:
        self.original = original

    def __call__(self, logits: Any, labels: Any) -> Any:
        return logits


def _preprocess_per_chunk(fn: Callable[..., Any], logits: Any, labels: Any, cp_mesh: Any, local_seq: int | None, seq: int | None) -> Any:
    """`fn` on this rank's chunks (logits [batch, local_seq, vocab], labels sharded alike),
    its per-position output [batch, local_seq, ...] assembled over cp and cut to `seq`.
    Exact for position-wise functions (argmax, top-k, per-token log-probs); others raise
    where their output has no per-position shape."""
    from ...context_parallel import gather_sequence
    from ...parallel.context_parallel.chunks import pad_for_context_parallel, shard_sequence

    cp, rank = cp_mesh.size(), cp_mesh.get_local_rank()
    if isinstance(labels, torch.Tensor) and labels.dim() >= 2:
        labels = shard_sequence(pad_for_context_parallel(labels, cp, 1, -100), cp, rank, 1)
    out = fn(logits, labels)
    if not isinstance(out, torch.Tensor) or out.dim() < 2 or out.shape[1] != local_seq:
        raise ValueError(
            "QWEN35_ACCEL_CP_METRICS_PER_CHUNK=1 needs a preprocess_logits_for_metrics that returns one value per "
            f"position ([batch, seq, ...]); on this rank's chunks ({local_seq} tokens) it returned "
            f"{type(out).__name__} {tuple(out.shape) if isinstance(out, torch.Tensor) else ''}. Unset the variable."
        )
    return gather_sequence(out.contiguous(), cp_mesh)[:, :seq]


def evaluation_loop(original: Callable[..., Any]) -> Callable[..., Any]:
    """`Trainer.evaluation_loop` on a prepared Qwen3.5 model under cp or tp > 1: the loop's
    `gather_function` (losses, predictions, labels, inputs) gathers over the data-parallel
    ranks only, each row once; with `QWEN35_ACCEL_CP_METRICS_PER_CHUNK=1` under cp > 1,
    `preprocess_logits_for_metrics` runs on each rank's chunks (in `prediction_step`)
    instead of on the assembled whole-sequence logits."""

    @functools.wraps(original)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        from ...parallel.context_parallel.model import context_parallel_mesh
        from ...parallel.prepared import prepared_state

        gather_function = self.gather_function
        bound = getattr(gather_function, "func", gather_function)
        # Only the Trainer's `gather_for_metrics` (Seq2SeqTrainer binds `gather` for generation).
        rows_once = getattr(bound, "__self__", None) is self.accelerator and bound.__name__ == "gather_for_metrics"
        if rows_once:
            # Stock binds `use_gather_object=args.eval_use_gather_object` once, at __init__, and
            # rebinds the plain `gather_for_metrics` after each loop: follow what is bound now.
            use_gather_object = getattr(gather_function, "keywords", {}).get("use_gather_object", False)
            self.gather_function = functools.partial(_gather_rows_once, self.accelerator, use_gather_object=use_gather_object)
        # TRL's SFTTrainer overrides `prediction_step` without the CP context (stock Trainer's
        # has it): bound on the instance for the loop, as `gather_function`.
        sft_step = "prediction_step" not in vars(self) and trl_trainer(self, ("SFTTrainer",)) is not None
        if sft_step:
            self.prediction_step = functools.partial(_sft_prediction_step, self, self.prediction_step)
        user_fn = self.preprocess_logits_for_metrics
        qwen = prepared_qwen35(self.model_wrapped) or prepared_qwen35(self.model)
        per_chunk = (
            user_fn is not None
            and not isinstance(user_fn, PerChunkPreprocess)
            and qwen is not None
            and context_parallel_mesh(qwen) is not None
            and prepared_state(qwen).settings.cp_metrics_per_chunk
        )
        if per_chunk:
            self.preprocess_logits_for_metrics = PerChunkPreprocess(user_fn)
        try:
            return original(self, *args, **kwargs)
        finally:
            if per_chunk:
                self.preprocess_logits_for_metrics = user_fn
            if sft_step:
                del self.prediction_step
            if getattr(self.gather_function, "func", None) is _gather_rows_once:
                self.gather_function = gather_function  # the loop raised before stock rebinds `gather_for_metrics`

    return wrapper


def _sft_prediction_step(
    trainer: Any,
    original: Callable[..., Any],
    model: nn.Module,
    inputs: dict[str, Any],
    prediction_loss_only: bool,
    ignore_keys: list[str] | None = None,
) -> tuple[Any, Any, Any]:
    """TRL `SFTTrainer.prediction_step` on a prepared Qwen3.5 model under cp > 1, loss only (what
    `evaluate()` asks for without `compute_metrics`): run inside the CP context (TRL's override
    runs the whole sequence, which the CP model refuses); the loss TRL's per-token mean over
    the label tokens of the whole batch (each rank's is over its own chunks'). TRL's entropy
    and accuracy sum their counts over every process themselves."""
    from ...parallel.context_parallel.model import context_parallel_mesh

    qwen = prepared_qwen35(model)
    cp_mesh = context_parallel_mesh(qwen) if qwen is not None else None
    if cp_mesh is None or not isinstance(inputs, Mapping) or inputs.get("input_ids") is None:
        return original(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
    unsupported = [
        what
        for what, given in (
            ("compute_metrics (TRL recomputes the logits, here this rank's chunks)", not prediction_loss_only),
            ("a compute_loss_func", trainer.compute_loss_func is not None),
            ("label smoothing", trainer.label_smoother is not None),
            ("a batch without labels", inputs.get("labels") is None),
        )
        if given
    ]
    if unsupported:
        raise NotImplementedError(
            f"TRL's SFTTrainer evaluation under context parallelism (cp_size={cp_mesh.size()}) gives its loss, entropy "
            f"and token accuracy; not supported here: {', '.join(unsupported)}. Evaluate without it, or with cp_size 1."
        )
    # The CP context shards its buffers in place: new tensor objects keep the caller's batch whole.
    inputs = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    cp_context, inputs = trainer._prepare_context_parallel_inputs(model, inputs)
    with cp_context():
        loss, _, _ = original(model, inputs, True, ignore_keys=ignore_keys)
    # TRL: loss = -sum(log_probs) / max(label tokens, 1) over this rank's chunks (`shift_labels`).
    counted = (inputs["shift_labels"] != -100).sum().to(loss.dtype)
    total = torch.stack([loss.detach() * counted, counted])
    dist.all_reduce(total, group=cp_mesh.get_group())
    return total[0] / total[1].clamp(min=1), None, None


def _has_labels_or_loss(trainer: Any, inputs: dict[str, Any]) -> bool:
    """The branch stock `prediction_step` takes: labels present, or a loss without labels."""
    if trainer.label_names:
        return all(inputs.get(k) is not None for k in trainer.label_names)
    return_loss = inputs.get("return_loss")
    return bool(trainer.can_return_loss if return_loss is None else return_loss)


@torch.no_grad()
def _predict_unlabeled(
    trainer: Any,
    model: nn.Module,
    qwen: nn.Module,
    inputs: dict[str, Any],
    prediction_loss_only: bool,
    ignore_keys: list[str] | None,
    cp_mesh: Any,
    local_seq: int,
    seq: int,
) -> tuple[None, Any, None]:
    """Stock `prediction_step`'s label-less branch, with the forward inside the CP context
    (stock runs it outside, on the whole sequence, which the CP model refuses)."""
    from transformers.trainer_pt_utils import nested_detach

    # A collator may leave `labels=None`; the Trainer's CP preparation reads any `labels` key.
    inputs = trainer._prepare_inputs({k: v for k, v in inputs.items() if v is not None})
    if ignore_keys is None:
        config = getattr(trainer.model, "config", None)
        ignore_keys = getattr(config, "keys_to_ignore_at_inference", ["cache"]) if config is not None else []
    cp_context, inputs = trainer._prepare_context_parallel_inputs(model, inputs)
    with trainer.compute_loss_context_manager(), cp_context():
        outputs = model(**inputs)
    if prediction_loss_only:
        return None, None, None
    if isinstance(outputs, dict):
        logits = tuple(v for k, v in outputs.items() if k not in ignore_keys)
    else:
        logits = outputs
    logits = nested_detach(logits)
    if len(logits) == 1:
        logits = logits[0]
    return None, _assemble_logits(qwen, logits, cp_mesh, local_seq, seq), None
