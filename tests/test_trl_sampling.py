"""What TRL's GRPO/RLOO need from a model under context parallelism, against the unmodified model in
one process: the fused head on left-padded rows (prompts padded on the left, completions on the
right, only completion tokens labelled) gives every per-token field, the loss and every gradient;
generation with the model's CP paused draws the same tokens (sampling, the same seed) and CP is
back afterwards; the replicas of a mesh (which ranks share a batch, each group's leading rank)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from _dist import run_world
from _parity import assert_close, hf_name

pytestmark = pytest.mark.multiprocess

OUTPUTS = ("log_probs", "entropy")  # what GRPOTrainer asks its policy's head for


def grpo_rows(vocab_size: int) -> tuple[dict[str, torch.Tensor], int]:
    """Rows as GRPOTrainer builds them: [left-padded prompt | right-padded completion], labels on the
    completion only (TRL masks the prompt), one completion empty after its first token, and the
    number of completion positions (TRL's `logits_to_keep`)."""
    gen = torch.Generator().manual_seed(3)
    prompts, completions = torch.tensor([5, 3, 6, 2]), torch.tensor([4, 7, 1, 5])
    width_p, width_c = int(prompts.max()), int(completions.max())
    prompt_mask = (torch.arange(width_p) >= width_p - prompts[:, None]).long()
    completion_mask = (torch.arange(width_c) < completions[:, None]).long()
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    input_ids = torch.randint(1, vocab_size, attention_mask.shape, generator=gen).masked_fill(attention_mask == 0, 0)
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[:, :-width_c] = -100
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}, width_c


