"""The collectives under CP and TP, every branch on gloo: the flat reduce-scatter NCCL takes
(forced here), gloo's all-to-all, the flat all-gather, and the collective names of every torch
the metadata admits (2.11/2.12 have only `reduce_scatter_tensor` / `all_gather_into_tensor`)."""

from __future__ import annotations

import types
import warnings

import pytest
import torch

from tests._dist import run_world

pytestmark = pytest.mark.multiprocess


def _collectives_worker(rank: int, world: int) -> None:
    import torch.distributed as dist

    group = dist.group.WORLD
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # a deprecated collective name fails the test
        _check_collectives(rank, world, group)


def _check_collectives(rank: int, world: int, group) -> None:
    import torch.distributed as dist

    from qwen35_accel.parallel import collectives as c

    # [world, 3, 2] per rank, distinct per rank and slot: slot r of every rank sums onto rank r.
    stacks = [torch.arange(world * 6, dtype=torch.float64).view(world, 3, 2) * (r + 1) + r for r in range(world)]
    expected = sum(stack[rank] for stack in stacks)
    for all_to_all in (None, True, False):  # None: by backend (gloo: all-to-all); False: NCCL's branch
        got = c.reduce_scatter_stack(stacks[rank].clone(), group, all_to_all=all_to_all)
        assert torch.equal(got, expected), (all_to_all, got, expected)
    # bf16 (CP's dK/dV): every branch sums in fp32 and rounds once (NCCL's own bf16 reduce-scatter
    # rounds at each ring step; the flat branch widens to fp32 beyond 2 ranks).
    small = [torch.full((world, 3), 1.0 if r == 0 else 2.0**-9, dtype=torch.bfloat16) for r in range(world)]
    once = sum(t[rank].float() for t in small).bfloat16()
    for all_to_all in (True, False):
        assert torch.equal(c.reduce_scatter_stack(small[rank].clone(), group, all_to_all=all_to_all), once), all_to_all
    # torch 2.11/2.12: only the older names exist; the resolver falls back and they compute the same.
    older = types.SimpleNamespace(reduce_scatter_tensor=dist.reduce_scatter_tensor, all_gather_into_tensor=dist.all_gather_into_tensor)
    newer = types.SimpleNamespace(reduce_scatter_single=dist.reduce_scatter_single, reduce_scatter_tensor=None)
    assert c.flat_collective(newer, "reduce_scatter_single", "reduce_scatter_tensor") is dist.reduce_scatter_single
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # deprecated on 2.13, the only names on 2.11/2.12
        out = torch.empty(3, 2, dtype=torch.float64)
        c.flat_collective(older, "reduce_scatter_single", "reduce_scatter_tensor")(out.view(-1), stacks[rank].view(-1), group=group)
        assert torch.equal(out, expected)
        gathered = torch.empty(world, 2, dtype=torch.float64)
        c.flat_collective(older, "all_gather_single", "all_gather_into_tensor")(gathered.view(-1), torch.full((2,), float(rank), dtype=torch.float64), group=group)
        assert torch.equal(gathered, torch.arange(world, dtype=torch.float64)[:, None].expand(world, 2))

    # all_gather_with_grad: the flat gather in rank order; backward = the sum over ranks of the
    # gradient of each rank's own slot (weights differ per rank so a wrong slot shows).
    x = torch.randn(4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(rank)).requires_grad_()
    gathered = c.all_gather_with_grad(x, group)
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.detach())
    assert torch.equal(gathered.detach(), torch.stack(parts))
    weights = torch.arange(1, world * 12 + 1, dtype=torch.float64).view(world, 4, 3) * (rank + 1)
    (gathered * weights).sum().backward()
    expected_grad = sum(torch.arange(1, world * 12 + 1, dtype=torch.float64).view(world, 4, 3)[rank] * (r + 1) for r in range(world))
    assert torch.equal(x.grad, expected_grad), (x.grad, expected_grad)

    # Megatron's g: the caller's tensor is not reduced in place (contiguous or not).
    for y in (torch.ones(2, 3), torch.ones(3, 2).t()):
        before = y.clone()
        total = c.reduce_from_group(y, group)
        assert torch.equal(y, before) and torch.equal(total, before * world)


def test_collectives_every_branch_and_torch_name_match_the_definition() -> None:
    run_world(_collectives_worker, 2)


def test_the_package_calls_no_deprecated_or_missing_collective_name():
    """Every flat collective goes through `collectives`' resolved names: `all_gather_into_tensor`
    / `reduce_scatter_tensor` warn per call on torch 2.13, `*_single` do not exist on 2.11/2.12."""
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[1] / "qwen35_accel"
    calls = [
        f"{path.relative_to(root)}:{n}"
        for path in root.rglob("*.py")
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"dist\.(all_gather_into_tensor|reduce_scatter_tensor|reduce_scatter_single|all_gather_single)\(", line)
    ]
    assert not calls, calls
