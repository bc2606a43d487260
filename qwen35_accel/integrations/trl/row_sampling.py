"""Sampling that does not depend on which rank, or which batch, generates a row.

Transformers' sampling draws every row's next token from one global RNG stream
(`torch.multinomial` over the batch's `[rows, vocab]` probabilities): a row's tokens depend on
the rows generated beside it and on the stream's position. So the rows of one data-parallel
replica cannot be split across its cp ranks and still draw what the one-process run draws.

Per-row sampling gives each row its own generator, seeded from the run's seed, the training
step, the generation call within that step and the row's global index (`row_seed`), and draws the
token by the Gumbel-max rule: `argmax(log p + G)` with `G = -log(-log U)`, `U ~ Uniform[0, 1)`
from the row's generator, one `U` per vocabulary entry per step — an exact sample of `p`, the
distribution after every processor and sampling warper of the generation config (temperature,
top-k, top-p, min-p, ...). Each row consumes its own stream whatever else is in the batch, so a
row's tokens are the same wherever it is generated (up to logits that differ in the last bits
between batch shapes, which move a sample only at a near-tie).

Where it sits: Transformers applies `generation_config.watermarking_config`'s processor after
every warper (read from Transformers 5.24-5.25 `GenerationMixin._get_logits_processor`), the one
slot a generation config carries that sees the final distribution. `with_row_sampling` returns a
copy of a generation config whose slot holds `RowSampling`; its processor replaces the scores by
0 at the drawn token and -inf elsewhere, so the sampling that follows (`multinomial` of a one-hot
distribution, or `argmax`) returns it. A generation config that already watermarks is refused.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import struct
from collections.abc import Sequence
from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessor
from transformers.generation.configuration_utils import BaseWatermarkingConfig

_SEED_MASK = 2**63 - 1


def row_seed(seed: int, step: int, call: int, row: int) -> int:
    """The generator seed of global row `row` in generation call `call` of training step `step`
    of a run seeded `seed` (a 63-bit hash: independent streams for neighbouring rows and steps)."""
    digest = hashlib.blake2b(struct.pack("<4q", seed, step, call, row), digest_size=8).digest()
    return int.from_bytes(digest, "little") & _SEED_MASK


class RowSampler(LogitsProcessor):
    """Draws each row's next token from its own generator (see the module): `scores` [rows, vocab]
    (the processed, warped scores; -inf where a warper removed a token) -> [rows, vocab] with 0 at
    the drawn token and -inf elsewhere. `seeds[i]` seeds row i's generator, on the scores' device,
    at the first call; every call draws `vocab` uniforms per row."""

    def __init__(self, seeds: Sequence[int]) -> None:
        self.seeds = list(seeds)
        self.generators: list[torch.Generator] | None = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        rows, vocab = scores.shape
        if rows != len(self.seeds):
            raise ValueError(
                f"per-row sampling: {rows} rows of scores for {len(self.seeds)} seeded rows (num_beams and "
                "num_return_sequences must be 1: each generated row is one seeded row)"
            )
        if self.generators is None:
            self.generators = [torch.Generator(device=scores.device).manual_seed(s) for s in self.seeds]
        uniforms = torch.stack([
            torch.rand(vocab, generator=g, device=scores.device, dtype=torch.float32) for g in self.generators
        ])
        # U = 0 (probability 2**-24 per entry) would give -inf noise: clamp to the smallest normal float.
        gumbel = -torch.log(-torch.log(uniforms.clamp_min_(torch.finfo(torch.float32).tiny)))
        drawn = (torch.log_softmax(scores.float(), dim=-1) + gumbel).argmax(dim=-1, keepdim=True)
        return torch.full_like(scores, float("-inf")).scatter_(1, drawn, 0.0)


@dataclasses.dataclass
class RowSampling(BaseWatermarkingConfig):
    """The generation config slot holding the rows' seeds; `construct_processor` makes the
    `RowSampler` of one `generate` call (fresh generators per call)."""

    seeds: list[int] = dataclasses.field(default_factory=list)

    def validate(self) -> None:
        if not all(isinstance(s, int) and 0 <= s <= _SEED_MASK for s in self.seeds):
            raise ValueError(f"per-row sampling: seeds must be integers in [0, 2**63): {self.seeds}")

    def construct_processor(self, vocab_size: int, device: Any = None) -> RowSampler:
        return RowSampler(self.seeds)


def with_row_sampling(generation_config: GenerationConfig, seeds: Sequence[int]) -> GenerationConfig:
    """A copy of `generation_config` that samples row i of the next `generate` call from
    `seeds[i]`'s generator (see the module). Needs `do_sample`, one beam, one sequence per row and
    no watermarking of its own (each refused with the value found)."""
    found = {
        "do_sample": generation_config.do_sample,
        "num_beams": generation_config.num_beams,
        "num_return_sequences": generation_config.num_return_sequences,
        "watermarking_config": generation_config.watermarking_config,
    }
    if not (found["do_sample"] and (found["num_beams"] or 1) == 1 and (found["num_return_sequences"] or 1) == 1
            and found["watermarking_config"] is None):
        raise ValueError(
            f"per-row sampling (QWEN35_ACCEL_RL_GENERATION=split) needs do_sample=True, num_beams=1, "
            f"num_return_sequences=1 and no watermarking_config; the generation config has {found}"
        )
    config = copy.deepcopy(generation_config)
    config.watermarking_config = RowSampling(seeds=[int(s) for s in seeds])
    return config
