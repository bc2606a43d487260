"""Activation checkpointing per decoder layer composes with FSDP2 and changes nothing."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from _dist import run_world
from _parity import assert_close, assert_grads_match, full

pytestmark = pytest.mark.multiprocess


def _parts(model):
    """The located parts `choose_activation_checkpointing` takes (as the pipeline hands them)."""
    from qwen35_accel.model.detect import FAMILIES, qwen35_parts

    return qwen35_parts(model, families=FAMILIES)


def _ac_worker(rank: int, world: int) -> None:
    from qwen35_accel import PARALLELIZER
    from qwen35_accel.parallel.prepared import prepared_state
    from qwen35_accel.testing.tiny import build_tiny_causal_lm, random_batch

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard_cp",))
    results = {}
    for ac in (False, True):
        model = build_tiny_causal_lm(seed=0)
        if ac:  # Transformers' checkpointing on too (as a script may leave it): the pipeline turns it off on ours
            model.gradient_checkpointing_enable()
        model = PARALLELIZER.apply(model, mesh, activation_checkpointing=ac)
        if ac:
            assert not any(layer.gradient_checkpointing for layer in model.model.layers)
            assert prepared_state(model).checkpointing.startswith(
                "qwen35_accel's (each decoder layer; Transformers' gradient checkpointing was on too and is turned off"
            ), prepared_state(model).checkpointing
        saved = []  # tensors the forward keeps for backward
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(1) or t, lambda t: t):
            loss = model(**random_batch(2, 32, model.config.vocab_size, seed=rank)).loss
        loss.backward()
        grads = {n: full(p.grad) for n, p in model.named_parameters()}
        results[ac] = (loss.detach(), grads, len(saved))
    (loss_off, grads_off, saved_off), (loss_on, grads_on, saved_on) = results[False], results[True]
    # Checkpointed layers keep only their inputs; everything else is recomputed.
    assert saved_on < saved_off / 4, (saved_on, saved_off)
    # Recomputation runs the same kernels in the same order: agreement to the last bits.
    assert_close(loss_on, loss_off, "loss", rtol=1e-6, atol=0)
    for name in grads_off:
        assert_close(grads_on[name], grads_off[name], f"grad of {name}", rtol=1e-6, atol=1e-9)
    # Names stay the Transformers ones (no wrapper module in the path).
    assert not any("checkpoint" in n for n in grads_on)


def test_activation_checkpointing_on_and_off_give_same_loss_and_grads():
    run_world(_ac_worker, 2)


def _offload_worker(rank: int, world: int) -> None:
    """cp 2, checkpointing with offload: the loss and every gradient equal one process's, and on
    every rank each checkpointed layer's saved inputs went through the offload hooks (the
    hidden states of this rank's chunk at least; with `always_copy`, each through a copy)."""
    from qwen35_accel import PARALLELIZER
    from qwen35_accel.context_parallel import shard_batch
    from qwen35_accel.memory import ModelShape, Parallel, StepOptions
    from qwen35_accel.memory.layers import host_activations
    from qwen35_accel.model.state import find_state
    from qwen35_accel.testing.tiny import build_tiny_causal_lm, random_batch

    mesh = init_device_mesh("cpu", (1, 1, world, 1), mesh_dim_names=("dp_replicate", "dp_shard", "cp", "tp"))
    mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    reference = build_tiny_causal_lm(seed=0)
    batch = random_batch(2, 32, reference.config.vocab_size, seed=7)
    want = reference(**batch).loss
    want.backward()
    model = PARALLELIZER.apply(build_tiny_causal_lm(seed=0), mesh, activation_checkpointing=True, activation_offload=True)
    offload = find_state(model).activation_offload
    config = model.config
    local = shard_batch(batch, mesh["cp"])
    hidden_bytes = local["input_ids"].numel() * config.hidden_size * 4  # one layer's input hidden states, fp32
    for always_copy in (False, True):
        offload.always_copy, offload.stats = always_copy, type(offload.stats)()
        model.zero_grad(set_to_none=True)
        loss = model(**local).loss
        stats = offload.stats
        assert stats.bytes >= config.num_hidden_layers * hidden_bytes, (rank, stats)
        # What `plan` counts in host memory (the layers' input hidden states) against what went through
        # the hooks (those, and each layer's rotary cos/sin and position ids): within 10 %.
        planned = host_activations(ModelShape.from_config(config), Parallel(cp=world), StepOptions(
            seq_len=32, batch_size=2, compute_bytes=4, device="cpu", activation_checkpointing=True, activation_offload=True))
        assert abs(stats.bytes / planned - 1) <= 0.10, (rank, stats.bytes, planned)
        assert stats.moved_tensors + stats.deduplicated_tensors == (stats.tensors if always_copy else 0), (rank, stats)
        assert stats.prefetched_tensors == 0  # backward has not started
        packed = stats.tensors
        loss.backward()
        assert offload.stats.tensors == packed  # the recompute kept nothing through them
        if always_copy:  # every layer's input but the last layer's (the first backward needs) copied back ahead
            assert offload.stats.prefetched_tensors + offload.stats.unprefetched_tensors == stats.moved_tensors + stats.deduplicated_tensors
            assert offload.stats.prefetched_tensors >= config.num_hidden_layers - 1, (rank, offload.stats)
        total = loss.detach().clone()
        torch.distributed.all_reduce(total, op=torch.distributed.ReduceOp.AVG)
        assert_close(total, want.detach(), f"loss (always_copy={always_copy})")
        assert assert_grads_match(model, reference) == sum(1 for _ in reference.parameters())