def _worker(rank: int, world: int, cp: int) -> None:
    import trl.trainer.grpo_trainer as grpo_module
    from trl.trainer.utils import add_fused_lm_head

    from qwen35_accel import PARALLELIZER, install
    from qwen35_accel.integrations.trl.sampling import replicas
    from qwen35_accel.context_parallel import context_parallel_paused
    from qwen35_accel.parallel.context_parallel.model import context_parallel_mesh
    from qwen35_accel.parallel.tensor_parallel import gather_tensor_parallel
    from qwen35_accel.testing.tiny import build_tiny_causal_lm

    install()
    reference = build_tiny_causal_lm(seed=0)
    add_fused_lm_head(reference, outputs=OUTPUTS)  # TRL's own head, one process
    model = build_tiny_causal_lm(seed=0)
    grpo_module.add_fused_lm_head(model, outputs=OUTPUTS)  # as GRPOTrainer calls it
    tp = world // cp
    mesh = init_device_mesh("cpu", (1, 1, cp, tp), mesh_dim_names=("dp_replicate", "dp_shard", "cp", "tp"))
    mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    PARALLELIZER.apply(model, mesh)

    batch, keep = grpo_rows(model.config.vocab_size)
    want, got = reference(**batch, fused_lm_head=True), model(**batch, fused_lm_head=True)
    assert torch.equal(got.label_mask, want.label_mask)
    assert_close(got.loss, want.loss, "loss")
    for name in OUTPUTS:
        assert_close(getattr(got, name).detach(), getattr(want, name).detach(), name)
    completion = batch["attention_mask"][:, -keep:]  # GRPO's per-sequence mean over its completion tokens
    (want.log_probs[:, -keep:] * completion).sum(1).div(completion.sum(1)).mean().backward()
    (got.log_probs[:, -keep:] * completion).sum(1).div(completion.sum(1)).mean().backward()
    ref_params = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        assert_close(gather_tensor_parallel(model, name, p.grad), ref_params[hf_name(name)].grad, f"grad of {name}")

    # Generation: left-padded prompts, sampling, a cache; every rank whole sequences.
    prompts = {"input_ids": batch["input_ids"][:, :6], "attention_mask": batch["attention_mask"][:, :6]}
    settings = {"max_new_tokens": 6, "do_sample": True, "pad_token_id": 0}
    torch.manual_seed(7)
    want_ids = reference.generate(**prompts, **settings)
    with torch.no_grad(), context_parallel_paused(model) as paused:
        assert paused == (cp > 1) and context_parallel_mesh(model) is None
        torch.manual_seed(7)
        got_ids = model.generate(**prompts, **settings, synced_gpus=True)
    assert torch.equal(got_ids, want_ids), (got_ids, want_ids)
    if cp > 1:  # CP is back: the model again expects its chunks
        assert context_parallel_mesh(model) is not None
        assert_close(model(**batch, fused_lm_head=True).log_probs.detach(), want.log_probs.detach(), "after generation")

    if cp > 1:
        _split_generation_equals_one_process(model, reference, mesh, batch)
    _replicated_generation_takes_the_group_leaders_completions(model, mesh, rank)

    # Replicas: which ranks share a batch and lead their group, on meshes of this world.
    single = replicas(type("A", (), {"torch_device_mesh": mesh})())
    assert single is not None and (single.dp_index, single.dp_size, single.keep) == (0, 1, (0,))
    if world == 4:
        dp_mesh = init_device_mesh("cpu", (1, 2, 2, 1), mesh_dim_names=("dp_replicate", "dp_shard", "cp", "tp"))
        found = replicas(type("A", (), {"torch_device_mesh": dp_mesh})())
        assert (found.dp_index, found.dp_size, found.keep) == (rank // 2, 2, (0, 2))
        gathered = torch.arange(16).view(8, 2)  # a gather of 2 rows per rank, in rank order
        assert found.once(gathered).tolist() == [[0, 1], [2, 3], [8, 9], [10, 11]]  # ranks 0 and 2


def _split_generation_equals_one_process(model, reference, mesh, batch) -> None:
    """Per-row sampling with the rows split over the cp ranks (`_generate_split`, as around TRL's
    `_generate_single_turn`; the stand-in generates as TRL does, from the trainer's generation
    config): 3 rows (1 and 2 per rank) and 1 row (rank 1 generates a discarded copy) draw what the
    reference draws for all rows in one call with the same seeds."""
    import types

    from transformers import GenerationConfig

    from qwen35_accel.context_parallel import context_parallel_paused
    from qwen35_accel.integrations.trl.row_sampling import row_seed, with_row_sampling
    from qwen35_accel.integrations.trl.sampling import _generate_split

    def generate_single_turn(self, prompt_ids, images, multimodal_fields):
        width = max(len(p) for p in prompt_ids)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompt_ids])
        out = self.model.generate(input_ids=ids, attention_mask=(ids != 0).long(), generation_config=self.generation_config,
                                  synced_gpus=True)
        return out[:, width:].tolist(), None

    config = GenerationConfig(max_new_tokens=5, do_sample=True, temperature=0.8, top_k=30, pad_token_id=0, eos_token_id=None)
    accelerator = types.SimpleNamespace(process_index=0, torch_device_mesh=mesh)
    trainer = types.SimpleNamespace(model=model, generation_config=config, accelerator=accelerator,
                                    args=types.SimpleNamespace(seed=5), state=types.SimpleNamespace(global_step=2))
    prompts = [row[row != 0].tolist() for row in batch["input_ids"][:, :6]]
    for rows, call in ((3, 0), (1, 1)):
        with torch.no_grad(), context_parallel_paused(model):
            got, _ = _generate_split(trainer, generate_single_turn, (prompts[:rows], None, {}), {})
        seeded = with_row_sampling(config, [row_seed(5, 2, call, r) for r in range(rows)])
        reference_trainer = types.SimpleNamespace(model=reference, generation_config=seeded)
        with torch.no_grad():
            want, _ = generate_single_turn(reference_trainer, prompts[:rows], None, {})
        assert got == want, (rows, got, want)
    assert trainer.generation_config is config


