"""Generation with the FSDP2 units gathered once per `generate` call
(`qwen35_accel.parallel.gathered_generation`): the same tokens and logits as FSDP2's per-forward
gathering, a unit's all-gathers once per call instead of once per new token."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from _dist import run_world
from _parity import assert_close

pytestmark = pytest.mark.multiprocess

NEW_TOKENS = 6


def _counting_all_gathers(counts: list[int]):
    """Wrap torch.distributed's all-gather entry points FSDP2 calls (by the name each torch has) to count calls."""
    originals = {name: getattr(dist, name) for name in ("all_gather_single", "all_gather_into_tensor") if hasattr(dist, name)}

    def wrap(function):
        def counted(*args, **kwargs):
            counts.append(1)
            return function(*args, **kwargs)
        return counted

    for name, function in originals.items():
        setattr(dist, name, wrap(function))
    return originals


def _generation_worker(rank: int, world: int, cp: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from qwen35_accel import PARALLELIZER
    from qwen35_accel.parallel.context_parallel.model import context_parallel_paused
    from qwen35_accel.parallel.gathered_generation import units_gathered
    from qwen35_accel.testing.tiny import build_tiny_causal_lm

    mesh = init_device_mesh("cpu", (1, world // cp, cp, 1), mesh_dim_names=("dp_replicate", "dp_shard", "cp", "tp"))
    mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    model = PARALLELIZER.apply(build_tiny_causal_lm(seed=0), mesh)
    prompt = torch.randint(1, model.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(3))
    settings = dict(max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    results, gathers = {}, {}
    for gathered in (True, False, True):  # gathered first: before any forward (the root's lazy init), and again after
        counts: list[int] = []
        originals = _counting_all_gathers(counts)
        try:
            with torch.no_grad(), context_parallel_paused(model), (units_gathered(model, torch.device("cpu"))
                                                                    if gathered else torch.enable_grad()) as took:
                out = model.generate(prompt, **settings)
        finally:
            for name, function in originals.items():
                setattr(dist, name, function)
        if gathered:
            assert took is True
        results[gathered], gathers[gathered] = out, len(counts)
    assert torch.equal(results[True].sequences, results[False].sequences)
    for a, b in zip(results[True].logits, results[False].logits):
        assert_close(a, b, "logits", rtol=0, atol=0)  # the same gathered parameters compute every forward
    # Gathered: at most one all-gather per unit for the whole call; per forward: those of every unit that
    # reshards after forward, in each of the NEW_TOKENS forwards (the prompt's, then one per cached step).
    units = sum(1 for m in model.modules() if hasattr(m, "unshard"))
    assert 0 < gathers[True] <= units and gathers[False] >= NEW_TOKENS * gathers[True], (gathers, units)
    # Back to training: the units resharded and their settings restored, a training step is bitwise the one a
    # model that never generated takes.
    from qwen35_accel.context_parallel import shard_batch
    from qwen35_accel.testing.tiny import random_batch

    batch = random_batch(2, 16, model.config.vocab_size, seed=5)
    local = shard_batch(batch, mesh["cp"]) if cp > 1 else batch
    fresh = PARALLELIZER.apply(build_tiny_causal_lm(seed=0), mesh)
    losses = []
    for m in (model, fresh):
        loss = m(**local).loss
        loss.backward()
        losses.append(loss.detach())
    assert torch.equal(losses[0], losses[1])
    for (name, p), q in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(p.grad.to_local(), q.grad.to_local()), name


@pytest.mark.parametrize("cp", [2, 1], ids=["cp2", "fsdp2"])
def test_generation_gathers_each_unit_once_and_draws_the_same_tokens(cp):
    run_world(_generation_worker, 2, cp)


def _storage_bytes(obj, seen: set[int], depth: int = 0) -> int:
    """Bytes of the distinct tensor storages reachable from `obj` (a cache's attributes)."""
    if isinstance(obj, torch.Tensor):
        key = obj.untyped_storage().data_ptr()
        if key in seen:
            return 0
        seen.add(key)
        return obj.untyped_storage().nbytes()
    if isinstance(obj, dict):
        return sum(_storage_bytes(v, seen, depth + 1) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_storage_bytes(v, seen, depth + 1) for v in obj)
    if hasattr(obj, "__dict__") and depth < 4:
        return sum(_storage_bytes(v, seen, depth + 1) for v in vars(obj).values())
    return 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_cache_counted_bounds_what_transformers_caches(dtype):
    """`generation_cache_bytes` (what the gathering check adds for the cache) against the cache
    Transformers' generate leaves: never less, and within the last token's keys and values and
    the fp32 recurrent states' bound."""
    from qwen35_accel.parallel.gathered_generation import generation_cache_bytes
    from qwen35_accel.testing.tiny import build_tiny_causal_lm

    model = build_tiny_causal_lm(dtype=dtype)
    prompt = torch.randint(1, model.config.vocab_size, (3, 10), generator=torch.Generator().manual_seed(0))
    out = model.generate(prompt, max_new_tokens=6, do_sample=False, return_dict_in_generate=True, pad_token_id=0)
    cache = getattr(out, "past_key_values", None) or out.cache
    actual = _storage_bytes(cache, set())
    counted = generation_cache_bytes(model.config, rows=3, tokens=16, dtype=dtype)
    assert actual > 0 and actual <= counted <= 1.6 * actual, (actual, counted)


def test_free_memory_on_cuda_counts_what_the_caching_allocator_holds_unused(monkeypatch):
    """After a training step most of its peak stays reserved by torch's caching allocator;
    `mem_get_info` reports it used. The arithmetic, with the three readings set (no GPU here)."""
    from qwen35_accel.parallel import gathered_generation

    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 50 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 20 * gib)
    assert gathered_generation.free_bytes(torch.device("cuda", 0)) == (2 + 50 - 20) * gib


def test_the_package_reads_no_private_fsdp2_state():
    """FSDP2's public API only (`FSDPModule.set_reshard_after_forward`, `unshard`, `reshard`) and
    qwen35_accel's own unit records: private names change between torch releases."""
    from pathlib import Path

    import qwen35_accel

    private = ("_get_fsdp_state", "_fsdp_param_groups", "post_forward_mesh_info", "_auto_reshard_after_forward",
               "._lazy_init(", "_fsdp_param_group")
    root = Path(qwen35_accel.__file__).parent
    found = [f"{path.relative_to(root)}: {name}" for path in root.rglob("*.py") for name in private if name in path.read_text()]
    assert not found, found
