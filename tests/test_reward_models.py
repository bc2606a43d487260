"""Reward models and classifiers: Qwen3.5's classification heads get what the causal LM gets (issue 58).

A sequence classifier (`AutoModelForSequenceClassification` on a Qwen3.5 config: a reward model at
num_labels 1) scores each row from its last real token; under context parallelism that token lives
on one rank. The oracle is the unmodified Transformers head in one process on the whole batch:
loss and every gradient, the score head's included (fp32 rtol 1e-5: ranks sum in another order).
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from transformers.modeling_layers import GenericForSequenceClassification
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf_moe

from _dist import run_world
from _parity import assert_close, assert_grads_match

ROWS, SEQ = 4, 32
# Real lengths chosen so that the last real token falls in each of cp 2's four chunks (8 tokens
# each; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2) and one row is not padded at all.
LENGTHS = (32, 5, 13, 22)


def _rows(vocab: int, seed: int) -> dict[str, torch.Tensor]:
    """Right-padded rows (pad token 0, never inside a row), regression labels."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (ROWS, SEQ), generator=generator)
    mask = torch.zeros(ROWS, SEQ, dtype=torch.long)
    for row, length in enumerate(LENGTHS):
        mask[row, :length] = 1
    return {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask,
            "labels": torch.randn(ROWS, generator=generator)}


