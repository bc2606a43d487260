"""The memory per rank of one training step: parameters, gradients, optimizer state,
activations, the loss and the transient peak (`estimate`), and a VLM's tower added (`step_estimate`)."""

from __future__ import annotations

from dataclasses import asdict

from .layers import activations, host_activations, layer_activations
from .loss import loss_saved, loss_transient
from .shapes import OPTIMIZER_STATES, MemoryEstimate, ModelShape, Parallel, StepOptions
from .vision_tower import VisionTower, vision_estimate


def _sharded(count: int, parallel: Parallel) -> int:
    return -(-count // parallel.fsdp_shards)


def _parameter_counts(shape: ModelShape, parallel: Parallel) -> tuple[int, int, int]:
    """(parameters per rank, the largest decoder-layer unit gathered on a rank, the
    embedding/lm_head tail gathered on a rank), in parameters."""
    tp = parallel.tp
    per_rank = 0
    largest = 0
    # MoE: the routed experts split whole over tp (or ep); FSDP2 shards the rest over dp_shard ×
    # cp (ep × efsdp is that many ranks), so a rank holds 1/(tp · dp_shard · cp) of them either
    # way; gathered for compute: the experts of this rank's tp slice, or of its ep rank.
    experts = shape.expert_parameters() // tp
    for kind, count in (("linear_attention", shape.linear_layers), ("full_attention", shape.full_layers)):
        if count:
            split, whole = shape.layer_parameters(kind)
            gathered = split // tp + whole
            per_rank += count * (_sharded(gathered, parallel) + _sharded(experts, parallel))
            # ep x tp holds its experts whole, outside FSDP2: nothing of them is gathered.
            largest = max(largest, gathered + (0 if parallel.tp > 1 and parallel.ep > 1 else experts // parallel.ep))
    embedding = shape.vocab * shape.hidden
    head = embedding // tp if parallel.vocab_parallel_lm_head else embedding
    per_rank += _sharded(embedding, parallel) + _sharded(shape.hidden, parallel)
    if not shape.tied_embeddings:
        per_rank += _sharded(head, parallel)
    return per_rank, largest, (head if not shape.tied_embeddings else embedding) + shape.hidden


def estimate(shape: ModelShape, parallel: Parallel, options: StepOptions) -> MemoryEstimate:
    """The memory per rank of one training step (see the module docstring).

    With `options.reference_model`, a frozen copy of the model: its parameters sharded as the
    policy's (our FSDP2 units over dp_shard × cp, tp-split; the plugin prepares it so), in its
    storage dtype as loaded (`reference_bytes`: no fp32 masters, nothing updates it); no gradients,
    optimizer state or saved activations (its forwards run under `torch.no_grad()`). Its
    forward's peak (its units gathered at the forward prefetch depth) is below the policy's
    backward peak (the backward depth and an unsharded gradient), with the policy's units
    resharded meanwhile, so it adds nothing to `transient`."""
    if options.seq_len % (2 * parallel.cp if parallel.cp > 1 else 1):
        raise ValueError(f"seq_len {options.seq_len} is not divisible by 2*cp = {2 * parallel.cp}; pass a multiple of it")
    params, largest_layer, tail = _parameter_counts(shape, parallel)
    p, c = options.param_bytes, options.compute_bytes
    # FSDP2 in flight: the running unit plus the prefetched ones (forward, or backward with the
    # running unit's unsharded gradient, in c and copied to fp32 for the reduce-scatter), and
    # the tail kept gathered; the tail's own gradient arrives with the loss's backward.
    gathered = max(
        (1 + options.forward_prefetch_depth) * largest_layer * c,
        (1 + options.backward_prefetch_depth) * largest_layer * c + largest_layer * (c + 4),
    ) + tail * c
    # The tail's gradient: Transformers' loss makes it in c; the tiled loss's working bytes
    # include it (or hold it); FSDP2 then copies it to fp32 for the reduce-scatter.
    tail_gradient = tail * (4 if options.tiled_loss != "off" else c + 4)
    # The loss's bytes live from the end of forward to the loss's backward; the other peaks
    # (a layer recomputed in backward, CP's K/V) come while they do not, so those peaks
    # count only what exceeds them.
    loss = loss_saved(shape, parallel, options)
    others = []
    if options.activation_checkpointing:
        others += [layer_activations(shape, kind, parallel, options) for kind, n in
                   (("linear_attention", shape.linear_layers), ("full_attention", shape.full_layers)) if n]
    if parallel.cp > 1 and shape.full_layers:
        tokens = options.batch_size * options.seq_len
        others.append(2 * 2 * tokens * shape.kv_heads // parallel.tp * shape.head_dim * c)  # K/V and their gradient
    at_loss = loss_transient(shape, parallel, options) + tail_gradient
    return MemoryEstimate(
        parameters=params * p,
        gradients=params * p,
        optimizer_states=params * p * OPTIMIZER_STATES[options.optimizer],
        activations=activations(shape, parallel, options),
        loss=loss,
        transient=gathered + max([at_loss] + [peak - loss for peak in others]),
        reference_parameters=params * options.reference_bytes if options.reference_model else 0,
        host_activations=host_activations(shape, parallel, options),
    )


def step_estimate(shape: ModelShape, parallel: Parallel, options: StepOptions, vision: VisionTower | None = None) -> MemoryEstimate:
    """`estimate` of the decoder plus, for a VLM, `vision_estimate` of its tower."""
    text = estimate(shape, parallel, options)
    if vision is None:
        return text
    tower = vision_estimate(vision, parallel, options)
    return MemoryEstimate(**{key: getattr(text, key) + getattr(tower, key) for key in asdict(text)})
