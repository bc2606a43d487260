"""Expert parallelism beside tensor parallelism (ep × tp) for Qwen3.5-MoE (issue 46).

Under tp the routed experts are split whole over the tp ranks (`tensor_parallel.plan`): tp rank
`t` holds experts `[t·E/tp, (t+1)·E/tp)` as plain slices and the tp ranks share their tokens.
With ep on top, each tp rank's block is split once more over the data-parallel ranks of its tp
index (dp_shard × cp, the dense layers' FSDP2 mesh): every rank holds `E / (ep·tp)` whole experts
and never gathers any.

Why not Transformers' layout for it (`AllToAllEP` with a tp mesh, ep carved out of dp × tp, each
tp rank dispatching a slice of the shared batch, the experts FSDP2-sharded on a second device
mesh): gradients would then live on two meshes, and the Trainer computes the norm itself, per
mesh, when they do (`Trainer._mixed_mesh_grad_norm`), skipping the tp ranks' pieces of the split
parameters: a too small norm, clipped by silently. Here the experts are `Shard(0)` DTensors over
the dense FSDP2 mesh itself — the layout FSDP2 gives every other slice, left out of FSDP2
(`ignored_params`): one mesh for every gradient, so the Trainer asks Accelerate for the norm and
the tensor-parallel norm (`tensor_parallel.clipping`) counts the experts like every other slice;
checkpoints and the optimizer's state see them as FSDP2-sharded slices too. The price: ep must
span dp_shard × cp (no FSDP2 copies of an expert to shard), and no HSDP.

Dispatch (`_TensorParallelAllToAll`): each tp rank takes the (token, expert) pairs routed into
its block (the others are its tp peers'), sends them to their experts' ranks over the ep group
(counts first, one all-to-all; dropless), runs its experts, brings the outputs back, weights and
sums them per token, and the tp ranks' partial outputs are summed by one all-reduce (the tokens'
and routing weights' gradients likewise, in backward: each tp rank's are partial).

Gradients: an expert's gradient sums the tokens every rank of its ep group sent it, i.e. the
global batch's (the all-to-all's backward); it is divided by the data-parallel ranks, as FSDP2
divides the dense units', so it is their mean, one process's on the whole batch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from ..collectives import copy_to_group, reduce_from_group
from .router import EXPERT_WEIGHTS

HELD_ATTR = "_qwen35_experts_held"  # on experts split here: (ep, tp); FSDP2 leaves their weights alone


def _check_over_tensor_parallel(*, ep: int, tp_size: int, num_experts: int, data_ranks: int, dp_replicate: int) -> None:
    """Raise, the same on every rank, where ep × tp cannot apply (see the module docstring).
    Precondition: `ep` divides `num_experts` and `data_ranks`."""
    if ep != data_ranks:
        raise NotImplementedError(
            f"ep={ep} with tp {tp_size}: under tensor parallelism ep must span all {data_ranks} ranks of dp_shard x cp "
            f"(each rank then holds num_experts / (ep x tp) experts whole, outside FSDP2); ep={ep} would leave "
            f"{data_ranks // ep} copies of each expert to shard on a second "
            "device mesh, where the Trainer's per-mesh gradient norm skips the tp ranks' pieces. "
            f"Choose ep={data_ranks}, or no tp"
        )
    if dp_replicate > 1:
        raise NotImplementedError(
            f"ep={ep} with tp {tp_size} under HSDP (dp_replicate {dp_replicate}) is not built: the replicas' expert "
            "gradients would need their own all-reduce outside FSDP2. Use FSDP2 without replication, or no tp"
        )
    if num_experts % (ep * tp_size):
        raise ValueError(
            f"ep={ep} x tp {tp_size} = {ep * tp_size} does not divide the model's {num_experts} experts per layer: "
            "each rank holds num_experts / (ep x tp) whole experts"
        )


def hold_experts_over_tensor_parallel(
    experts: nn.Module, ep_mesh: DeviceMesh, tp_mesh: DeviceMesh, *, compute_dtype: torch.dtype | None
) -> None:
    """Split `experts` (this tp rank's block, plain slices, `num_experts` its count: after
    `tensor_parallel.apply_tensor_parallel` sliced it) over `ep_mesh` (the dense FSDP2 mesh,
    1-D: dp_shard × cp) as `Shard(0)` DTensors, sliced locally (nothing communicated), and route
    its tokens with `_TensorParallelAllToAll`. `compute_dtype`: the mixed-precision policy's
    param dtype (FSDP2 casts every other weight to it; these stay outside FSDP2), None to compute
    in the storage dtype. Collective-free; call on every rank alike."""
    ep = ep_mesh.size()
    if ep_mesh.ndim != 1:
        raise NotImplementedError(f"ep x tp needs a 1-D data-parallel mesh, got {ep_mesh}")
    for name in EXPERT_WEIGHTS:
        param = experts._parameters[name]
        experts._parameters[name] = nn.Parameter(
            distribute_tensor(param.detach(), ep_mesh, [Shard(0)], src_data_rank=None), requires_grad=param.requires_grad
        )
    block = experts.num_experts  # this tp rank's experts
    experts.num_experts = block // ep
    dispatch = _TensorParallelAllToAll(experts, ep_mesh.get_group(), tp_mesh.get_group(),
                                       first=tp_mesh.get_local_rank() * block, block=block, compute_dtype=compute_dtype)
    experts.forward = dispatch
    setattr(experts, HELD_ATTR, (ep, tp_mesh.size()))


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient times `scale` (the experts' mean over the data-parallel ranks)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:  # type: ignore[override]
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad * ctx.scale, None


class _TensorParallelAllToAll:
    """The forward of an experts module held by `hold_experts_over_tensor_parallel`:
    `(hidden_states [T, H], top_k_index [T, K] global expert ids, top_k_weights [T, K])` → the
    weighted expert output `[T, H]` of every token, the same on the tp ranks (which share the
    tokens). One host read of the split sizes per call (as any dropless all-to-all)."""

    def __init__(self, experts: nn.Module, ep_group: dist.ProcessGroup, tp_group: dist.ProcessGroup, *, first: int,
                 block: int, compute_dtype: torch.dtype | None) -> None:
        self.experts = experts
        self.experts_forward = experts.forward  # Transformers' forward on local expert ids
        self.ep_group, self.tp_group = ep_group, tp_group
        self.first, self.block = first, block
        self.ep = dist.get_world_size(ep_group)
        self.local = block // self.ep
        self.compute_dtype = compute_dtype

    @contextlib.contextmanager
    def _local_weights(self) -> Iterator[None]:
        """Within: the experts' weights are this rank's local tensors (cast to the compute dtype,
        their gradient scaled by 1 / data-parallel ranks); the DTensor Parameters come back after."""
        params = {name: self.experts._parameters[name] for name in EXPERT_WEIGHTS}
        try:
            for name, param in params.items():
                local = _ScaleGrad.apply(param.to_local() if isinstance(param, DTensor) else param, 1.0 / self.ep)
                self.experts._parameters[name] = local if self.compute_dtype is None else local.to(self.compute_dtype)
            yield
        finally:
            self.experts._parameters.update(params)

    def __call__(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        # The tp ranks share the tokens and each backpropagates through its own experts only:
        # the gradients of the shared inputs are partial, summed over tp in backward.
        hidden = copy_to_group(hidden_states, self.tp_group)
        weights = copy_to_group(top_k_weights, self.tp_group)
        num_tokens, top_k = top_k_index.shape
        ids = top_k_index.reshape(-1)
        mine = (ids >= self.first) & (ids < self.first + self.block)
        # Pairs of this tp rank's block sorted by expert (so by owner rank), the others after them
        # (the sentinel `block`); the counts tell each receiver whose expert a row is for.
        block_ids = torch.where(mine, ids - self.first, self.block)
        order = torch.argsort(block_ids, stable=True)
        counts = torch.zeros(self.block + 1, dtype=torch.long, device=ids.device)
        counts = counts.scatter_add_(0, block_ids, torch.ones_like(block_ids))
        send_counts = counts[: self.block].reshape(self.ep, self.local)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.ep_group)
        send_sizes, recv_sizes = torch.stack([send_counts.sum(dim=1), recv_counts.sum(dim=1)]).tolist()
        kept = order[: sum(send_sizes)]
        tokens = kept // top_k
        received = wait_tensor(all_to_all_single_autograd(hidden[tokens], recv_sizes, send_sizes, self.ep_group))
        local_ids = torch.arange(self.local, device=ids.device).repeat(self.ep)
        local_ids = local_ids.repeat_interleave(recv_counts.reshape(-1), output_size=sum(recv_sizes)).unsqueeze(-1)
        with self._local_weights():
            if received.shape[0] == 0:
                # Keep the empty exchange in the graph: its backward is collective over the ep group.
                out = self.experts_forward(received.sum(dim=0, keepdim=True), local_ids.new_zeros((1, 1)),
                                           received.new_ones((1, 1)))[:0]
            else:  # top-1 with unit weights; the routing weights are applied here, on the sender
                out = self.experts_forward(received, local_ids, torch.ones_like(local_ids, dtype=received.dtype))
        returned = wait_tensor(all_to_all_single_autograd(out, send_sizes, recv_sizes, self.ep_group))
        weighted = returned * weights.reshape(-1)[kept].unsqueeze(-1).to(returned.dtype)
        output = torch.zeros(num_tokens, returned.shape[-1], dtype=returned.dtype, device=returned.device)
        output = output.index_add(0, tokens, weighted)
        return reduce_from_group(output, self.tp_group).to(hidden_states.dtype)


def describe_held(experts: nn.Module, num_experts: int) -> str | None:
    """The prepared line's words for experts held here, or None."""
    held = getattr(experts, HELD_ATTR, None)
    if held is None:
        return None
    ep, tp = held
    return (f"ep={ep} (experts: {experts.num_experts} of {num_experts} per rank per layer, split over ep {ep} x tp {tp}; "
            "all-to-all over ep, summed over tp; held whole, outside FSDP2)")
