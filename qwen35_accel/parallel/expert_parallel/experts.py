"""Expert parallelism for Qwen3.5-MoE (issue 46, slice 4; docs/moe_design.md).

`ep` ranks each hold `num_experts / ep` whole experts of every MoE layer. The ranks that
compute (dp_shard × cp, the FSDP2 shard dim of the dense layers) are viewed a second way,
as `efsdp × ep` (as Transformers 5.24+ and torchtitan carve it): the `ep` ranks of a group hold
different experts and exchange tokens, the `efsdp` ranks holding the same experts shard them
with FSDP2. Routing, the router's loss and the shared expert stay where Transformers puts them
(in the decoder layer, per token, local); only the routed experts' forward changes.

Transformers' pieces are used as they are, because this layout is their contract:
`MoEParamShard` holds each expert weight as a `Shard(0)` DTensor over `ep` (whole experts,
`num_experts` set to the local count) and `EpDispatchExpertsParallel` with `AllToAllEP` moves
every (token, expert) pair to its expert's rank and back (counts first, one all-to-all; dropless;
the local experts run with unit weights and the routing weights are applied on the sender).
They need each rank to hold its own tokens, which is what dp and cp give (cp: distinct chunks of
a row), and a "batch" mesh of the ranks sharing one batch, which without TP is each rank alone
(the size-1 dim `ep_batch` below).

Gradients: an expert's gradient on a rank sums the tokens of the `ep` group that went to it
(the all-to-all's backward); FSDP2 over `efsdp` (× `dp_replicate`) sums the other groups'; the
divide factor is then every data-parallel rank (dp_replicate × dp_shard × cp), as for the dense
units, so the result is their mean, as one process on the whole batch.
"""

from __future__ import annotations

import dataclasses

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.tensor import Shard

from ...model.detect import Qwen35Parts
from .over_tensor_parallel import _check_over_tensor_parallel, describe_held
from ..fsdp import shard_unit
from ..mesh import ParallelDims
from .router import EXPERT_WEIGHTS

# The expert view of the data-parallel ranks: replicas, the FSDP2 shard dim of the experts, the
# expert-parallel dim, and the ranks sharing one batch (1 without TP: AllToAllEP's `tp_mesh`).
EXPERT_DIMS: tuple[str, str, str, str] = ("dp_replicate", "efsdp", "ep", "ep_batch")
# AllToAllEP: training needs the token exchange (AllReduceEP serves ranks sharing one batch only).
EP_IMPLEMENTATION = "all_to_all"
EXPERT_MESH_ATTR = "_qwen35_expert_mesh"  # on each experts module split here: its ExpertMesh


def check_expert_parallel(parts: Qwen35Parts, *, ep: int, data_ranks: int, dp_replicate: int, tp_size: int) -> None:
    """Raise, the same on every rank (sizes and classes only), where `ep` cannot apply.

    `data_ranks`: the ranks of the dense FSDP2 shard dim (dp_shard × cp) that `ep` divides.
    No-op for `ep` 1."""
    if not isinstance(ep, int) or isinstance(ep, bool) or ep < 1:
        raise ValueError(f"ep={ep!r}: expected a positive integer (1: no expert parallelism)")
    if ep == 1:
        return
    if not parts.moe_blocks:
        raise ValueError(f"ep={ep}: expert parallelism needs a MoE model (Qwen3.5-MoE, Qwen3-Next); this one is "
                         f"{parts.family} (no experts)")
    num_experts = parts.text_model.config.num_experts
    if num_experts % ep:
        raise ValueError(f"ep={ep} does not divide the model's {num_experts} experts per layer: choose an ep that does")
    if data_ranks % ep:
        tp_part = f" x tp {tp_size}" if tp_size > 1 else ""
        raise ValueError(
            f"ep={ep} does not divide the {data_ranks} ranks of dp_shard x cp it is carved from "
            f"(world {data_ranks * dp_replicate * tp_size} = dp_replicate {dp_replicate} x dp_shard x cp {data_ranks}{tp_part}): "
            "choose an ep that divides dp_shard x cp"
        )
    if tp_size > 1:
        _check_over_tensor_parallel(ep=ep, tp_size=tp_size, num_experts=num_experts, data_ranks=data_ranks,
                                    dp_replicate=dp_replicate)


