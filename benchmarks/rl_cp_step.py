"""A GRPO step under context parallelism: cp 2 vs cp 1, training and generation apart.

    python benchmarks/rl_cp_step.py [--completion 2048] [--prompt 64] [--new-tokens 64] [--gen-rows 8]
                                    [--replica-layouts dp2,dp2xcp2,dp2xtp2] [--rounds 2] [--smoke]

The same tiny-but-wide dense Qwen3.5 as cp_memory.py (hidden 512, 4 layers: 3 GatedDeltaNet +
1 full attention, fp32, sdpa) under `install()` + `PARALLELIZER.apply`, with TRL's fused head
added as GRPOTrainer adds it (`trl.trainer.grpo_trainer.add_fused_lm_head(model,
outputs=("log_probs", "entropy"))`), 1 thread per rank:
- cp 1: world 1, mesh ("dp_replicate", "dp_shard", "cp", "tp") = (1, 1, 1, 1);
- cp 2: world 2, the same mesh with cp 2 (one data-parallel replica of 2 ranks, FSDP2 over them).
Trainer-free, the calls GRPOTrainer makes: the batch is one prompt's group of 2 completions
(`num_generations` 2) as GRPOTrainer concatenates them, [prompt left-padded by 8 | completions
right-padded; the second stops at EOS 1/4 short], the same whole rows on every rank of the cp
group (the replica's batch); the per-token log-probs and entropies come from TRL's own
`GRPOTrainer._get_per_token_logps_and_entropies` (labels on the completion, the fused head on
whole rows; on cp 2 our pre-hook shards them over cp and gathers the fields back); the loss is
TRL 1.16's default `dapo` with `num_iterations` 1 and `beta` 0 (old log-probs = the detached
ones, advantages from fixed rewards normalised within the group), then backward.
Measured, in one run, the worlds alternating (cp 1, cp 2) `--rounds` times:
- per-rank saved-for-backward bytes of the training forward (parameters excluded as registered
  at each save), decoder and head apart: target <= 0.55 x cp 1 at cp 2;
- step time (forward + backward, barrier before; slowest rank): medians and their ratio;
- generation apart: `--new-tokens` sampled tokens for `--gen-rows` rows of one prompt with the
  model's CP paused (`context_parallel_paused`, what the sampling integration does), CPU time per
  rank: every rank generating every row (Transformers' sampling) with FSDP2 gathering the units
  per forward, and once per call (`units_gathered`, the default); and split generation
  (`QWEN35_ACCEL_RL_GENERATION=split` through the integration's `_generate_split`: per-row
  sampling, each cp rank 1/cp of the rows, the completions gathered), whose tokens must be the
  same at cp 1 and cp 2;
- with `--replica-layouts`: generation alone (the same three modes) on data-parallel meshes, dp 2
  (world 2), dp 2 × cp 2 and dp 2 × tp 2 (world 4), each replica seeding its rows by its dp index:
  CPU time per rank against dp 2's, and each replica's split completions against dp 2's.
Runs are appended to `rl_cp_step.md` (a shared machine's runs differ; each keeps its header).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
import time
import types
from pathlib import Path
from typing import Any

import _report
from cp_memory import SMOKE_SHAPE, WIDE_SHAPE, shape_note

TARGET = 0.55
OUTPUTS = ("log_probs", "entropy")  # what GRPOTrainer asks its policy's head for
LEFT_PAD = 8
EPSILON = 0.2  # GRPOConfig's epsilon (low = high by default)


def grpo_batch(prompt: int, completion: int, vocab_size: int) -> dict[str, Any]:
    """GRPOTrainer's inputs for one prompt's group of 2: `prompt_ids`/`prompt_mask` [2, prompt]
    (left-padded by LEFT_PAD), `completion_ids`/`completion_mask` [2, completion] (row 1 stops
    at 3/4, its EOS kept, then padding), `advantages` [2] from rewards normalised in the group."""
    import torch

    gen = torch.Generator().manual_seed(0)
    prompt_mask = (torch.arange(prompt) >= LEFT_PAD).long().expand(2, prompt)
    prompt_ids = torch.randint(2, vocab_size, (1, prompt), generator=gen).expand(2, prompt).masked_fill(prompt_mask == 0, 0)
    lengths = torch.tensor([completion, 3 * completion // 4])
    completion_mask = (torch.arange(completion) < lengths[:, None]).long()
    completion_ids = torch.randint(2, vocab_size, (2, completion), generator=gen).masked_fill(completion_mask == 0, 0)
    completion_ids[1, lengths[1] - 1] = 1  # EOS
    rewards = torch.tensor([1.0, 0.0])
    advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-4)  # scale_rewards="group"
    return {"prompt_ids": prompt_ids.contiguous(), "prompt_mask": prompt_mask.contiguous(), "completion_ids": completion_ids,
            "completion_mask": completion_mask, "advantages": advantages, "num_items_in_batch": completion_mask.sum()}


def grpo_loss(model, inputs: dict[str, Any]):
    """GRPOTrainer._compute_loss for loss_type "dapo", num_iterations 1, beta 0, one process per
    replica, no gradient accumulation: (loss, the completion tokens' log-probs summed: a figure
    that depends on the model, unlike this loss's value at num_iterations 1)."""
    import torch
    from trl import GRPOTrainer

    input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    logits_to_keep = inputs["completion_ids"].size(1)
    # TRL's method without its profiling decorator (which reads the trainer's args): all it reads is the autocast.
    per_token = GRPOTrainer._get_per_token_logps_and_entropies.__wrapped__
    holder = types.SimpleNamespace(accelerator=types.SimpleNamespace(autocast=contextlib.nullcontext))
    logps, _, _ = per_token(
        holder, model, input_ids, attention_mask, logits_to_keep, compute_entropy=True
    )
    mask = inputs["completion_mask"]
    coef_1 = torch.exp(logps - logps.detach())
    coef_2 = torch.clamp(coef_1, 1 - EPSILON, 1 + EPSILON)
    advantages = inputs["advantages"].unsqueeze(1)
    per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    return (per_token_loss * mask).sum() / inputs["num_items_in_batch"].clamp(min=1.0), (logps * mask).sum().detach()


def _build(layout: tuple[int, int, int], seq: int, shape: dict[str, Any]):
    """The model under `install()` + `PARALLELIZER.apply` on a (dp_shard, cp, tp) = `layout` mesh: (model, mesh)."""
    import trl.trainer.grpo_trainer as grpo_module
    from torch.distributed.device_mesh import init_device_mesh

    from qwen35_accel import PARALLELIZER, install
    from qwen35_accel.testing.tiny import build_tiny_causal_lm

    install()
    model = build_tiny_causal_lm(seed=0, max_position_embeddings=seq, **shape)
    grpo_module.add_fused_lm_head(model, outputs=OUTPUTS)  # as GRPOTrainer calls it
    mesh = init_device_mesh("cpu", (1, *layout), mesh_dim_names=("dp_replicate", "dp_shard", "cp", "tp"))
    mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    PARALLELIZER.apply(model, mesh)
    return model, mesh


def _time_generation(model: Any, mesh: Any, inputs: dict[str, Any], prompt: int, args: dict[str, Any],
                     replica: int) -> dict[str, tuple[float, float, list[list[int]]]]:
    """{mode: (wall s, CPU s, completions)} of generating `--gen-rows` rows of one prompt with the
    model's CP paused, the second of two calls per mode (the first warms up). Modes: every rank
    every row with Transformers' sampling (the same seed on every rank), FSDP2 gathering the units
    per forward ("per_forward") or once per call ("gathered", `units_gathered`, the default now);
    and "split" (QWEN35_ACCEL_RL_GENERATION=split through the integration's own `_generate_split`:
    per-row sampling, each cp rank 1/cp of the rows, units gathered once, completions all-gathered
    over the cp group; `replica`: the data-parallel index the rows' seeds count from)."""
    import torch
    import torch.distributed as dist

    from qwen35_accel.parallel.context_parallel.model import context_parallel_paused
    from qwen35_accel.parallel.gathered_generation import units_gathered

    gen_rows = args["gen_rows"]
    prompts = {"input_ids": inputs["prompt_ids"][:1].expand(gen_rows, -1),
               "attention_mask": inputs["prompt_mask"][:1].expand(gen_rows, -1)}
    settings = {"max_new_tokens": args["new_tokens"], "min_new_tokens": args["new_tokens"], "do_sample": True,
                "pad_token_id": 0, "synced_gpus": True}
    generation = {}
    for mode in ("per_forward", "gathered", "split"):
        gen_times, gen_cpu = [], []
        for _ in range(2):  # the first warms up
            dist.barrier()
            start, cpu_start = time.perf_counter(), time.process_time()
            gathered = units_gathered(model, torch.device("cpu")) if mode != "per_forward" else contextlib.nullcontext()
            with torch.no_grad(), context_parallel_paused(model), gathered:
                if mode == "split":
                    ids = split_generation(model, mesh, prompts, settings, replica)
                else:
                    torch.manual_seed(7)
                    ids = model.generate(**prompts, **settings)[:, prompt:].tolist()
            gen_times.append(time.perf_counter() - start)
            gen_cpu.append(time.process_time() - cpu_start)
        generation[mode] = (gen_times[-1], gen_cpu[-1], ids)
    assert generation["gathered"][2] == generation["per_forward"][2], "gathering once changed the sampled tokens"
    return generation


def _generation_worker(rank: int, world: int, args: dict[str, Any], shape: dict[str, Any], layout: list[int],
                       out_path: str) -> None:
    """Generation alone on a (dp_shard, cp, tp) = `layout` mesh (`_time_generation`), each replica
    seeding its rows by its dp index."""
    prompt, completion = args["prompt"], args["completion"]
    model, mesh = _build(tuple(layout), prompt + completion + args["new_tokens"], shape)
    replica = mesh["dp_shard"].get_local_rank()
    generation = _time_generation(model, mesh, grpo_batch(prompt, completion, shape["vocab_size"]), prompt, args, replica)
    result = {"rank": rank, "replica": replica, "generated": generation["gathered"][2],
              "generated_split": generation["split"][2],
              **{f"generate_{mode}_{what}": generation[mode][i] for mode in generation for i, what in ((0, "s"), (1, "cpu_s"))}}
    _report.write_gathered(result, world, rank, out_path)


def _worker(rank: int, world: int, args: dict[str, Any], shape: dict[str, Any], measure: bool, out_path: str) -> None:
    import torch
    import torch.distributed as dist

    from qwen35_accel.testing.saved_tensors import saved_bytes_by_part

    prompt, completion = args["prompt"], args["completion"]
    model, mesh = _build((1, world, 1), prompt + completion + args["new_tokens"], shape)
    inputs = grpo_batch(prompt, completion, shape["vocab_size"])

    def step(saved: dict | None) -> tuple[float, float, float, float]:
        model.zero_grad(set_to_none=True)
        dist.barrier()
        start, cpu_start = time.perf_counter(), time.process_time()
        if saved is None:
            loss, logp = grpo_loss(model, inputs)
        else:  # untimed: the hooks cost time
            (loss, logp), parts = saved_bytes_by_part(model, lambda: grpo_loss(model, inputs))
            saved.update(parts)
        loss.backward()
        return time.perf_counter() - start, time.process_time() - cpu_start, float(loss.detach()), float(logp)

    saved: dict[str, int] = {}
    times, cpu = [], []
    if measure:
        _, _, loss, logp = step(saved)  # the first warmup step measures what is saved
    for i in range(args["warmup"] - int(measure) + args["steps"]):
        elapsed, cpu_s, loss, logp = step(None)
        if i >= args["warmup"] - int(measure):
            times.append(elapsed)
            cpu.append(cpu_s)
    grad_norm = float(torch.sqrt(sum((p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).pow(2).sum()
                                     for p in model.parameters() if p.grad is not None)))

    generation = _time_generation(model, mesh, inputs, prompt, args, replica=0)
    result = {"rank": rank, "times": times, "cpu": cpu, "loss": loss, "logp": logp, "grad_norm": grad_norm, "saved": saved,
              **{f"generate_{mode}_{what}": generation[mode][i] for mode in generation for i, what in ((0, "s"), (1, "cpu_s"))},
              "generated": generation["gathered"][2], "generated_split": generation["split"][2]}
    _report.write_gathered(result, world, rank, out_path)


def split_generation(model: Any, mesh: Any, prompts: dict[str, Any], settings: dict[str, Any], replica: int = 0) -> list[list[int]]:
    """The rows of `prompts` generated as `QWEN35_ACCEL_RL_GENERATION=split` generates them around
    TRL's `_generate_single_turn` (`integrations/trl/sampling._generate_split`; a stand-in for TRL's method
    builds the left-padded batch and calls `generate` with the trainer's generation config)."""
    import types

    from transformers import GenerationConfig

    from qwen35_accel.integrations.trl.sampling import _generate_split

    extra = {k: settings[k] for k in ("synced_gpus",)}
    config = GenerationConfig(**{k: v for k, v in settings.items() if k not in extra})

    def generate_single_turn(self: Any, prompt_ids: list[list[int]], images: Any, multimodal_fields: Any) -> Any:
        import torch

        width = max(len(p) for p in prompt_ids)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompt_ids])
        out = self.model.generate(input_ids=ids, attention_mask=(ids != 0).long(), generation_config=self.generation_config,
                                  **extra)
        return out[:, width:].tolist(), None

    trainer = types.SimpleNamespace(model=model, generation_config=config, state=types.SimpleNamespace(global_step=0),
                                    accelerator=types.SimpleNamespace(process_index=replica, torch_device_mesh=mesh),
                                    args=types.SimpleNamespace(seed=7))
    rows = [row[mask.bool()].tolist() for row, mask in zip(prompts["input_ids"], prompts["attention_mask"])]
    return _generate_split(trainer, generate_single_turn, (rows, None, {}), {})[0]


