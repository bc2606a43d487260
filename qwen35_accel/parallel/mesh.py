"""The parallel dims of a device mesh: names, sizes and sub-meshes in one small object.

Accelerate's `ParallelismConfig` builds a mesh with dims `dp_replicate`, `dp_shard`, `cp`,
`tp` (those of size > 1) and flattened dims `dp`, `dp_shard_cp`, `dp_cp`; custom loops
build their own. `ParallelDims` answers, for the names the parallelizer uses, whether the
mesh has the dim, its size and its sub-mesh (`sub_mesh`: public slicing, torch's notice about slicing
flattened dims silenced there alone).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

# Flattened dims Accelerate's ParallelismConfig creates (probed when listing a mesh's dims).
ACCELERATE_FLATTENED_DIMS: tuple[str, ...] = ("dp", "dp_shard_cp", "dp_cp")


# torch (2.11-2.15) finds a flattened dim by slicing the root mesh by its name, and warns that this
# slicing "will be deprecated" without a public way to reach the flattened mesh otherwise (it keeps it in
# private state). The slicing is the public API; only that one notice is silenced, here.
_FLATTENED_SLICE_NOTICE = "Slicing a flattened dim from root mesh will be deprecated"


def sub_mesh(mesh: DeviceMesh, names: str | tuple[str, ...]) -> DeviceMesh:
    """`mesh[names]` (a name may also be a dim flattened from `mesh`'s root: Accelerate's `dp_shard_cp`,
    `dp`, `dp_cp`), without torch's notice about slicing flattened dims. KeyError for a name the mesh
    does not have."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_FLATTENED_SLICE_NOTICE)
        return mesh[names]


def has_dim(mesh: DeviceMesh, name: str) -> bool:
    """Whether `sub_mesh(mesh, name)` resolves: one of its own dims or one flattened from its root."""
    if name in (mesh.mesh_dim_names or ()):
        return True
    try:
        sub_mesh(mesh, name)
    except (KeyError, RuntimeError, ValueError):
        return False
    return True


def mesh_dim_names(mesh: DeviceMesh, extra: tuple[str, ...] = ()) -> list[str]:
    """The mesh's own dims, then those of Accelerate's flattened dims (and `extra`) it resolves."""
    names = list(mesh.mesh_dim_names or ())
    for name in (*ACCELERATE_FLATTENED_DIMS, *extra):
        if name not in names and has_dim(mesh, name):
            names.append(name)
    return names


def mesh_dim_size(mesh: DeviceMesh, name: str) -> int:
    """Size of the named dim; 1 if the mesh has no such dim."""
    return sub_mesh(mesh, name).size() if has_dim(mesh, name) else 1


def mesh_device(mesh: DeviceMesh) -> torch.device:
    """The device this rank computes on for `mesh` (its local accelerator, or the CPU)."""
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(mesh.device_type, torch.get_device_module(mesh.device_type).current_device())


@dataclasses.dataclass(frozen=True)
class ParallelDims:
    """The dims the parallelizer uses, on one device mesh.

    `fsdp` is the mesh FSDP2 shards over: (`dp_replicate`, `dp_shard_cp`) for HSDP when the
    replicate dim is larger than 1, else `dp_shard_cp`. `cp` and `tp` are None when their
    dim is absent or of size 1.
    """

    mesh: DeviceMesh
    dp_replicate_name: str = "dp_replicate"
    dp_shard_cp_name: str = "dp_shard_cp"
    cp_name: str = "cp"
    tp_name: str = "tp"

    @classmethod
    def from_parallelism_config(cls, config: Any, device_type: str) -> ParallelDims:
        """From Accelerate's `ParallelismConfig` (its dim names); a 1-process config, which
        builds no mesh, gets a 1-rank `dp_shard_cp` mesh."""
        mesh = config.build_device_mesh(device_type)
        if mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh(device_type, (1,), mesh_dim_names=("dp_shard_cp",))
        return cls(mesh)

    def __post_init__(self) -> None:
        if not has_dim(self.mesh, self.dp_shard_cp_name):
            raise ValueError(
                f"device_mesh has no dim named {self.dp_shard_cp_name!r} (dims: {mesh_dim_names(self.mesh)}). Pass the "
                "name of the FSDP shard dim as dp_shard_cp_mesh_name, or build the mesh with it (Accelerate's "
                "ParallelismConfig names it 'dp_shard_cp')."
            )

    def size(self, name: str) -> int:
        return mesh_dim_size(self.mesh, name)

    @property
    def dp_replicate(self) -> int:
        return self.size(self.dp_replicate_name)

    @property
    def cp_size(self) -> int:
        return self.size(self.cp_name)

    @property
    def tp_size(self) -> int:
        return self.size(self.tp_name)

    @property
    def fsdp(self) -> DeviceMesh:
        if self.dp_replicate > 1:
            return sub_mesh(self.mesh, (self.dp_replicate_name, self.dp_shard_cp_name))
        return sub_mesh(self.mesh, self.dp_shard_cp_name)

    @property
    def cp(self) -> DeviceMesh | None:
        return sub_mesh(self.mesh, self.cp_name) if self.cp_size > 1 else None

    @property
    def tp(self) -> DeviceMesh | None:
        return sub_mesh(self.mesh, self.tp_name) if self.tp_size > 1 else None