def test_activation_offload_under_cp_equals_one_process_and_holds_every_layers_inputs():
    run_world(_offload_worker, 2)


def _tower_saved(model, pixels: torch.Tensor, grid: torch.Tensor) -> tuple[int, int, dict[str, torch.Tensor]]:
    """A forward and backward of `model`'s vision tower: (bytes of the distinct storages its
    forward keeps for backward, parameters excluded, with what each checkpointed block was
    called with; of those, the bytes saved inside the blocks beyond their inputs), and the
    tower's gradients."""
    from torch.distributed._composable import checkpoint

    visual = model.model.visual
    held = {p.untyped_storage().data_ptr() for p in visual.parameters()}
    kept: dict[int, int] = {}
    inputs: set[int] = set()  # storages the blocks were called with
    in_blocks: set[int] = set()  # storages saved while a block runs
    running = [False]

    def keep(t: torch.Tensor, into: set[int] | None = None) -> None:
        storage = t.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in held:
            kept.setdefault(storage.data_ptr(), storage.nbytes())
            if into is not None:
                into.add(storage.data_ptr())

    def pack(t: torch.Tensor) -> torch.Tensor:
        keep(t, in_blocks if running[0] else None)
        return t

    def enter(module, args, kwargs) -> None:
        running[0] = True
        if checkpoint.state(module) is not None:  # what the checkpoint holds: the block's arguments
            for value in [*args, *kwargs.values()]:
                for t in value if isinstance(value, (tuple, list)) else (value,):
                    if isinstance(t, torch.Tensor):
                        keep(t, inputs)

    hooks = [h for block in visual.blocks for h in (block.register_forward_pre_hook(enter, with_kwargs=True),
                                                    block.register_forward_hook(lambda *_: running.__setitem__(0, False)))]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        output = visual(pixels, grid_thw=grid).pooler_output
    for hook in hooks:
        hook.remove()
    output.float().square().sum().backward()
    beyond = sum(kept[ptr] for ptr in in_blocks - inputs)
    return sum(kept.values()), beyond, {name: p.grad for name, p in visual.named_parameters()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_checkpointed_vision_blocks_keep_only_their_inputs(dtype):
    """One process, Transformers' tower wider than the tiny VLM's, two images of different sizes:
    checkpointed, nothing is saved inside a vision block beyond what it was called with, the
    tower's bytes for backward are the memory model's checkpointed count (±10 %) and a
    fraction of the unchecked ones, the gradients unchanged. A frozen tower is not checkpointed."""
    from qwen35_accel.memory import VisionShape, vision_activations
    from qwen35_accel.model.detect import qwen35_parts
    from qwen35_accel.parallel.activation_checkpointing import apply_activation_checkpointing, checkpoint_targets
    from qwen35_accel.testing.tiny import build_tiny_vlm

    vision = dict(hidden_size=128, intermediate_size=256, num_heads=2, depth=3)
    grid = torch.tensor([[1, 8, 8], [1, 16, 8]])
    results = {}
    for ac in (False, True):
        model = build_tiny_vlm(seed=0)
        for key, value in vision.items():
            setattr(model.config.vision_config, key, value)
        model.model.visual = type(model.model.visual)._from_config(model.config.vision_config)
        model = model.to(dtype)
        parts = qwen35_parts(model)
        targets = checkpoint_targets(parts)
        assert all(any(block is t for t in targets) for block in parts.vision_blocks)
        if ac:
            assert apply_activation_checkpointing(targets) == len(parts.decoder_layers) + vision["depth"]
        shape = VisionShape.from_config(model.config)
        torch.manual_seed(1)
        pixels = torch.randn(int(grid.prod(-1).sum()), shape.patch_dim, dtype=dtype)
        results[ac] = _tower_saved(model, pixels, grid)
        want = vision_activations(shape, len(pixels), dtype.itemsize, device="cpu", checkpointed=ac)
        # The memory model's bound (tests/test_memory_model.py).
        assert abs(want / results[ac][0] - 1) <= 0.10, (dtype, ac, want, results[ac][0])
    (off, off_blocks, grads_off), (on, on_blocks, grads_on) = results[False], results[True]
    assert off_blocks > 0 and on_blocks == 0, (off_blocks, on_blocks)
    assert on < off / 3, (on, off)
    for name, grad in grads_off.items():
        # Recomputation runs the same kernels in the same order: the same bits.
        assert torch.equal(grads_on[name], grad), name
    model.model.visual.requires_grad_(False)
    assert checkpoint_targets(qwen35_parts(model)) == qwen35_parts(model).decoder_layers


def test_prepared_line_names_the_vision_blocks_and_no_block_is_checkpointed_twice():
    """The plugin's choice between ours and Transformers' gradient checkpointing on a VLM: ours
    covers a trainable tower's blocks, so their Transformers flags go off with the decoder
    layers'; a frozen tower's blocks are not ours and keep theirs."""
    from qwen35_accel.parallel.activation_checkpointing import choose_activation_checkpointing
    from qwen35_accel.testing.tiny import build_tiny_vlm

    model = build_tiny_vlm(seed=0)
    model.activation_checkpointing_enable()
    line, _, offload = choose_activation_checkpointing(_parts(model), True)
    assert line.startswith("qwen35_accel's (each decoder layer and vision block; Transformers' gradient checkpointing was on "
                           "too and is turned off on them, so nothing is checkpointed twice)"), line
    assert not any(m.gradient_checkpointing for m in (*model.model.language_model.layers, *model.model.visual.blocks))

    frozen = build_tiny_vlm(seed=0)
    frozen.model.visual.requires_grad_(False)
    frozen.activation_checkpointing_enable()
    line, _, offload = choose_activation_checkpointing(_parts(frozen), True)
    assert line == ("qwen35_accel's (each decoder layer, not the frozen vision tower, which keeps no activations; Transformers' "
                    "gradient checkpointing was on too and is turned off on them, so nothing is checkpointed twice; "
                    "Transformers' gradient checkpointing on 2 vision blocks)"), line
    assert all(block.gradient_checkpointing for block in frozen.model.visual.blocks)
    assert choose_activation_checkpointing(_parts(build_tiny_vlm(seed=0)), True) == ("qwen35_accel's (each decoder layer and vision block)", True, False)
    assert not offload


def test_neither_offload_switch_is_dropped():
    """Accelerate's `fsdp_activation_checkpointing_offload` turns ours on; Transformers' `offload=True`
    (`gradient_checkpointing_kwargs`) carries over to ours where ours replaces Transformers'
    checkpointing, ours takes Transformers' over where it covers every decoder layer, and it stays
    Transformers' (its `save_on_cpu`) where it covers only some (`every_n_layers`)."""
    from qwen35_accel.parallel.activation_checkpointing import choose_activation_checkpointing
    from qwen35_accel.testing.tiny import build_tiny_causal_lm

    accelerates = "Accelerate's fsdp_activation_checkpointing_offload"
    line, ours, offload = choose_activation_checkpointing(_parts(build_tiny_causal_lm(seed=0)), True, True, accelerates)
    assert ours and offload and line == ("qwen35_accel's (each decoder layer; their saved inputs in host memory "
                                         "(Accelerate's fsdp_activation_checkpointing_offload))"), line
    # A custom loop's option is credited as the option, not as Accelerate's config.
    line, ours, offload = choose_activation_checkpointing(_parts(build_tiny_causal_lm(seed=0)), True, offload=True)
    assert ours and offload and line.endswith("(activation_offload=True))"), line
    for plugin_ac in (True, False):
        model = build_tiny_causal_lm(seed=0)
        model.activation_checkpointing_enable(offload=True)
        line, ours, offload = choose_activation_checkpointing(_parts(model), plugin_ac)
        assert ours and offload and "their saved inputs in host memory (Transformers' offload)" in line, line
        assert ("is turned off on them" if plugin_ac else "in place of Transformers' gradient checkpointing with offload") in line
        assert not any(layer.gradient_checkpointing for layer in model.model.layers)
    model = build_tiny_causal_lm(seed=0, num_hidden_layers=4)
    model.activation_checkpointing_enable(offload=True, every_n_layers=2)
    assert choose_activation_checkpointing(_parts(model), False) == (
        "Transformers' gradient checkpointing (2 of 4 decoder layers; saved inputs in host memory (Transformers' offload))",
        False, False)
    model = build_tiny_causal_lm(seed=0)
    model.activation_checkpointing_enable()  # without offload: nothing claims host memory
    assert choose_activation_checkpointing(_parts(model), False) == ("Transformers' gradient checkpointing (3 of 3 decoder layers)", False, False)
    assert choose_activation_checkpointing(_parts(model), True)[1:] == (True, False)




def test_offload_prefetches_the_layer_before_while_backward_unpacks_a_layer():
    """One process, the copy path on CPU (`always_copy`): when backward unpacks layer i's saved
    input (its recompute starts) the offload copies layer i-1's back ahead of time, each
    prefetched tensor is handed over once (only the last layer's input, the first unpacked,
    is copied back on demand), nothing of a step outlives its graph, and the loss and every
    gradient are bitwise those of checkpointing without offload."""
    import weakref

    from qwen35_accel.model.detect import qwen35_parts
    from qwen35_accel.parallel.activation_checkpointing import apply_activation_checkpointing
    from qwen35_accel.parallel.activation_offload import ActivationOffload
    from qwen35_accel.testing.tiny import build_tiny_causal_lm, random_batch

    layers = 4
    results = {}
    for offload in (None, ActivationOffload(always_copy=True, record_order=True)):
        model = build_tiny_causal_lm(seed=0, num_hidden_layers=layers)
        apply_activation_checkpointing(qwen35_parts(model).decoder_layers, offload)
        loss = model(**random_batch(2, 32, model.config.vocab_size, seed=7)).loss
        if offload is not None:
            last_call = weakref.ref(offload._last())
            stats = offload.stats
            hidden = 2 * 32 * model.config.hidden_size * 4  # one layer's input hidden states, fp32
            assert (stats.moved_tensors, stats.moved_bytes, stats.order) == (layers, layers * hidden, []), stats
        loss.backward()
        results[offload is not None] = loss.detach(), {name: p.grad for name, p in model.named_parameters()}
        del loss
    assert last_call() is None  # the layer calls' groups lived as long as the graph, not longer
    assert stats.order == [("unpack", 3), ("prefetch", 2), ("unpack", 2), ("prefetch", 1), ("unpack", 1),
                           ("prefetch", 0), ("unpack", 0)], stats.order
    assert (stats.prefetched_tensors, stats.prefetched_bytes, stats.unprefetched_tensors) == (layers - 1, (layers - 1) * hidden, 1), stats
    (loss_off, grads_off), (loss_on, grads_on) = results[False], results[True]
    assert torch.equal(loss_on, loss_off)
    for name, grad in grads_off.items():
        assert torch.equal(grads_on[name], grad), name  # the same recompute from the same inputs: the same bits


def _scaled_layers_in_place_between(offload):
    """Four checkpointed layers `tanh(linear(x)) * scale` offloaded by `offload`, the scale one
    tensor object written in place (doubled) after the second layer: runs the forward and
    backward; returns (the offload's stats after the forward, [(grad, the reference's grad)]),
    the reference being the same layers unchecked with the doubled scale a new tensor."""
    from torch import nn

    from qwen35_accel.parallel.activation_checkpointing import apply_activation_checkpointing

    class Scaled(nn.Linear):
        def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
            return torch.tanh(super().forward(x)) * scale

    torch.manual_seed(0)
    width = 16
    layers = nn.ModuleList(Scaled(width, width) for _ in range(4))
    x, scale = torch.randn(8, width), torch.rand(8, width) + 0.5
    y = x
    for layer, s in zip(layers, (scale, scale, scale * 2, scale * 2)):
        y = layer(y, s)
    y.square().sum().backward()
    grads_want = [p.grad.clone() for p in layers.parameters()]
    layers.zero_grad(set_to_none=True)

    apply_activation_checkpointing(layers, offload)
    shared = scale.clone()
    y = x
    for i, layer in enumerate(layers):
        if i == 2:
            shared.mul_(2)  # in place, after layers 0 and 1 saved it: a new version
        y = layer(y, shared)
    stats = dataclasses.replace(offload.stats)
    y.square().sum().backward()
    return stats, list(zip((p.grad for p in layers.parameters()), grads_want))


def test_offload_copies_a_tensor_saved_by_several_layers_to_the_host_once():
    """A tensor object that several checkpointed layers of one forward save (as positional
    arguments: Transformers 5.24 passes its rotary cos/sin by keyword, which the checkpoint keeps
    in its recompute closure instead) is copied to the host once; modified in place between two
    layers, it is copied again, and each layer's recompute gets the value it was called with
    (repeated unpacks: `test_offload_unpacks_a_group_out_of_order_or_twice`; a second backward
    through a retained graph fails inside torch's composable checkpoint before any unpack)."""
    from qwen35_accel.parallel.activation_offload import ActivationOffload

    stats, grads = _scaled_layers_in_place_between(ActivationOffload(always_copy=True))
    nbytes = 8 * 16 * 4  # the scale, fp32
    # Saved: each layer's input and the shared scale; the scale's copy reused by layers 1 and 3.
    assert (stats.tensors, stats.moved_tensors, stats.deduplicated_tensors, stats.deduplicated_bytes) == (8, 6, 2, 2 * nbytes), stats
    for got, want in grads:
        assert torch.equal(got, want)


def test_offload_unpacks_a_group_out_of_order_or_twice():
    """Unpacked in another order than backward's, or again, a saved input is copied back on
    demand from its host copy (no prefetch of a group already unpacked), the same values."""
    from qwen35_accel.parallel.activation_offload import ActivationOffload, _LayerCall

    offload = ActivationOffload(always_copy=True, record_order=True)
    first = _LayerCall(0, None)
    second = _LayerCall(1, first)
    inputs = torch.randn(4, 8), torch.randn(4, 8)
    packed = offload.pack(first, inputs[0]), offload.pack(second, inputs[1])
    for index in (0, 1, 1, 0):  # the layer before first, then each again
        assert torch.equal(offload.unpack(packed[index]), inputs[index])
    stats = offload.stats
    assert (stats.moved_tensors, stats.prefetched_tensors, stats.unprefetched_tensors) == (2, 0, 4), stats
    assert stats.order == [("unpack", 0), ("unpack", 1)], stats.order


class _DeferredStream:
    """A stream whose queued copies run only when an event recorded after them is waited on (or a
    later copy needs them): what a CUDA side stream may do, made visible on CPU."""

    def __init__(self) -> None:
        self.queue: list = []
        self.done = 0

    def record_event(self):
        return (self, len(self.queue))

    def wait_event(self, event) -> None:
        stream, upto = event
        while stream.done < upto:
            stream.queue[stream.done]()
            stream.done += 1


def _deferred_streams():
    from qwen35_accel.parallel.activation_offload import DeviceStreams

    class DeferredStreams(DeviceStreams):
        def __init__(self) -> None:
            super().__init__()
            self.side_stream, self.current_stream = _DeferredStream(), _DeferredStream()

        def side(self, device):
            return self.side_stream if device.type == "cpu" else None

        def current(self, device):
            return self.current_stream

        def copy_into(self, stream, destination, source):
            stream.queue.append(lambda: destination.copy_(source))
            return stream.record_event()

        def copy_to_device(self, stream, host, device):
            stream.wait_event(stream.record_event())  # in stream order: after the copies out
            return host.clone(), stream.record_event()

        def keep_until_done(self, tensor, stream) -> None:
            pass  # CPU memory: nothing to keep

    return DeferredStreams()


def test_offload_copies_out_before_a_later_in_place_write_on_a_deferred_stream():
    """The copy to the host runs on a side stream; a saved input written in place after its
    layer (autograd's version check is off for packed tensors) must still reach the host as the
    layer saw it. With a stream whose copies run only when waited on, the layers' recomputes get
    the values they were called with only if the current stream waits on a layer's copies when
    its forward ends (before that wait, layers 0 and 1 recomputed with the doubled scale)."""
    from qwen35_accel.parallel.activation_offload import ActivationOffload

    streams = _deferred_streams()
    stats, grads = _scaled_layers_in_place_between(ActivationOffload(pin_memory=False, always_copy=True, streams=streams))
    assert stats.moved_tensors == 6 and streams.side_stream.queue  # the copies went through the side stream
    for got, want in grads:
        assert torch.equal(got, want)