LAYOUTS = {"dp2": (2, 1, 1), "dp2xcp2": (2, 2, 1), "dp2xtp2": (2, 1, 2)}  # (dp_shard, cp, tp)


def _replica_lines(args: argparse.Namespace, rounds: list[dict[str, list[dict]]], layouts: dict[str, tuple]) -> list[str]:
    """The data-parallel layouts' generation table: CPU time per rank (busiest rank, median over
    rounds) of each mode, against dp2 every row per forward; each replica's split completions
    against dp2's replica of the same index."""
    def median(name: str, key: str) -> float:
        return statistics.median(max(res[key] for res in rd[name]) for rd in rounds)

    base = median("dp2", "generate_per_forward_cpu_s")
    lines = [
        f"Generation alone on data-parallel meshes ({args.new_tokens} new tokens x {args.gen_rows} rows per replica, "
        "CPU time per rank, busiest rank; ratios against dp 2 with every rank generating its rows per forward):\n",
        "| layout | world | every row, per forward (s) | every row, gathered once (s) | split (s) | split / dp 2 | "
        "split completions = dp 2's, per replica |",
        "|---|---|---|---|---|---|---|",
    ]
    want = {res["replica"]: res["generated_split"] for res in rounds[0]["dp2"]}
    for name, layout in layouts.items():
        same = all(res["generated_split"] == want[res["replica"]] for rd in rounds for res in rd[name])
        split = median(name, "generate_split_cpu_s")
        lines.append(f"| {name} | {layout[0] * layout[1] * layout[2]} | {median(name, 'generate_per_forward_cpu_s'):.2f} | "
                     f"{median(name, 'generate_gathered_cpu_s'):.2f} | {split:.2f} | {split / base:.3f} | "
                     f"{'yes' if same else 'NO'} |")
    return lines


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--completion", type=int, default=2048, help="completion tokens of the longer row (the other: 3/4)")
    parser.add_argument("--prompt", type=int, default=64, help=f"prompt width, its first {LEFT_PAD} left padding")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens sampled per row in the timed generation")
    parser.add_argument("--gen-rows", type=int, default=8, help="rows of the timed generation (one prompt's group)")
    parser.add_argument("--replica-layouts", default="",
                        help="also generation alone on data-parallel meshes, e.g. dp2,dp2xcp2,dp2xtp2 (world 2 and 4; "
                             "each against dp2's)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--out-name", default="rl_cp_step", help="results file stem (in --results-dir)")
    _report.add_arguments(parser)
    args = parser.parse_args()
    if args.warmup < 1:
        parser.error(f"--warmup {args.warmup}: at least 1 (the first round's warmup step measures the saved bytes)")
    shape = WIDE_SHAPE
    if args.smoke:
        args.completion, args.prompt, args.new_tokens, args.rounds, args.warmup, args.steps = 128, 16, 4, 1, 1, 1
        args.gen_rows = 3
        shape = SMOKE_SHAPE
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import trl

    from qwen35_accel.testing.local_world import run_local_world

    settings = {k: getattr(args, k) for k in ("prompt", "completion", "new_tokens", "gen_rows", "warmup", "steps")}
    configs = (1, 2)
    run = _report.Run()
    rounds: list[dict[int, list[dict]]] = []
    layouts = {name: LAYOUTS[name] for name in filter(None, args.replica_layouts.split(","))}
    if layouts and "dp2" not in layouts:
        parser.error(f"--replica-layouts {args.replica_layouts}: include dp2 (the others are measured against it)")
    replica_rounds: list[dict[str, list[dict]]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            this_round = {}
            for cp in configs:
                path = os.path.join(tmp, f"r{r}_cp{cp}.json")
                run_local_world(_worker, cp, settings, shape, r == 0, path, threads_per_rank=1, timeout=1800)
                this_round[cp] = json.loads(Path(path).read_text())
            rounds.append(this_round)
            replica_round = {}
            for name, layout in layouts.items():
                path = os.path.join(tmp, f"r{r}_{name}.json")
                run_local_world(_generation_worker, layout[0] * layout[1] * layout[2], settings, shape, list(layout), path,
                                threads_per_rank=1, timeout=1800)
                replica_round[name] = json.loads(Path(path).read_text())
            replica_rounds.append(replica_round)

    steps = {cp: [t for rd in rounds for t in _report.slowest_rank_steps(rd[cp])] for cp in configs}
    med = {cp: statistics.median(v) for cp, v in steps.items()}
    cpu = {cp: statistics.median(max(cs) for rd in rounds for cs in zip(*(res["cpu"] for res in rd[cp]))) for cp in configs}
    def gen_median(key: str) -> dict[int, float]:  # the busiest rank's, median over the rounds
        return {cp: statistics.median(max(res[key] for res in rd[cp]) for rd in rounds) for cp in configs}

    gen, gen_cpu = gen_median("generate_per_forward_s"), gen_median("generate_per_forward_cpu_s")
    gathered_cpu, split_cpu = gen_median("generate_gathered_cpu_s"), gen_median("generate_split_cpu_s")
    saved = {cp: rounds[0][cp] for cp in configs}
    total = {cp: max(r["saved"]["decoder"] + r["saved"]["head"] for r in saved[cp]) for cp in configs}
    ratio = total[2] / total[1]
    same_tokens = all(res["generated"] == rounds[0][1][0]["generated"] for rd in rounds for cp in configs for res in rd[cp])
    same_split = all(res["generated_split"] == rounds[0][1][0]["generated_split"]
                     for rd in rounds for cp in configs for res in rd[cp])
    rows = 2 * (args.prompt + args.completion)
    lines = [
        f"GRPO step: one prompt's group of 2 rows, prompt {args.prompt} tokens (left padding {LEFT_PAD}), completions "
        f"{args.completion} and {3 * args.completion // 4} tokens (right-padded to {args.completion}): {rows} tokens in the "
        f"batch; loss dapo, num_iterations 1, beta 0; 1 thread per rank; {args.rounds} rounds x (cp 1 world, cp 2 world), "
        f"{args.warmup} warmup (the first round's measures saved bytes) + {args.steps} timed steps per world; "
        f"{shape_note(shape).replace(', batch 1', '')}; TRL {trl.__version__}.\n",
        "| config | rank | saved for backward: decoder (MiB) | head (MiB) | median step (s) | median CPU / wall | generation (s) | loss | completion log-probs, sum | grad norm |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for cp in configs:
        for rank in range(cp):
            times = [t for rd in rounds for t in rd[cp][rank]["times"]]
            busy = [c / t for rd in rounds for c, t in zip(rd[cp][rank]["cpu"], rd[cp][rank]["times"])]
            r0 = saved[cp][rank]
            lines.append(
                f"| cp {cp} (world {cp}) | {rank} | {_mib(r0['saved']['decoder'])} | {_mib(r0['saved']['head'])} | "
                f"{statistics.median(times):.2f} | {statistics.median(busy):.2f} | "
                f"{statistics.median(rd[cp][rank]['generate_per_forward_s'] for rd in rounds):.2f} | {rounds[-1][cp][rank]['loss']:.6f} | "
                f"{rounds[-1][cp][rank]['logp']:.4f} | {rounds[-1][cp][rank]['grad_norm']:.6f} |"
            )
    verdict = "meets" if ratio <= TARGET else "MISSES"
    lines += [
        f"\n**Saved bytes per rank, cp 2 / cp 1 (worst rank): {ratio:.3f}** (target <= {TARGET}: {verdict}; ideal 0.500) "
        f"- {_mib(total[2])} MiB vs {_mib(total[1])} MiB.",
        f"**Training step time (forward + backward), cp 2 / cp 1 (medians, slowest rank): {med[2] / med[1]:.3f}** "
        f"({med[2]:.2f} s vs {med[1]:.2f} s; ideal 0.500). CPU time per rank (busiest rank): {cpu[2] / cpu[1]:.3f} "
        f"({cpu[2]:.2f} s vs {cpu[1]:.2f} s; less sensitive to other load, blind to waits in collectives).",
        f"**Generation of {args.new_tokens} new tokens x {args.gen_rows} rows, CP paused, every rank every row, FSDP2 "
        f"gathering per forward, cp 2 / cp 1 (medians, slowest rank): {gen[2] / gen[1]:.3f}** ({gen[2]:.2f} s vs "
        f"{gen[1]:.2f} s). CPU time per rank (busiest rank): {gen_cpu[2] / gen_cpu[1]:.3f} ({gen_cpu[2]:.2f} s vs "
        f"{gen_cpu[1]:.2f} s). Sampled tokens identical in every world: {'yes' if same_tokens else 'NO'}.",
        f"**The same with the units gathered once per call (`units_gathered`, the default now), CPU time per rank, "
        f"cp 2 / cp 1 per forward: {gathered_cpu[2] / gen_cpu[1]:.3f}** ({gathered_cpu[2]:.2f} s vs {gen_cpu[1]:.2f} s; "
        f"cp 1 gathered {gathered_cpu[1]:.2f} s); the same tokens as per forward on every rank (asserted).",
        f"**Split (`QWEN35_ACCEL_RL_GENERATION=split`: per-row sampling, each cp rank {args.gen_rows // 2}-"
        f"{-(-args.gen_rows // 2)} of the rows, units gathered once), CPU time per rank, cp 2 / cp 1 per forward: "
        f"{split_cpu[2] / gen_cpu[1]:.3f}** (target <= 0.6; {split_cpu[2]:.2f} s vs {gen_cpu[1]:.2f} s; against cp 1 "
        f"split, every row on its one rank: {split_cpu[2] / split_cpu[1]:.3f}). Per-row completions identical at cp 1 "
        f"and cp 2: {'yes' if same_split else 'NO'}.",
    ]
    utilisation = {cp: statistics.median(c / t for rd in rounds for res in rd[cp] for c, t in zip(res["cpu"], res["times"]))
                   for cp in configs}
    if min(utilisation.values()) < 0.9:
        lines.append(
            "\n**WARNING: the ranks got less than 90% of a core (median CPU/wall: "
            + ", ".join(f"cp {cp} {u:.2f}" for cp, u in utilisation.items())
            + "). Other processes were competing for the cores, so the wall-clock ratios are not trustworthy; the CPU-time "
            "ratio and the saved bytes are.**"
        )
    if layouts:
        lines += ["", *_replica_lines(args, replica_rounds, layouts)]
    table = "\n".join(lines)
    print(table)
    run.write(_report.results_dir(args), f"{args.out_name}.md", "A GRPO step under context parallelism: cp 2 vs cp 1", table,
              append=True)


if __name__ == "__main__":
    main()
