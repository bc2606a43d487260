"""Per-row sampling (`qwen35_accel.integrations.trl.row_sampling`, `QWEN35_ACCEL_RL_GENERATION=split`):
a row's tokens do not depend on the rows generated beside it, and each token is a sample of the
distribution Transformers' own sampling draws from (TRL's generation config: temperature, top-k,
top-p), through the real `generate`."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import GenerationConfig

from qwen35_accel.integrations.trl.row_sampling import row_seed, with_row_sampling
from qwen35_accel.testing.tiny import build_tiny_causal_lm

# TRL's defaults are temperature 1, top_p 1, top_k 0: every warper on, at values that change the distribution.
SAMPLING = dict(do_sample=True, temperature=0.7, top_k=20, top_p=0.95, pad_token_id=0, eos_token_id=None)


def _left_padded(prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    length = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), length, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, length - len(prompt):] = prompt
        mask[row, length - len(prompt):] = 1
    return ids, mask


def test_a_row_draws_the_same_tokens_in_any_batch_and_position():
    model = build_tiny_causal_lm(seed=0).eval()
    lengths = [5, 9, 3, 7]
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, model.config.vocab_size, (n,), generator=generator) for n in lengths]
    config = GenerationConfig(max_new_tokens=8, **SAMPLING)

    def generate(rows: list[int]) -> list[list[int]]:
        ids, mask = _left_padded([prompts[r] for r in rows])
        seeded = with_row_sampling(config, [row_seed(0, 3, 0, r) for r in rows])
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=seeded)
        return out[:, ids.shape[1]:].tolist()

    together = generate([0, 1, 2, 3])
    assert generate([0, 1]) + generate([2, 3]) == together, "split across two calls (other padding, other batch)"
    assert generate([3, 2, 1, 0])[::-1] == together, "rows in another order"
    assert len({tuple(r) for r in together}) == 4
    assert config.watermarking_config is None, "the caller's config is not modified"


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    support = probs > 0
    expected = probs[support] * counts.sum()
    return float(((counts[support] - expected) ** 2 / expected).sum()), int(support.sum()) - 1


def test_each_token_is_a_sample_of_transformers_sampling_distribution():
    """4000 rows of one prompt, one new token each: the per-row draws' histogram against the
    distribution Transformers' sampling draws from (softmax of the scores `generate` returns with
    `output_scores`: after temperature, top-k, top-p), beside stock multinomial draws of the same
    size. Never a token outside the warped support; chi-square within 6 sigma of its degrees of
    freedom (seeds fixed: the counts are deterministic)."""
    model = build_tiny_causal_lm(seed=0).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(15)  # peaked logits: temperature, top-k and top-p all change the distribution
    prompt = torch.randint(1, model.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(2))
    rows = 4000
    config = GenerationConfig(max_new_tokens=1, **SAMPLING)
    with torch.no_grad():
        scores = model.generate(prompt, generation_config=config, output_scores=True, return_dict_in_generate=True).scores[0]
        probs = torch.softmax(scores[0].double(), dim=-1)
        unwarped = torch.softmax(model(prompt).logits[0, -1].double(), dim=-1)
        batch = prompt.expand(rows, -1)
        seeded = with_row_sampling(config, [row_seed(0, 0, 0, r) for r in range(rows)])
        drawn = model.generate(batch, generation_config=seeded)[:, -1]
        torch.manual_seed(0)
        stock = model.generate(batch, generation_config=config)[:, -1]
    vocab = probs.numel()
    assert 5 <= int((probs > 0).sum()) <= 20, "top-k / top-p left a support worth testing"
    assert (unwarped - probs).abs().max() > 0.05, "the warpers change the distribution"
    for name, tokens in (("per-row", drawn), ("stock", stock)):
        counts = torch.bincount(tokens, minlength=vocab).double()
        assert counts[probs == 0].sum() == 0, f"{name}: drew a token the warpers removed"
        chi2, dof = _chi_square(counts, probs)
        assert chi2 < dof + 6 * math.sqrt(2 * dof), f"{name}: chi-square {chi2:.1f} for {dof} degrees of freedom"


@pytest.mark.parametrize("setting,value", [
    ("do_sample", False), ("num_beams", 2), ("num_return_sequences", 2),
])
def test_a_config_per_row_sampling_cannot_serve_is_refused_with_its_values(setting, value):
    with pytest.raises(ValueError, match=f"'{setting}': {value}"):
        with_row_sampling(GenerationConfig(**{**SAMPLING, setting: value}), [1])


def test_seeds_differ_by_every_coordinate_and_fit_a_generator():
    seeds = {row_seed(s, step, call, row) for s in (0, 1) for step in (0, 1) for call in (0, 1) for row in (0, 1, 2)}
    assert len(seeds) == 24 and all(0 <= s < 2**63 for s in seeds)
    torch.Generator().manual_seed(max(seeds))