def _packed(input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """The rows as packed rows: no padding, position_ids restarting at a second document in row 0."""
    position_ids = torch.arange(SEQ).repeat(ROWS, 1)
    position_ids[0, 10:] = torch.arange(SEQ - 10)
    return {"input_ids": input_ids.clamp(min=1), "position_ids": position_ids}


def test_packed_rows_given_to_a_sequence_classifier_are_refused_with_the_way_out():
    """One score per row from its last real token: a packed row would be scored by its last document
    alone against the row's one label (the causal LM and the token classifier take packed rows)."""
    from qwen35_accel.model.fp32_gate import install_fp32_gate
    from qwen35_accel.testing.tiny import build_tiny_sequence_classifier, build_tiny_token_classifier

    model = build_tiny_sequence_classifier(seed=0)
    install_fp32_gate(model)
    packed = _packed(_rows(model.config.vocab_size, seed=3)["input_ids"])
    with pytest.raises(ValueError, match=r"position_ids restarting inside a row.* Pad the rows instead"):
        model(**packed)
    padded = _rows(model.config.vocab_size, seed=3)  # padded rows with their positions stay accepted
    assert model(**padded, position_ids=torch.arange(SEQ).repeat(ROWS, 1)).logits.shape == (ROWS, 1)
    tokens = build_tiny_token_classifier(seed=0)
    install_fp32_gate(tokens)
    assert tokens(**packed).logits.shape == (ROWS, SEQ, 3)  # a label per token: documents are fine


def test_the_heads_are_qwen35_models_of_their_backbones_family():
    """Detection looks through the head to its backbone; the score joins the parts (the FSDP2 tail)."""
    from qwen35_accel.model.detect import is_sequence_classifier, qwen35_family, qwen35_parts
    from qwen35_accel.testing.tiny import build_tiny_sequence_classifier, build_tiny_token_classifier

    for model, sequence in ((build_tiny_sequence_classifier(seed=0), True), (build_tiny_token_classifier(seed=0), False)):
        parts = qwen35_parts(model)
        assert qwen35_family(model) == "dense" and parts.head is model.score and parts.lm_head is None
        assert len(parts.decoder_layers) == 3 and is_sequence_classifier(model) is sequence


def _token_cp_worker(rank: int, world: int) -> None:
    from qwen35_accel import PARALLELIZER
    from qwen35_accel.context_parallel import gather_sequence, shard_batch
    from qwen35_accel.testing.tiny import build_tiny_token_classifier
    from test_cp_model import cp_mesh

    reference = build_tiny_token_classifier(seed=0)
    reference.model.visual.requires_grad_(False)  # text rows: the tower is not part of the comparison
    model = copy.deepcopy(reference)
    mesh = cp_mesh(world, world)
    PARALLELIZER.apply(model, mesh)
    batch = _rows(reference.config.text_config.vocab_size - 8, seed=6)  # below the VLM's special tokens
    generator = torch.Generator().manual_seed(2)
    labels = torch.randint(0, reference.config.num_labels, (ROWS, SEQ), generator=generator)
    batch["labels"] = labels.masked_fill(batch["attention_mask"] == 0, -100)  # padding unlabelled; not shifted
    want = reference(**batch)
    want.loss.backward()
    got = model(**shard_batch(batch, mesh["cp"]))
    assert_close(got.loss.detach(), want.loss.detach(), "loss")
    real = batch["attention_mask"].bool()
    assert_close(gather_sequence(got.logits.detach(), mesh["cp"])[real], want.logits.detach()[real], "token logits")
    got.loss.backward()
    assert assert_grads_match(model, reference) > 0
    dist.barrier()


@pytest.mark.multiprocess
def test_a_token_classifier_under_cp2_labels_and_trains_as_one_process():
    """`Qwen3_5ForTokenClassification` under cp 2: labels where their tokens stand (unshifted), the
    cross entropy over the cp group's labelled tokens; loss, the tokens' logits and every gradient
    equal one process's (before: refused)."""
    run_world(_token_cp_worker, 2)


def _cp_worker(rank: int, world: int) -> None:
    from qwen35_accel import PARALLELIZER
    from qwen35_accel.context_parallel import shard_batch
    from qwen35_accel.testing.tiny import build_tiny_sequence_classifier
    from test_cp_model import cp_mesh

    reference = build_tiny_sequence_classifier(seed=0)
    model = copy.deepcopy(reference)
    mesh = cp_mesh(world, world)
    PARALLELIZER.apply(model, mesh)
    batch = _rows(reference.config.vocab_size, seed=3)
    want = reference(**batch)
    want.loss.backward()
    labels = batch.pop("labels")
    got = model(**shard_batch(batch, mesh["cp"]), labels=labels)  # the labels are per row: whole on every rank
    assert got.logits.shape == (ROWS, 1)
    assert_close(got.logits.detach(), want.logits.detach(), "scores")
    assert_close(got.loss.detach(), want.loss.detach(), "loss")
    got.loss.backward()
    assert assert_grads_match(model, reference) > 0
    packed = shard_batch(_packed(batch["input_ids"]), mesh["cp"])
    with pytest.raises(ValueError, match=r"packed rows .* given to a sequence classifier .* Pad the rows instead"):
        model(**packed, labels=labels)  # every rank: the verdict reads the whole rows
    dist.barrier()


@pytest.mark.multiprocess
def test_a_reward_model_under_cp2_scores_and_trains_as_one_process():
    """cp 2: each rank its chunks of every row; the last real token of the rows on either rank
    (before: refused by Accelerate, and the head pooled each rank's own last token)."""
    run_world(_cp_worker, 2)


def _lora_cp_worker(rank: int, world: int) -> None:
    from peft import LoraConfig, TaskType, get_peft_model

    from qwen35_accel import PARALLELIZER
    from qwen35_accel.context_parallel import shard_batch
    from qwen35_accel.testing.tiny import build_tiny_sequence_classifier
    from test_cp_model import cp_mesh

    def lora(model):
        torch.manual_seed(0)
        config = LoraConfig(task_type=TaskType.SEQ_CLS, r=4, lora_alpha=8, target_modules=["q_proj", "in_proj_qkv"],
                            init_lora_weights=False)  # B != 0: the adapters matter from the first step
        return get_peft_model(model, config)

    reference = lora(build_tiny_sequence_classifier(seed=0))
    model = lora(build_tiny_sequence_classifier(seed=0))
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert any("score" in name for name in trainable) and any("lora_A" in name for name in trainable), trainable
    mesh = cp_mesh(world, world)
    PARALLELIZER.apply(model, mesh)
    from qwen35_accel.parallel.prepared import prepared_state

    state = prepared_state(model)  # on the PEFT wrapper and on the head inside it: the same object
    assert state is prepared_state(model.base_model.model) and state.model is model and state.dims.cp is not None
    batch = _rows(reference.config.vocab_size, seed=4)
    want = reference(**batch)
    want.loss.backward()
    labels = batch.pop("labels")
    got = model(**shard_batch(batch, mesh["cp"]), labels=labels)
    assert_close(got.loss.detach(), want.loss.detach(), "loss")
    got.loss.backward()
    assert assert_grads_match(model, reference) == len(trainable)  # every adapter and the score (modules_to_save)
    dist.barrier()


@pytest.mark.multiprocess
def test_a_lora_reward_model_under_cp2_trains_as_the_peft_model_in_one_process():
    """PEFT LoRA for sequence classification (the score trained whole: PEFT's modules_to_save for
    SEQ_CLS) under cp 2: loss, every adapter's and the score's gradient equal the PEFT model's."""
    run_world(_lora_cp_worker, 2)


def _vlm_cp_worker(rank: int, world: int) -> None:
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    from qwen35_accel import PARALLELIZER
    from qwen35_accel.context_parallel import shard_batch
    from qwen35_accel.model.tiny import randomize_for_parity
    from qwen35_accel.testing.tiny import placed_vlm_batch, tiny_vlm_config
    from test_cp_model import cp_mesh
    from test_vlm_cp import FULL, SEQ

    config = tiny_vlm_config()
    config.num_labels = 1
    torch.manual_seed(0)
    reference = randomize_for_parity(hf.Qwen3_5ForSequenceClassification(config), seed=0)
    model = copy.deepcopy(reference)
    mesh = cp_mesh(world, world)
    PARALLELIZER.apply(model, mesh)
    rows, padding = FULL
    batch = placed_vlm_batch(config, rows, SEQ, seed=9, padding=padding)
    batch.pop("labels")
    batch["input_ids"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, config.text_config.pad_token_id)
    labels = torch.tensor([0.5, -1.0])
    want = reference(**batch, labels=labels)
    want.loss.backward()
    got = model(**shard_batch(batch, mesh["cp"]), labels=labels)
    assert_close(got.logits.detach(), want.logits.detach(), "scores")
    assert_close(got.loss.detach(), want.loss.detach(), "loss")
    got.loss.backward()
    grads = assert_grads_match(model, reference)
    assert grads == len([p for p in reference.parameters() if p.requires_grad])  # the vision tower's included
    dist.barrier()


@pytest.mark.multiprocess
def test_the_vlm_reward_model_with_images_under_cp2_scores_and_trains_as_one_process():
    """`Qwen3_5ForSequenceClassification` (the VLM's config) with images and a video straddling the
    ranks' chunks, one row right-padded: the tower's work split over the cp ranks as for the VLM,
    the last real token pooled across them; scores, loss and every gradient equal one process's."""
    run_world(_vlm_cp_worker, 2)


def _dp_worker(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from qwen35_accel import PARALLELIZER
    from qwen35_accel.parallel.fsdp import describe_units
    from qwen35_accel.parallel.prepared import prepared_state
    from qwen35_accel.testing.tiny import build_tiny_sequence_classifier

    reference = build_tiny_sequence_classifier(seed=0)
    model = copy.deepcopy(reference)
    PARALLELIZER.apply(model, init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard_cp",)))
    state = prepared_state(model)  # the one prepared state, kept on the model
    assert state.source == "apply" and state.base is model and state.parts.head is model.score and state.dims.cp is None
    units = {row["unit"] for row in describe_units(model)}
    assert {"model.layers.0.linear_attn._fp32_params", "model.norm+score"} <= units, units  # the score in the tail
    batch = _rows(reference.config.vocab_size, seed=3)
    want = reference(**batch)  # the mean over the 4 rows: the mean of the two ranks' 2-row means
    want.loss.backward()
    mine = {key: value[2 * rank: 2 * rank + 2] for key, value in batch.items()}
    got = model(**mine)
    with torch.no_grad():
        assert_close(got.loss.detach(), reference(**mine).loss, "this rank's loss")
    got.loss.backward()
    assert assert_grads_match(model, reference) > 0
    dist.barrier()


@pytest.mark.multiprocess
def test_a_reward_model_under_fsdp2_gets_fp32_gate_units_and_one_process_gradients():
    run_world(_dp_worker, 2)


def _tp_worker(rank: int, world: int, cp: int) -> None:
    from qwen35_accel import PARALLELIZER
    from qwen35_accel.context_parallel import shard_batch
    from qwen35_accel.parallel.tensor_parallel import gather_tensor_parallel
    from qwen35_accel.testing.tiny import build_tiny_sequence_classifier
    from test_tensor_parallel import mesh_for

    from _parity import hf_name

    reference = build_tiny_sequence_classifier(seed=0)
    model = copy.deepcopy(reference)
    tp, dp = 2, world // cp // 2
    mesh = mesh_for(world, dp, cp, tp)
    PARALLELIZER.apply(model, mesh)
    batch = _rows(reference.config.vocab_size, seed=5)
    want = reference(**batch)
    want.loss.backward()
    rows = ROWS // dp
    replica = rank // (cp * tp)  # Accelerate's mesh order (dp, cp, tp): a dp rank's cp and tp ranks share its rows
    mine = {key: value[replica * rows: (replica + 1) * rows] for key, value in batch.items()}
    labels = mine.pop("labels")
    got = model(**(shard_batch(mine, mesh["cp"]) if cp > 1 else mine), labels=labels)
    with torch.no_grad():
        assert_close(got.loss.detach(), reference(**mine, labels=labels).loss, f"rank {rank}: loss")
    got.loss.backward()
    reference_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():  # the head-split parameters gathered to Transformers' layout
        assert_close(gather_tensor_parallel(model, name, param.grad), reference_params[hf_name(name)].grad, f"grad of {name}")
    dist.barrier()


@pytest.mark.multiprocess
@pytest.mark.slow  # world 4
@pytest.mark.parametrize("cp", [1, 2], ids=["dp2xtp2", "cp2xtp2"])
def test_a_reward_model_under_tensor_parallelism_trains_as_one_process(cp):
    """Head-parallel decoder layers (the score replicated on the tp ranks) with dp 2 or cp 2: each rank's
    loss and every gathered gradient equal one process's on the whole batch."""
    run_world(_tp_worker, 4, cp)


class Qwen3_5MoeTextForSequenceClassification(GenericForSequenceClassification, hf_moe.Qwen3_5MoePreTrainedModel):
    """A reward model on the MoE backbone, built as Transformers builds the dense one (5.25 ships no
    MoE head class; the name picks Transformers' sequence-classification loss)."""


def _moe_ep_worker(rank: int, world: int) -> None:
    from qwen35_accel import PARALLELIZER
    from qwen35_accel.context_parallel import shard_batch
    from qwen35_accel.model.tiny import _built, tiny_moe_text_config
    from test_cp_model import cp_mesh

    for cp in (1, 2):  # ep 2 over dp 2, then over cp 2 (each expert on one rank, the tokens of both)
        reference = _built(Qwen3_5MoeTextForSequenceClassification, tiny_moe_text_config(num_labels=1), 0, torch.float32)
        model = copy.deepcopy(reference)
        mesh = cp_mesh(world, cp)
        PARALLELIZER.apply(model, mesh, ep=2)
        assert model.model.layers[0].mlp.experts.gate_up_proj.to_local().shape[0] == 3  # 6 experts, 3 a rank
        batch = _rows(reference.config.vocab_size, seed=7)
        want = reference(**batch)
        want.loss.backward()
        if cp > 1:
            labels = batch.pop("labels")
            got = model(**shard_batch(batch, mesh["cp"]), labels=labels)
            assert_close(got.logits.detach(), want.logits.detach(), "scores")
        else:
            got = model(**{key: value[2 * rank: 2 * rank + 2] for key, value in batch.items()})
        got.loss.backward()
        assert assert_grads_match(model, reference) > 0  # the routers', the experts' and the score's included
        dist.barrier()


@pytest.mark.multiprocess
def test_a_reward_model_on_the_moe_backbone_under_ep2_trains_as_one_process():
    """Expert parallelism under a sequence classifier on Qwen3.5-MoE, over dp 2 and over cp 2: every
    gradient equals one process's (the head pools after the experts ran where they live)."""
    run_world(_moe_ep_worker, 2)


def _memory_worker(rank: int, world: int) -> None:
    from qwen35_accel import PARALLELIZER
    from qwen35_accel.context_parallel import shard_batch
    from qwen35_accel.model.state import find_state
    from qwen35_accel.parallel.fsdp import describe_units
    from qwen35_accel.testing.tiny import build_tiny_sequence_classifier
    from test_cp_model import cp_mesh
    from test_fsdp_parity import accelerate_style_mesh

    # HSDP (dp_replicate 2: each rank a whole replica, its own rows) with checkpointed layers whose
    # saved inputs live in host memory; then cp 2 with checkpointed layers.
    for mesh, offload in ((accelerate_style_mesh(world, dp_replicate=world), True), (cp_mesh(world, world), False)):
        reference = build_tiny_sequence_classifier(seed=0)
        model = copy.deepcopy(reference)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            PARALLELIZER.apply(model, mesh, activation_checkpointing=True, activation_offload=offload)
        # The flattened dp_shard_cp (and HSDP's pair) taken where torch keeps them, not sliced from the root.
        assert not [w for w in caught if "Slicing a flattened dim" in str(w.message)], [str(w.message) for w in caught]
        assert "model.layers.0.linear_attn._fp32_params" in {row["unit"] for row in describe_units(model)}
        batch = _rows(reference.config.vocab_size, seed=8)
        want = reference(**batch)
        want.loss.backward()
        labels = batch.pop("labels")
        if offload:
            mine = {key: value[2 * rank: 2 * rank + 2] for key, value in batch.items()}
            got = model(**mine, labels=labels[2 * rank: 2 * rank + 2])
        else:
            got = model(**shard_batch(batch, mesh["cp"]), labels=labels)
            assert_close(got.loss.detach(), want.loss.detach(), "loss")
        got.loss.backward()
        if offload:
            assert find_state(model).activation_offload.stats.tensors > 0, "no saved input went through the offload hooks"
        assert assert_grads_match(model, reference) > 0
        dist.barrier()


@pytest.mark.multiprocess
def test_a_reward_model_under_hsdp_and_cp_with_activation_checkpointing_trains_as_one_process():
    run_world(_memory_worker, 2)


def _distributed_config_worker(rank: int, world: int, path: str) -> None:
    from transformers import AutoModelForSequenceClassification
    from transformers.distributed import DistributedConfig

    from qwen35_accel.parallel.fsdp import describe_units
    from test_bf16_load import assert_checkpoint_values, checkpoint_gate_values

    model = AutoModelForSequenceClassification.from_pretrained(
        path, dtype=torch.bfloat16, distributed_config=DistributedConfig(fsdp_size=world)
    )
    from qwen35_accel.parallel.prepared import prepared_state

    assert prepared_state(model).source == "distributed_config"
    units = {row["unit"]: (row["storage"], row["compute"]) for row in describe_units(model)}
    assert units["model.layers.0.linear_attn._fp32_params"] == ("float32", "float32"), units
    assert units["model.norm+score"] == ("bfloat16", "bfloat16"), units
    assert_checkpoint_values(model, checkpoint_gate_values(Path(path)))  # fp32, bitwise: not the load's rounding
    model(**_rows(model.config.vocab_size, seed=rank)).loss.backward()
    dist.barrier()


@pytest.mark.multiprocess
def test_a_reward_model_sharded_at_load_by_distributed_config_holds_the_checkpoints_fp32_gates(tmp_path):
    """`from_pretrained(..., distributed_config=DistributedConfig(fsdp_size=2))` in bf16 of an fp32
    checkpoint: the plugin's units, the gates loaded into fp32 holders with the checkpoint's values."""
    from test_bf16_load import save_fp32
    from qwen35_accel.testing.tiny import build_tiny_sequence_classifier

    save_fp32(build_tiny_sequence_classifier, tmp_path)
    run_world(_distributed_config_worker, 2, str(tmp_path))


def test_a_reward_model_prepared_without_fsdp_after_a_bf16_load_trains_the_checkpoints_fp32_gates(tmp_path, capfd):
    """One process (no FSDP: Accelerate's DDP/one-device path) under bf16 autocast, loaded in bf16 from an
    fp32 checkpoint: prepared, the gates held in fp32 with the checkpoint's values, fp32 gradients."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from transformers import AutoModelForSequenceClassification

    from qwen35_accel import install
    from qwen35_accel.testing.tiny import build_tiny_sequence_classifier
    from test_bf16_load import assert_checkpoint_values, save_fp32

    saved = save_fp32(build_tiny_sequence_classifier, tmp_path)
    install()
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        model = AutoModelForSequenceClassification.from_pretrained(tmp_path, dtype=torch.bfloat16)
        accelerator = Accelerator(cpu=True, mixed_precision="bf16")
        model = accelerator.prepare(model)
        assert "Qwen3_5TextForSequenceClassification prepared by qwen35_accel without FSDP" in capfd.readouterr().err
        assert_checkpoint_values(model, saved)
        accelerator.backward(model(**_rows(model.config.vocab_size, seed=0)).loss)
        gates = [p for name, p in model.named_parameters() if name.endswith((".A_log", ".dt_bias"))]
        assert gates and all(p.grad is not None and p.grad.dtype == torch.float32 for p in gates)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


def _bf16_accelerate_worker(rank: int, world: int) -> None:
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin

    from qwen35_accel.parallel.fsdp import describe_units
    from qwen35_accel.testing.tiny import build_tiny_sequence_classifier

    accelerator = Accelerator(mixed_precision="bf16", fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
    model = build_tiny_sequence_classifier(seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    from qwen35_accel.parallel.prepared import prepared_state

    assert prepared_state(model).source == "accelerate"
    rows = {row["unit"]: row for row in describe_units(model)}
    # The YAML's policy on the layers and the score; the gate holders their own fp32 units.
    assert (rows["model.layers.0"]["storage"], rows["model.layers.0"]["compute"]) == ("float32", "bfloat16"), rows
    assert rows["model.norm+score"]["compute"] == "bfloat16", rows
    unit = rows["model.layers.0.linear_attn._fp32_params"]
    assert (unit["storage"], unit["compute"]) == ("float32", "float32"), unit
    gates: list[torch.dtype] = []
    holder = model.model.layers[0].linear_attn._fp32_params  # its pre-hook runs after FSDP2 gathered the unit
    hook = holder.register_forward_pre_hook(lambda module, _args: gates.append(module.A_log.dtype))
    batch = _rows(model.config.vocab_size, seed=rank)
    loss = model(**batch).loss
    hook.remove()
    assert gates == [torch.float32], gates  # the gate is computed from fp32 parameters
    accelerator.backward(loss)
    optimizer.step()
    assert torch.isfinite(loss)


@pytest.mark.multiprocess
def test_a_reward_model_under_bf16_mixed_precision_keeps_its_gates_fp32():
    """Accelerate's FSDP2 preparation with mixed_precision bf16 (what a bf16 YAML sets): the plugin's
    units, the gates fp32 in the forward (before: Accelerate's own path, one bf16 compute policy)."""
    run_world(_bf16_accelerate_worker, 2)


# An unchanged Trainer script on the reward model (tests/scripts/reward_model.py), batched per config
# (tests/_launched.py): one process on 4 rows a step against dp 2 with 2 micro-batches of 1 row (the
# Trainer's loss scaling) and cp 2 (each rank its chunks of the 4 rows).
from _launched import Run, register  # noqa: E402

SCRIPT = Path(__file__).parent / "scripts" / "reward_model.py"
PREPARED = "Qwen3_5TextForSequenceClassification prepared by qwen35_accel"


def save_tiny_reward_model(path: Path) -> None:
    from qwen35_accel.testing.tiny import build_tiny_sequence_classifier

    build_tiny_sequence_classifier(seed=0).save_pretrained(path)


def _run(config: str | None, per_device: int, accumulation: int = 1) -> Run:
    return Run(config, SCRIPT, ("{in}", "{out}", str(per_device), str(accumulation)), setup=save_tiny_reward_model)


BF16_CONFIG = Path(__file__).parent / "configs" / "cpu_fsdp2_cp2_bf16.yaml"
TRL_SCRIPT = Path(__file__).parent / "scripts" / "trl_reward.py"
TOKENIZER = Path(__file__).parent.parent / "recipes" / "configs" / "tokenizer"


def save_tiny_reward_model_with_tokenizer(path: Path) -> None:
    """The tiny reward model at the recipes' byte-level vocabulary (pad = eos = 256), with its tokenizer."""
    from transformers import AutoTokenizer

    from qwen35_accel.testing.tiny import build_tiny_sequence_classifier

    build_tiny_sequence_classifier(seed=0, vocab_size=264, pad_token_id=256, eos_token_id=256).save_pretrained(path)
    AutoTokenizer.from_pretrained(TOKENIZER).save_pretrained(path)


def _trl_run(config: str | None) -> Run:
    return Run(config, TRL_SCRIPT, ("{in}", "{out}", "4"), setup=save_tiny_reward_model_with_tokenizer)


TOKEN_SCRIPT = Path(__file__).parent / "scripts" / "token_classifier.py"


def save_tiny_token_classifier(path: Path) -> None:
    """The tiny token classifier (the VLM's config, 3 labels, no dropout), its vision tower frozen."""
    from qwen35_accel.testing.tiny import build_tiny_token_classifier

    model = build_tiny_token_classifier(seed=0)
    model.model.visual.requires_grad_(False)
    model.save_pretrained(path)


register(**{
    "token/reference": Run(None, TOKEN_SCRIPT, ("{in}", "{out}", "4"), setup=save_tiny_token_classifier),
    "token/cp2": Run("cpu_fsdp2_cp2.yaml", TOKEN_SCRIPT, ("{in}", "{out}", "4"), setup=save_tiny_token_classifier),
    "token/dp2-ga2": Run("cpu_fsdp2.yaml", TOKEN_SCRIPT, ("{in}", "{out}", "1", "2"), setup=save_tiny_token_classifier),
    "reward/trl-reference": _trl_run(None),
    "reward/trl-cp2": _trl_run("cpu_fsdp2_cp2.yaml"),
    "reward/reference": _run(None, 4),
    "reward/dp2-ga2": _run("cpu_fsdp2.yaml", 1, 2),
    "reward/cp2": _run("cpu_fsdp2_cp2.yaml", 4),
    # A bf16 YAML (cp 2) and a bf16 load of the fp32 checkpoint, as users load Qwen3.5 by default.
    "reward/bf16-cp2": Run(str(BF16_CONFIG), SCRIPT, ("{in}", "{out}", "4", "1", "bfloat16"), setup=save_tiny_reward_model),
})


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("name", [
    pytest.param("reward/dp2-ga2", marks=pytest.mark.launches("reward/reference", "reward/dp2-ga2"), id="dp2-ga2"),
    pytest.param("reward/cp2", marks=pytest.mark.launches("reward/reference", "reward/cp2"), id="cp2"),
])
def test_the_trainer_trains_a_reward_model_as_one_process(launched, name):
    """Every logged value (loss, grad norm, the evaluation's loss) per step, the saved weights (the score
    head's included) and `predict`'s scores equal one process's (fp32 rtol 1e-5; SGD). Before: under dp 2 x accumulation 2 the Trainer logged
    and trained 4 times one process's loss (its scaling assumes a loss divided by the global token
    count, which the head never reads); under cp 2 Accelerate refused the model."""
    from test_trainer_launch import assert_same_training

    run, reference = launched(name), launched("reward/reference")
    lines = [line for line in run.stderr.splitlines() if "prepared by qwen35_accel" in line]
    assert len(lines) == 1 and PREPARED in lines[0] and "fp32 gate holders" in lines[0], run.stderr[-3000:]
    assert_same_training(run.out, reference.out, rtol=1e-5)  # the evaluation's loss among the logged values
    got, want = (torch.load(r.out / "predictions.pt") for r in (run, reference))
    assert got.shape == want.shape == (8, 1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.launches("reward/bf16-cp2", "reward/reference")
def test_under_a_bf16_yaml_the_reward_models_gates_compute_and_train_in_fp32_from_the_checkpoint(launched):
    """The unchanged script, a bf16 load of an fp32 checkpoint, a bf16 cp 2 YAML: prepared with fp32 gate
    units; the first forward computes from the checkpoint's fp32 gates bitwise (the load rounded them,
    the plugin read them back); they train and save in fp32. Before: Accelerate refused CP for the
    model, and under its own FSDP2 path the gates were bf16 in the forward."""
    from test_bf16_load import checkpoint_gate_values

    from _parity import log_history

    run, reference = launched("reward/bf16-cp2"), launched("reward/reference")
    lines = [line for line in run.stderr.splitlines() if "prepared by qwen35_accel" in line]
    assert len(lines) == 1 and PREPARED in lines[0] and "fp32 gate holders" in lines[0], run.stderr[-3000:]
    assert "mixed precision: bf16 (units compute in bfloat16, reduce in" in lines[0], lines[0]  # the YAML's: no source named
    assert "set by the script" not in lines[0] and "loss: the sequence classifier's" in lines[0], lines[0]
    assert "read back, bitwise" in run.stderr, run.stderr[-3000:]
    checkpoint = checkpoint_gate_values(run.inputs)
    seen = torch.load(run.out / "gates_in_forward.pt")
    assert set(seen) == set(checkpoint), (sorted(seen), sorted(checkpoint))
    for key, value in checkpoint.items():
        assert seen[key].dtype == torch.float32 and torch.equal(seen[key], value), key
    trained = checkpoint_gate_values(run.out)
    assert all(trained[key].dtype == torch.float32 for key in checkpoint)
    assert any(not torch.equal(trained[key], checkpoint[key]) for key in checkpoint)  # trained, in fp32
    # bf16 compute against the fp32 run: the same training, within bf16's rounding.
    got, want = ([entry["loss"] for entry in log_history(r.out) if "loss" in entry] for r in (run, reference))
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=2e-2, atol=0)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.launches("reward/trl-reference", "reward/trl-cp2")
def test_trl_reward_trainer_under_cp2_logs_what_one_process_logs(launched):
    """TRL's `RewardTrainer` (chosen/rejected pairs, its own collator and loss) under cpu_fsdp2_cp2.yaml:
    every value it logs per step — loss, grad norm, accuracy, margin, min/mean/max reward, num_tokens,
    and the same of its evaluation after step 3 — equals one process's (fp32 rtol 1e-5; the margins are near zero, atol 1e-6). Before: Accelerate
    refused CP for the model on every rank."""
    from _parity import assert_same_log_history, log_history

    run, reference = launched("reward/trl-cp2"), launched("reward/trl-reference")
    assert run.stderr.count("Qwen3_5TextForSequenceClassification prepared by qwen35_accel") == 1, run.stderr[-3000:]
    logged = [e for e in log_history(reference.out) if "loss" in e]
    assert len(logged) == 3 and all({"accuracy", "margin", "mean_reward"} <= set(e) for e in logged), logged
    assert any("eval_accuracy" in e for e in log_history(reference.out))  # and the evaluation's values
    assert_same_log_history(run.out, reference.out, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_trl_grpo_cli_with_a_qwen35_reward_model_under_cp2_logs_what_one_process_logs(tmp_path):
    """`trl grpo --reward_model_name_or_path` (TRL loads the tiny reward model with
    AutoModelForSequenceClassification and scores every completion with it) under cpu_fsdp2_cp2.yaml
    against one process: the rewards, advantages, loss and every other logged value per step."""
    import json

    from _parity import assert_same_log_history, log_history
    from _trl_cli import RECIPES, saved_tiny_model, single_and_cp2

    model = saved_tiny_model(tmp_path / "model", eos_token_ids=range(60, 99))  # some completions stop early
    save_tiny_reward_model_with_tokenizer(tmp_path / "reward")
    data = tmp_path / "data"
    data.mkdir()
    records = [json.loads(line) for line in (RECIPES / "data" / "sft_tiny.jsonl").read_text().splitlines()[:16]]
    (data / "train.jsonl").write_text("".join(json.dumps({"prompt": r["prompt"]}) + "\n" for r in records))
    common = [
        "--model_name_or_path", str(model), "--dataset_name", str(data), "--reward_model_name_or_path", str(tmp_path / "reward"),
        "--max_steps", "2", "--per_device_train_batch_size", "4", "--num_generations", "4",
        "--max_completion_length", "8", "--beta", "0.1", "--optim", "sgd", "--learning_rate", "0.1", "--seed", "0",
        "--logging_steps", "1", "--save_strategy", "steps", "--save_steps", "2", "--save_only_model", "True",
        "--report_to", "none", "--dtype", "float32", "--attn_implementation", "sdpa", "--bf16", "False",
    ]
    single, cp2, output = single_and_cp2(tmp_path, "grpo", common, step=2)
    logged = [e for e in log_history(single) if "loss" in e]
    assert len(logged) == 2 and all(e["reward_std"] > 0 for e in logged), logged  # the scorer's rewards differ
    assert_same_log_history(cp2, single, rtol=1e-5, atol=1e-6, skip=("step_time",))


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("name", [
    pytest.param("token/cp2", marks=pytest.mark.launches("token/reference", "token/cp2"), id="cp2"),
    pytest.param("token/dp2-ga2", marks=pytest.mark.launches("token/reference", "token/dp2-ga2"), id="dp2-ga2"),
])
def test_the_trainer_trains_a_token_classifier_as_one_process(launched, name):
    """An unchanged Trainer script on `AutoModelForTokenClassification` under cpu_fsdp2_cp2.yaml (the
    labels sharded where their tokens stand: the Trainer's CP preparation would shift them) and under
    cpu_fsdp2.yaml with 2 micro-batches of 1 row (rows of 4 to 30 labelled tokens: the ranks and
    micro-batches hold unequal counts); the loss over the step's labelled tokens (the Trainer's count);
    every logged value (loss, grad norm, eval_loss) and the saved weights equal one process's on 4 rows
    a step (before: refused under cp; at dp 2 x accumulation 2 the mean of four micro-batch means,
    times 4)."""
    from _parity import assert_same_log_history
    from test_trainer_launch import weights

    run, reference = launched(name), launched("token/reference")
    assert run.stderr.count("Qwen3_5ForTokenClassification prepared by qwen35_accel") == 1, run.stderr[-3000:]
    assert_same_log_history(run.out, reference.out, rtol=1e-5)
    got, want = weights(run.out), weights(reference.out)
    assert set(got) == set(want)
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6, msg=lambda m, key=key: f"{key}: {m}")


def test_a_sequence_classifier_under_cp_without_a_pad_token_is_refused_with_the_way_out():
    """The Trainer's CP preparation pads rows to 2·cp; without `pad_token_id` the head would pool that
    padding (Transformers takes the row's last position then): refused, naming the fix."""
    from qwen35_accel.integrations.transformers.trainer_steps import _sequence_classifier_pad_token
    from qwen35_accel.testing.tiny import build_tiny_causal_lm, build_tiny_sequence_classifier

    assert _sequence_classifier_pad_token(build_tiny_sequence_classifier(seed=0)) == 0
    assert _sequence_classifier_pad_token(build_tiny_causal_lm(seed=0)) is None
    with pytest.raises(ValueError, match=r"needs config.pad_token_id.*Set model.config.pad_token_id"):
        _sequence_classifier_pad_token(build_tiny_sequence_classifier(seed=0, pad_token_id=None))
