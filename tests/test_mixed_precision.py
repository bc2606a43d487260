"""Mixed precision: the problem FSDP2 has with Qwen3.5, and the gate holder's fp32 unit."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from _dist import run_world
from _parity import full

pytestmark = pytest.mark.multiprocess

GATE = ("A_log", "dt_bias")


def _bf16_model_with_fp32_gate_params():
    """Unmodified Transformers model as a bf16 checkpoint with fp32 A_log/dt_bias loads."""
    from qwen35_accel.testing.tiny import build_tiny_causal_lm

    model = build_tiny_causal_lm(seed=0)
    for name, p in model.named_parameters():
        if not name.endswith(GATE):
            p.data = p.data.to(torch.bfloat16)
    return model


def _train_steps(model, steps: int, rank: int) -> list[float]:
    from qwen35_accel.testing.tiny import random_batch

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = random_batch(2, 32, model.config.vocab_size, seed=rank)
    losses = []
    for _ in range(steps):
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _repro_worker(rank: int, world: int) -> None:
    from qwen35_accel import PARALLELIZER

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard_cp",))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

    plain = _bf16_model_with_fp32_gate_params()
    for layer in plain.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(plain, mesh=mesh, mp_policy=policy)
    with pytest.raises(AssertionError, match="FSDP expects uniform original parameter dtype"):
        plain(input_ids=torch.ones(1, 8, dtype=torch.long))

    ours = PARALLELIZER.apply(_bf16_model_with_fp32_gate_params(), mesh, mp_policy=policy)
    losses = _train_steps(ours, 6, rank)
    assert all(torch.isfinite(torch.tensor(losses))), losses
    # 6 AdamW steps at lr 1e-2 on one fixed batch memorise it; updates that never reach the weights stay at 1x.
    assert losses[-1] < 0.8 * losses[0], losses


def test_plain_fully_shard_fails_on_fp32_gate_params_and_parallelizer_trains():
    run_world(_repro_worker, 2)


def _precision_worker(rank: int, world: int, layout: str, compute_dtype: torch.dtype) -> None:
    from qwen35_accel import PARALLELIZER
    from qwen35_accel.model.fp32_gate import HOLDER_NAME
    from qwen35_accel.testing.tiny import build_tiny_causal_lm, random_batch

    if layout == "fp32_master":
        model = build_tiny_causal_lm(seed=0)
        storage = torch.float32
    else:  # bf16 storage; install_fp32_gate (inside apply) keeps the holder fp32
        model = build_tiny_causal_lm(seed=0, dtype=torch.bfloat16)
        storage = torch.bfloat16
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard_cp",))
    PARALLELIZER.apply(model, mesh, mp_policy=MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32))

    gdns = [layer.linear_attn for layer in model.model.layers if layer.block_type == "linear_attention"]
    masters = {}
    for i, gdn in enumerate(gdns):
        holder = getattr(gdn, HOLDER_NAME)
        masters[i] = {n: full(getattr(holder, n)).detach().clone() for n in GATE}
        assert all(m.dtype == torch.float32 for m in masters[i].values())

    seen: dict[str, list] = {"holder": [], "gate": [], "layer": []}

    def holder_pre_hook(i):
        def hook(module, args):
            for n in GATE:
                p = getattr(module, n)
                seen["holder"].append((i, n, p.dtype, torch.equal(p, masters[i][n])))
        return hook

    def gate_hook(module, args, output):
        seen["gate"].append(output.dtype)

    def layer_pre_hook(module, args, kwargs):
        seen["layer"].append({n: p.dtype for n, p in module.named_parameters() if HOLDER_NAME not in n})

    for i, gdn in enumerate(gdns):
        getattr(gdn, HOLDER_NAME).register_forward_pre_hook(holder_pre_hook(i))
        getattr(gdn, HOLDER_NAME).register_forward_hook(gate_hook)
        gdn.register_forward_pre_hook(layer_pre_hook, with_kwargs=True)

    loss = model(**random_batch(2, 32, model.config.vocab_size, seed=rank)).loss
    loss.backward()

    assert len(seen["holder"]) == 2 * len(gdns) and len(seen["layer"]) == len(gdns)
    for i, n, dtype, equal in seen["holder"]:
        assert dtype == torch.float32, f"layer {i} {n} gathered as {dtype}"
        assert equal, f"layer {i} {n}: gathered value differs from the fp32 master"
    assert set(seen["gate"]) == {torch.float32}
    for dtypes in seen["layer"]:
        assert set(dtypes.values()) == {compute_dtype}, dtypes
    for name, p in model.named_parameters():
        expected = torch.float32 if name.endswith(GATE) else storage
        assert p.dtype == expected and p.grad is not None and p.grad.dtype == expected, name
        assert torch.isfinite(full(p.grad)).all(), name


@pytest.mark.parametrize(
    "layout,compute_dtype",
    # fp16 in the fast tier; the bf16 policy there is test_cp_model's, test_lora's and test_accelerate_plugin's.
    [pytest.param("fp32_master", torch.bfloat16, marks=pytest.mark.slow), pytest.param("bf16_storage", torch.bfloat16, marks=pytest.mark.slow),
     ("fp32_master", torch.float16)],
    ids=["fp32-master-bf16-policy", "bf16-storage-bf16-policy", "fp32-master-fp16-policy"],
)
def test_gate_holder_gathers_fp32_master_while_layer_computes_in_policy_dtype(layout, compute_dtype):
    run_world(_precision_worker, 2, layout, compute_dtype)
