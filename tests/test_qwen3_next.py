"""Qwen3-Next (issue 61): the third family with a GatedDeltaNet. Its gates take the fp32 holder, its
decoder layers the dtype-uniform FSDP2 units, its layers the CP and TP layers, its experts EP, its causal LM
the tiled loss (its forward is Qwen3.5-MoE's, the router's loss included). The oracle is the unmodified Transformers
`Qwen3NextForCausalLM` in one process (fp32 rtol 1e-5: ranks sum in another order)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from _dist import run_world
from _parity import assert_close, assert_grads_match, documents_alone
from qwen35_accel.model.detect import FAMILIES, qwen35_family, qwen35_parts
from qwen35_accel.model.fp32_gate import install_fp32_gate
from qwen35_accel.testing.tiny import build_tiny_next_causal_lm, packed_documents, random_batch


def test_its_gates_move_to_the_fp32_holder_and_it_computes_as_transformers_bitwise():
    """The fp32-gate layer's projections are Qwen3-Next's per-key-group layout (`in_proj_qkvz`,
    `in_proj_ba`): the same loss bitwise, every gradient, the gates named as Transformers names them."""
    reference = build_tiny_next_causal_lm(seed=0)
    model = copy.deepcopy(reference)
    parts = qwen35_parts(model, families=FAMILIES)
    assert qwen35_family(model) == "next" and parts.layer_types == ("linear_attention", "linear_attention", "full_attention")
    assert len(parts.moe_blocks) == 3 and parts.final_norm is model.model.norm and parts.lm_head is model.lm_head
    assert install_fp32_gate(model) == 2
    assert model.model.layers[0].linear_attn._fp32_params.A_log.dtype == torch.float32
    batch = random_batch(2, 24, reference.config.vocab_size, seed=1)
    want, got = reference(**batch), model(**batch)
    assert torch.equal(got.loss, want.loss)  # the same ops in the same order
    want.loss.backward()
    got.loss.backward()
    assert assert_grads_match(model, reference) == len(list(reference.parameters()))
    assert {n for n, _ in model.named_parameters()} == {n for n, _ in reference.named_parameters()}


def test_every_document_of_a_packed_row_equals_the_document_alone():
    """Packed rows (position_ids restarting): each document computes as alone, as for Qwen3.5 (the
    unmodified model lets the GatedDeltaNet state and conv run across the boundaries)."""
    reference = build_tiny_next_causal_lm(seed=0)
    model = copy.deepcopy(reference)
    install_fp32_gate(model)
    batch, documents = packed_documents([20, 3, 41], reference.config.vocab_size, seed=2)
    out = model(**batch)
    want_logits, want_loss = documents_alone(reference, documents)
    assert_close(out.logits, want_logits, "logits")
    assert_close(out.loss, want_loss, "loss")
    with torch.no_grad():  # the comparison can fail: stock leaks across the documents
        assert not torch.allclose(reference(**batch).logits, want_logits, rtol=1e-3, atol=1e-3)


def _fsdp_worker(rank: int, world: int) -> None:
    from qwen35_accel import PARALLELIZER
    from qwen35_accel.parallel.fsdp import describe_units
    from test_cp_model import cp_mesh
    from test_fsdp_parity import accelerate_style_mesh

    for mesh in (cp_mesh(world, 1), accelerate_style_mesh(world, dp_replicate=world)):  # FSDP2, then HSDP
        reference = build_tiny_next_causal_lm(seed=0)
        model = copy.deepcopy(reference)
        PARALLELIZER.apply(model, mesh, activation_checkpointing=True)
        units = {row["unit"]: (row["storage"], row["compute"]) for row in describe_units(model)}
        assert units["model.layers.0.linear_attn._fp32_params"] == ("float32", "float32"), units
        assert {"model.layers.2", "model.norm+lm_head"} <= set(units), units
        batch = random_batch(4, 24, reference.config.vocab_size, seed=3)
        want = reference(**batch)  # the mean over 4 rows of equal length: the mean of the ranks' 2-row means
        want.loss.backward()
        mine = {key: value[2 * rank: 2 * rank + 2] for key, value in batch.items()}
        got = model(**mine)
        got.loss.backward()
        assert assert_grads_match(model, reference) > 0  # routers, experts, shared experts and gates included
        # The router's balance over the global batch (QWEN35_ACCEL_MOE_BALANCE=global): its sums reduced over dp_shard.
    from qwen35_accel.model.state import state_of

    model = PARALLELIZER.apply(build_tiny_next_causal_lm(seed=0), cp_mesh(world, 1), moe_balance="global")
    assert state_of(model).balance_group is not None
    dist.barrier()


@pytest.mark.multiprocess
def test_fsdp2_and_hsdp_with_fp32_gate_units_train_as_one_process():
    run_world(_fsdp_worker, 2)


def _tp_worker(rank: int, world: int, dp: int) -> None:
    from qwen35_accel import PARALLELIZER
    from qwen35_accel.parallel.tensor_parallel import clip_grad_norm_, gather_tensor_parallel
    from test_tensor_parallel import mesh_for

    from _parity import hf_name

    tp = world // dp
    reference = build_tiny_next_causal_lm(seed=0)
    model = copy.deepcopy(reference)
    PARALLELIZER.apply(model, mesh_for(world, dp, 1, tp))
    gdn = model.model.layers[0].linear_attn  # whole key-head groups per rank: 1 of 2 key heads, 2 of 4 value heads
    assert (gdn.num_k_heads, gdn.num_v_heads, gdn.in_proj_qkvz.weight.shape[0]) == (1, 2, reference.model.layers[0].linear_attn.in_proj_qkvz.weight.shape[0] // 2)
    batch = random_batch(2 * dp, 24, reference.config.vocab_size, seed=6)
    want = reference(**batch)  # rows of equal length: the mean of the replicas' 2-row means
    replica = rank // tp  # Accelerate's mesh order (dp, cp, tp): a replica's tp ranks share its rows
    got = model(**{key: value[2 * replica: 2 * replica + 2] for key, value in batch.items()})
    with torch.no_grad():
        assert_close(got.loss.detach(), reference(**{k: v[2 * replica: 2 * replica + 2] for k, v in batch.items()}).loss, "loss")
    want.loss.backward()
    got.loss.backward()
    reference_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():  # the split parameters gathered to Transformers' layout
        assert_close(gather_tensor_parallel(model, name, param.grad), reference_params[hf_name(name)].grad, f"grad of {name}")
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in reference.parameters()]))
    assert_close(clip_grad_norm_(model, 1e9), norm, "gradient norm")
    dist.barrier()


@pytest.mark.multiprocess
@pytest.mark.parametrize("world,dp", [(2, 1), pytest.param(4, 2, marks=pytest.mark.slow)], ids=["tp2", "dp2xtp2"])
def test_tp2_splits_whole_key_head_groups_and_trains_as_one_process(world, dp):
    """Head-parallel TP: the per-key-group `in_proj_qkvz`/`in_proj_ba` rows sliced so each rank holds whole key
    groups (their query, key, value, z, b and a rows), the conv channels and gates of those heads, the
    attention's heads, the shared expert's width and half the routed experts; loss, every gradient (gathered
    to Transformers' layout) and the gradient norm equal one process's; with dp 2 each replica its rows."""
    run_world(_tp_worker, world, dp)


def _ep_worker(rank: int, world: int) -> None:
    from test_moe_ep import _parity

    # ep 2 over dp 2: each rank 3 of the 6 experts of every layer, the tokens sent to their experts' ranks and
    # back; each rank's rows against one process on them, SGD steps, every token's experts, every gradient.
    _parity(rank, world, ep=2, cp=1, num_experts=6, build=build_tiny_next_causal_lm)


@pytest.mark.multiprocess
def test_ep2_routes_and_trains_as_one_process():
    run_world(_ep_worker, 2)


def _cp_worker(rank: int, world: int) -> None:
    from qwen35_accel import PARALLELIZER
    from qwen35_accel.context_parallel import gather_sequence, shard_batch
    from qwen35_accel.parallel.tiled_loss import tiled_loss_mode
    from test_cp_model import cp_mesh

    mesh = cp_mesh(world, world)
    reference = build_tiny_next_causal_lm(seed=0, output_router_logits=True, router_aux_loss_coef=0.05)
    model = copy.deepcopy(reference)
    PARALLELIZER.apply(model, mesh)
    assert tiled_loss_mode(model) == "recompute"  # Qwen3-Next's forward is Qwen3.5-MoE's: the tiled loss applies
    batch = random_batch(2, 32, reference.config.vocab_size, seed=4)
    want = reference(**batch)
    got = model(**shard_batch(batch, mesh["cp"]))  # each rank its two chunks of every row
    # The cross entropy and the router's load-balancing loss of whole rows (its sums reduced over the cp group).
    assert_close(got.aux_loss.detach(), want.aux_loss.detach(), "router loss")
    assert_close(got.loss.detach(), want.loss.detach(), "loss")
    want.loss.backward()
    got.loss.backward()
    assert assert_grads_match(model, reference) > 0
    with torch.no_grad():  # no labels: Transformers' logits, this rank's chunks
        inputs = shard_batch({"input_ids": batch["input_ids"]}, mesh["cp"])
        logits = model(**inputs, output_router_logits=False).logits
        assert_close(gather_sequence(logits, mesh["cp"]), reference(input_ids=batch["input_ids"]).logits, "logits")
        # Packed rows under cp: each document as alone, the boundaries anywhere in the chunks.
        packed, documents = packed_documents([19, 3, 42], reference.config.vocab_size, seed=5)
        want_logits, want_loss = documents_alone(reference, documents)
        out = model(**shard_batch({k: v for k, v in packed.items() if k != "labels"}, mesh["cp"]), output_router_logits=False)
        assert_close(gather_sequence(out.logits, mesh["cp"]), want_logits, "packed logits")
    dist.barrier()


@pytest.mark.multiprocess
def test_cp2_computes_and_trains_as_one_process_router_loss_and_packed_rows_too():
    """Context parallelism: the GatedDeltaNet's state passing and conv halo after Qwen3-Next's own
    projections, the attention's K/V all-gather; the loss (the router's over whole rows), every token's
    logits, every gradient (the routers' and experts' included) equal one process; packed rows equal each
    document alone."""
    run_world(_cp_worker, 2)


def _accelerate_worker(rank: int, world: int) -> None:
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin

    from qwen35_accel.parallel.prepared import prepared_state

    accelerator = Accelerator(mixed_precision="bf16", fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
    model = build_tiny_next_causal_lm(seed=0, dtype=torch.bfloat16)  # a bf16 load
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    assert prepared_state(model).source == "accelerate" and prepared_state(model).parts.family == "next"
    gates: list[torch.dtype] = []
    holder = model.model.layers[0].linear_attn._fp32_params
    hook = holder.register_forward_pre_hook(lambda module, _args: gates.append(module.A_log.dtype))
    loss = model(**random_batch(2, 16, model.config.vocab_size, seed=rank)).loss
    hook.remove()
    assert gates == [torch.float32] and torch.isfinite(loss)
    accelerator.backward(loss)
    optimizer.step()


@pytest.mark.multiprocess
def test_the_plugin_prepares_qwen3_next_with_its_gates_fp32_in_the_forward():
    """Accelerate's FSDP2 preparation under bf16 mixed precision (what a bf16 YAML sets): the plugin's
    units, the gate computed from fp32 parameters (before: Accelerate's own path, one bf16 policy)."""
    run_world(_accelerate_worker, 2)



# An unchanged Trainer script (recipes/sft.py) on a saved tiny Qwen3-Next, batched per config
# (tests/_launched.py): one process on 4 rows a step against cpu_fsdp2_cp2.yaml (each rank its chunks of the
# same 4 rows).
from pathlib import Path  # noqa: E402

from _launched import register  # noqa: E402
from test_trainer_launch import FIXED_LENGTH, SGD, recipe_run  # noqa: E402

TOKENIZER = Path(__file__).parent.parent / "recipes" / "configs" / "tokenizer"


def save_tiny_next(path: Path) -> None:
    """The tiny Qwen3-Next at the recipe's byte-level vocabulary (pad = eos = 256), with its tokenizer."""
    build_tiny_next_causal_lm(seed=0, vocab_size=264, pad_token_id=256, eos_token_id=256).save_pretrained(path)


NEXT_ARGS = ("--model_name_or_path", "{in}", "--tokenizer_name_or_path", str(TOKENIZER), "--per_device_train_batch_size",
             "4", *FIXED_LENGTH, *SGD)
register(**{
    "next/reference": recipe_run(None, *NEXT_ARGS, setup=save_tiny_next),
    "next/cp2": recipe_run("cpu_fsdp2_cp2.yaml", *NEXT_ARGS, setup=save_tiny_next),
})


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.launches("next/reference", "next/cp2")
def test_the_unchanged_recipe_trains_qwen3_next_under_cp2_as_one_process(launched):
    """`accelerate launch --config_file cpu_fsdp2_cp2.yaml recipes/sft.py --model_name_or_path <tiny Qwen3-Next>`:
    prepared by the plugin (fp32 gate units, cp 2; before: Accelerate refused CP for its linear attention),
    every logged value and the saved weights one process's (SGD, fp32 rtol 1e-5), the gates saved fp32."""
    from test_trainer_launch import assert_same_training

    run, reference = launched("next/cp2"), launched("next/reference")
    lines = [line for line in run.stderr.splitlines() if "prepared by qwen35_accel" in line]
    assert len(lines) == 1 and "Qwen3NextForCausalLM prepared by qwen35_accel" in lines[0], run.stderr[-3000:]
    assert "fp32 gate holders" in lines[0] and "cp=2" in lines[0], lines[0]
    assert_same_training(run.out, reference.out, rtol=1e-5)


def test_plan_lays_out_qwen3_next_80b_a3b_on_8_h200(tmp_path):
    """`qwen35-accel plan` on the shape Transformers documents as Qwen3-Next-80B-A3B's (its config's
    defaults: 48 layers as 12 x (3 GatedDeltaNet + 1 gated attention), 512 experts, top 10) under the 8-GPU
    fsdp2.yaml with 141 GB GPUs: the plugin's units (an fp32 gate unit per GatedDeltaNet layer), the
    experts line, and a memory verdict that adds up (fp32 masters, grads and AdamW: 16 bytes a parameter
    over 8 ranks do not fit one H200; the plan says so rather than suggest a layout that would not)."""
    from transformers import Qwen3NextConfig

    from test_cli import CONFIGS, cli

    config = Qwen3NextConfig(dtype="bfloat16")
    config.architectures = ["Qwen3NextForCausalLM"]
    config.save_pretrained(tmp_path)
    p = cli("plan", "--model", str(tmp_path), "--config", str(CONFIGS / "fsdp2.yaml"), "--gpu-memory", "141GB", "--suggest")
    assert p["architecture"] == "Qwen3NextForCausalLM" and 79e9 < p["parameters"] < 81e9 and p["fsdp_shards"] == 8
    assert p["experts"] == {"per_layer": 512, "per_token": 10, "ep": 1, "efsdp": 8}
    holders = [u for layer in p["layers"] for u in layer["units"] if u["modules"][0].endswith("linear_attn._fp32_params")]
    assert len(p["layers"]) == 48 and len(holders) == 36 and all(u["storage"] == u["compute"] == "float32" for u in holders)
    assert p["sharded_bytes_all_ranks"] == p["model_bytes"] == 4 * p["parameters"]
    memory = p["memory_per_rank"]
    assert memory["optimizer_states"] == 2 * memory["parameters"] and p["fits"] is False, memory


def test_prepared_without_fsdp_after_a_bf16_load_it_trains_the_checkpoints_fp32_gates(tmp_path, capfd):
    """One process (Accelerate's no-FSDP path) under bf16 autocast, loaded in bf16 from an fp32 checkpoint:
    prepared, the gates held in fp32 with the checkpoint's values read back bitwise, fp32 gradients."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from transformers import AutoModelForCausalLM

    from qwen35_accel import install
    from test_bf16_load import assert_checkpoint_values, save_fp32

    saved = save_fp32(build_tiny_next_causal_lm, tmp_path)
    install()
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
        accelerator = Accelerator(cpu=True, mixed_precision="bf16")
        model = accelerator.prepare(model)
        assert "Qwen3NextForCausalLM prepared by qwen35_accel without FSDP" in capfd.readouterr().err
        assert_checkpoint_values(model, saved)
        accelerator.backward(model(**random_batch(2, 16, model.config.vocab_size, seed=0)).loss)
        gates = [p for name, p in model.named_parameters() if name.endswith((".A_log", ".dt_bias"))]
        assert len(gates) == 4 and all(p.grad is not None and p.grad.dtype == torch.float32 for p in gates)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


def _distributed_config_worker(rank: int, world: int, path: str) -> None:
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    from qwen35_accel.parallel.fsdp import describe_units
    from qwen35_accel.parallel.prepared import prepared_state
    from test_bf16_load import assert_checkpoint_values, checkpoint_gate_values

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, distributed_config=DistributedConfig(fsdp_size=world))
    assert prepared_state(model).source == "distributed_config"
    units = {row["unit"]: (row["storage"], row["compute"]) for row in describe_units(model)}
    assert units["model.layers.0.linear_attn._fp32_params"] == ("float32", "float32"), units
    assert_checkpoint_values(model, checkpoint_gate_values(Path(path)))  # fp32, bitwise: not the load's rounding
    model(**random_batch(2, 16, model.config.vocab_size, seed=rank)).loss.backward()
    dist.barrier()


@pytest.mark.multiprocess
def test_sharded_at_load_by_distributed_config_it_holds_the_checkpoints_fp32_gates(tmp_path):
    """`from_pretrained(..., distributed_config=DistributedConfig(fsdp_size=2))` in bf16 of an fp32 checkpoint:
    the plugin's units, the gates loaded into fp32 holders with the checkpoint's values."""
    from test_bf16_load import save_fp32

    save_fp32(build_tiny_next_causal_lm, tmp_path)
    run_world(_distributed_config_worker, 2, str(tmp_path))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_trl_sft_cli_with_its_router_loss_under_cp2_logs_what_one_process_logs(tmp_path):
    """TRL's own `trl sft` on a tiny Qwen3-Next with the router's loss on (coefficient 0.05): one process against
    `--accelerate_config cpu_fsdp2_cp2.yaml` (TRL's fused head: the router's logits of every Qwen3-Next router
    recorded and its loss reduced over the cp group; before: only Qwen3.5-MoE's routers were recorded): loss,
    grad norm, entropy, mean_token_accuracy, num_tokens."""
    import shutil

    from _parity import assert_same_log_history, log_history
    from _trl_cli import RECIPES, four_sgd_steps, single_and_cp2
    from transformers import AutoTokenizer

    model, data = tmp_path / "model", tmp_path / "data"
    build_tiny_next_causal_lm(seed=0, vocab_size=264, pad_token_id=256, eos_token_id=256, output_router_logits=True,
                              router_aux_loss_coef=0.05).save_pretrained(model)
    AutoTokenizer.from_pretrained(TOKENIZER).save_pretrained(model)
    data.mkdir()
    shutil.copy(RECIPES / "data" / "sft_tiny.jsonl", data / "train.jsonl")
    single, cp2, output = single_and_cp2(tmp_path, "sft", four_sgd_steps(model, data), step=4)
    assert output.count("Qwen3NextForCausalLM prepared by qwen35_accel") == 1 and "cp=2" in output, output[-3000:]
    logged = log_history(single)
    assert len([e for e in logged if "loss" in e]) == 4 and any(e.get("aux_loss", 0) > 0 for e in logged), logged
    assert_same_log_history(cp2, single, rtol=1e-5, atol=1e-6)