@dataclasses.dataclass(frozen=True)
class ExpertMesh:
    """The expert view of the data-parallel ranks (`EXPERT_DIMS`), one root mesh, so the
    experts' `Shard(0)` DTensors over `ep` and their FSDP2 units over `efsdp` compose."""

    mesh: DeviceMesh

    @property
    def ep(self) -> DeviceMesh:
        return self.mesh["ep"]

    @property
    def batch(self) -> DeviceMesh:
        return self.mesh["ep_batch"]

    @property
    def ep_size(self) -> int:
        return self.mesh["ep"].size()

    @property
    def efsdp_size(self) -> int:
        return self.mesh["efsdp"].size()

    @property
    def fsdp(self) -> DeviceMesh:
        """The experts' FSDP2 mesh: `efsdp`, or (`dp_replicate`, `efsdp`) for HSDP."""
        if self.mesh["dp_replicate"].size() > 1:
            return self.mesh["dp_replicate", "efsdp"]
        return self.mesh["efsdp"]

    @property
    def data_ranks(self) -> int:
        """Every data-parallel rank: the experts' gradient divide factor."""
        return self.mesh.size()


def build_expert_mesh(dims: ParallelDims, ep: int) -> ExpertMesh:
    """The expert view of `dims`' FSDP2 ranks: `(dp_replicate, dp_shard_cp)` read as
    `(dp_replicate, dp_shard_cp / ep, ep, 1)`, consecutive ranks of a shard group in one `ep`
    group. Collective (every rank builds the same mesh). Preconditions: tp 1, and `ep` divides
    dp_shard_cp (`check_expert_parallel`)."""
    ranks = dims.fsdp.mesh  # tp 1: every rank of the world, (dp_shard_cp,) or (dp_replicate, dp_shard_cp)
    if ranks.numel() != dist.get_world_size():
        raise NotImplementedError(
            f"expert parallelism needs the data-parallel dims to span the world ({ranks.numel()} of {dist.get_world_size()} ranks)"
        )
    dp_replicate = dims.dp_replicate
    layout = ranks.reshape(dp_replicate, ranks.numel() // dp_replicate // ep, ep, 1)
    return ExpertMesh(DeviceMesh(dims.mesh.device_type, layout, mesh_dim_names=EXPERT_DIMS))


def install_expert_parallel(parts: Qwen35Parts, mesh: ExpertMesh) -> list[nn.Module]:
    """Split every MoE layer's routed experts over `mesh.ep` and route tokens to them by
    all-to-all (Transformers' `MoEParamShard` and `EpDispatchExpertsParallel`/`AllToAllEP`).
    Before FSDP2, after the fp32 gate holders. Returns the experts modules."""
    experts_modules = []
    for block in parts.moe_blocks:
        split_experts(block.experts, mesh.ep, batch=mesh.batch, implementation=EP_IMPLEMENTATION)
        setattr(block.experts, EXPERT_MESH_ATTR, mesh)
        experts_modules.append(block.experts)
    return experts_modules


def split_experts(experts: nn.Module, mesh: DeviceMesh, *, batch: DeviceMesh, implementation: str) -> None:
    """Hold `experts`' weights as `Shard(0)` DTensors over `mesh` (this rank's whole experts, sliced
    locally: the same weights on every rank, nothing communicated; `num_experts` the local count)
    and reach them through Transformers' `EPImplementation` named `implementation` ("all_to_all":
    tokens to their experts' ranks; "all_reduce": the ranks of `mesh` share one batch, `batch` is
    `mesh`, each runs its experts on every token and the outputs are summed)."""
    from transformers.distributed.expert_parallel import MoEParamShard

    shard = MoEParamShard(Shard(0), shards_expert_dim=True)
    for name in EXPERT_WEIGHTS:
        shard.shard_param(experts, name, mesh)
    dispatch_experts(experts, mesh, batch=batch, implementation=implementation)


def dispatch_experts(experts: nn.Module, mesh: DeviceMesh, *, batch: DeviceMesh, implementation: str) -> None:
    """Route `experts`' tokens through Transformers' `EPImplementation` named `implementation` over
    `mesh` (see `split_experts`); the module holds its local experts already (`num_experts` the local
    count, `_is_expert_parallel` set), as DTensors over `mesh` or as plain local slices."""
    from transformers.distributed.expert_parallel import EpDispatchExpertsParallel

    EpDispatchExpertsParallel().install_forward(experts, mesh, tp_mesh=batch, ep_implementation=implementation)


def shard_experts(
    experts_modules: list[nn.Module],
    mesh: DeviceMesh,
    *,
    mp_policy: MixedPrecisionPolicy,
    offload_policy: OffloadPolicy | None,
    reshard_after_forward: bool | int | None,
    divide_by: int | None = None,
) -> list[FSDPModule]:
    """One FSDP2 unit per experts module split by `split_experts` (its weights DTensors over ep or
    tp), over `mesh`: the ranks holding the same experts (the last dim shards, a first one
    replicates: HSDP). `divide_by` (expert parallelism): the gradients are divided by every
    data-parallel rank, not by `mesh`'s size: each rank's expert gradient already sums an `ep`
    group's tokens. None: FSDP2's average over `mesh` (tp: each rank's experts saw its dp rank's
    tokens only)."""
    units = []
    for experts in experts_modules:
        unit = shard_unit(experts, mesh=mesh, mp_policy=mp_policy, offload_policy=offload_policy or OffloadPolicy(),
                          reshard_after_forward=reshard_after_forward)
        if divide_by is not None:
            unit.set_gradient_divide_factor(float(divide_by))
            if mesh.size(mesh.ndim - 1) > 1:
                # A factor other than the group size is a PREMUL_SUM, which gloo rejects (and NCCL
                # bf16 got wrong up to torch 2.13): sum, then divide locally. With no reduce-scatter
                # (a shard dim of 1) FSDP2 divides in its copy, and a forced sum would divide twice.
                unit.set_force_sum_reduction_for_comms(True)
        units.append(unit)
    return units


def describe_experts(model: nn.Module) -> str:
    """What the prepared line says of a MoE model's routed experts: "ep=1 (every rank holds
    every expert)" or "ep=2 (experts: 3 of 6 per rank per layer, all-to-all; FSDP2 over 1)"."""
    experts = next((m for m in model.modules() if isinstance(getattr(m, EXPERT_MESH_ATTR, None), ExpertMesh)), None)
    total = model.config.get_text_config().num_experts
    held = next((line for m in model.modules() if (line := describe_held(m, total)) is not None), None)
    if held is not None:
        return held
    if experts is None:
        split = next((m for m in model.modules() if getattr(m, "_is_expert_parallel", False)), None)
        if split is not None:  # tensor parallelism split them (`tensor_parallel.apply_tensor_parallel`)
            return (f"ep=1 (experts: {split.num_experts} of {total} per rank per layer, split over the tp ranks, "
                    "which share the tokens)")
        return "ep=1 (every rank holds every expert)"
    mesh: ExpertMesh = getattr(experts, EXPERT_MESH_ATTR)
    units = mesh.fsdp.size()
    return (f"ep={mesh.ep_size} (experts: {experts.num_experts} of {experts.num_experts * mesh.ep_size} per rank per "
            f"layer, all-to-all; their FSDP2 units over {units} rank{'s' if units > 1 else ''})")