def _replicated_generation_takes_the_group_leaders_completions(model, mesh, rank: int) -> None:
    """Replicated generation (TRL's own sampling on every rank of a cp×tp group): where the ranks'
    decoding differs (on a GPU, a rank's own kernel choice can flip a sampled token), every rank
    trains on the completions of the group's leading rank. The stand-in for TRL's
    `_generate_single_turn` returns rank-dependent completions."""
    import types

    from qwen35_accel.integrations.trl.sampling import trl_generate_without_cp

    def generate_single_turn(self, prompt_ids, images, multimodal_fields):
        return [[rank + 1] * (i + 2) for i in range(len(prompt_ids))], None

    accelerator = types.SimpleNamespace(torch_device_mesh=mesh, device=torch.device("cpu"), process_index=rank)
    trainer = types.SimpleNamespace(model=model, model_wrapped=model, accelerator=accelerator,
                                    args=types.SimpleNamespace(max_completion_length=4))
    with torch.no_grad():
        completions, _ = trl_generate_without_cp(generate_single_turn)(trainer, [[5, 6], [7]], None, {})
    assert completions == [[1, 1], [1, 1, 1]], (rank, completions)  # rank 0's, on every rank


@pytest.mark.parametrize("world,cp", [(2, 2), pytest.param(4, 2, marks=pytest.mark.slow)], ids=["cp2", "cp2xtp2"])
def test_grpo_rows_and_generation_under_cp_equal_one_process(world, cp):
    run_world(_worker, world, cp)


def test_left_padded_generation_positions_are_one_sequence_per_row_not_packed_rows():
    """Transformers numbers a left-padded prompt's real tokens from 0 and fills the padding with 1
    ([1, 1, 0, 1, 2]); the packing hook must read that as one sequence per row (a cache works),
    and still refuse rows that restart inside their real tokens."""
    from qwen35_accel.model.packing import _one_document_per_padded_row

    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    positions = (mask.cumsum(1) - 1).masked_fill(mask == 0, 1)
    assert _one_document_per_padded_row(positions, mask, 3)
    packed = torch.tensor([[0, 1, 0, 1, 1], [0, 1, 2, 3, 1], [0, 1, 2, 3, 4]])  # row 0 restarts at its third token
    right_padded = torch.tensor([[1, 1, 1, 1, 0]]).expand(3, 5)
    assert not _one_document_per_padded_row(packed, right_padded, 3)
    assert not _one_document_per_padded_row(positions, torch.ones_like(mask), 3)  # no padding: the position rule decides


def test_left_padded_whole_rows_refuse_a_label_scored_from_padding():
    """A row whose first real token is labelled would be scored, in one process, from the padded
    position before it; moving the padding would silently drop that term: refused."""
    from qwen35_accel.integrations.trl.whole_rows import _left_align

    batch, _ = grpo_rows(64)
    batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)  # prompts labelled too
    with pytest.raises(NotImplementedError, match=r"a label is set on a row's first real token \(rows \[0, 1, 3\]\)"):
        _left_align(dict(batch), batch["input_ids"].shape[1])


def test_what_cannot_be_shared_within_a_group_is_named():
    """vLLM, continuous batching, rollout functions, tools and environments generate or score once
    per process, outside the model (vLLM is not installed here, so TRL itself refuses
    `use_vllm=True` before the plugin could): each is named, none by default (a vision-language model
under cp has a refusal of its own: tests/test_trl_vlm_launch.py)."""
    from types import SimpleNamespace

    from qwen35_accel.integrations.trl.sampling import _refusals

    plain = SimpleNamespace(use_vllm=False, use_transformers_continuous_batching=False, rollout_func=None, tools=[],
                            environment_factories=None, _is_vlm=True)
    assert _refusals(plain, cp=1) == [] and _refusals(plain, cp=2) == []
    everything = SimpleNamespace(use_vllm=True, use_transformers_continuous_batching=True, rollout_func=print,
                                 tools=[print], environment_factories={"env": object}, _is_vlm=False)
    assert _refusals(everything, cp=2) == [
        "vLLM generation (use_vllm=True)", "continuous batching (use_transformers_continuous_batching=True)",
        "a rollout_func", "tools", "an environment_factory",
    ]
