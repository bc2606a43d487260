"""TRL's sampling trainers (GRPO, RLOO; TRL 1.16) under context and tensor parallelism: one
sampling per data-parallel replica.

Accelerate's data loader hands every rank of a cp×tp group the same prompts (it shards over
the data-parallel ranks only). TRL then treats each process as a replica of its own: it seeds
each by process index, sizes `generation_batch_size` by the number of processes, gathers
rewards, lengths and metrics over every process and keeps each process's slice of the
advantages by process index. Here the ranks of a cp×tp group act as the one data-parallel
replica they are, the one a `dp N` run without cp/tp would have at that index:

- `trl_sampling_setup` (before `train()` builds its data loader): the RNG seeded `seed + dp index` (TRL:
  `seed + process index`), `generation_batch_size` per_device × dp × steps_per_generation
  (TRL: × processes), what cannot be shared within a group refused on every rank (vLLM,
  continuous batching, rollout functions, tools and environments, images under cp).
- `trl_replica_view` (around `_generate_and_score_completions` and `_compute_loss`): the
  trainer's `accelerator` seen as the replica's for the call: `process_index` the dp index,
  `num_processes` dp, `gather` (and `gather_for_metrics` through it) keeping one copy of
  each group's rows; TRL's module-level `gather`/`gather_object` the same while it is active
  (`trl_gather_once`, `trl_gather_object_once`). So advantages, reward statistics, token
  counts, clip ratios and DAPO's normaliser are the `dp N` run's.
- `trl_generate_without_cp` (around `_generate_single_turn`): generation runs with the model's
  CP paused (`context_parallel_paused`): every rank generates the whole sequences with a
  cache, FSDP2 gathering its units as in any data-parallel generation; the group's ranks draw
  the same tokens (same seed, same prompts, the same logits). The group generates its prompts
  once per rank: its wall time is one replica's. The units are gathered once per call where
  they fit (`parallel.gathered_generation`), else per forward. With
  `QWEN35_ACCEL_RL_GENERATION=split`, in any world: per-row sampling (`row_sampling`), and under
  cp > 1 each cp rank generates 1/cp of the rows, the completions all-gathered over the cp group.
- The training forwards (policy, old policy, reference) are TRL's fused head on whole rows,
  sharded by `trl_whole_rows` (left-padded prompts moved to the layout CP takes).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import inspect
import logging
from collections import defaultdict, deque
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from ...parallel.mesh import has_dim, mesh_device, mesh_dim_size

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Replicas:
    """The data-parallel replicas of an accelerator's mesh whose cp×tp groups share a batch."""

    dp_index: int  # this rank's replica
    dp_size: int
    world: int
    keep: tuple[int, ...]  # the global rank at cp and tp coordinate 0 of each replica, in replica order

    def once(self, tensor: torch.Tensor) -> torch.Tensor:
        """A gather over every rank ([world * n, ...], rank order) -> one copy per replica ([dp * n, ...])."""
        index = torch.tensor(self.keep, device=tensor.device)
        return tensor.view(self.world, -1, *tensor.shape[1:])[index].flatten(0, 1)


def replicas(accelerator: Any) -> Replicas | None:
    """The replicas of `accelerator`'s mesh, or None without cp/tp (every rank its own replica)."""
    mesh = getattr(accelerator, "torch_device_mesh", None)
    if mesh is None or mesh_dim_size(mesh, "cp") * mesh_dim_size(mesh, "tp") == 1:
        return None
    ranks = mesh.mesh
    names = list(mesh.mesh_dim_names)
    for name in ("tp", "cp"):  # the higher dims first, so each index stays valid
        if has_dim(mesh, name):
            ranks = ranks.select(names.index(name), 0)
            names.remove(name)
    keep = tuple(int(r) for r in ranks.flatten().tolist())  # dp_replicate, dp_shard order: the replica index
    coordinate = dict(zip(mesh.mesh_dim_names, mesh.get_coordinate()))
    leader = int(mesh.mesh[tuple(0 if n in ("cp", "tp") else coordinate[n] for n in mesh.mesh_dim_names)])
    return Replicas(dp_index=keep.index(leader), dp_size=len(keep), world=mesh.size(), keep=keep)


_ACTIVE: contextvars.ContextVar[Replicas | None] = contextvars.ContextVar("qwen35_accel_trl_replicas", default=None)


class _ReplicaView:
    """Mixed in before an Accelerator class: the replica's rank, count and gathers while a
    `Replicas` is active (stock otherwise). Instances share the real accelerator's `__dict__`."""

    @property
    def process_index(self) -> int:
        active = _ACTIVE.get()
        return super().process_index if active is None else active.dp_index  # type: ignore[misc]

    @property
    def num_processes(self) -> int:
        active = _ACTIVE.get()
        return super().num_processes if active is None else active.dp_size  # type: ignore[misc]

    def gather(self, tensor: Any) -> Any:
        gathered = super().gather(tensor)  # type: ignore[misc]
        active = _ACTIVE.get()
        if active is None:
            return gathered
        from accelerate.utils import recursively_apply

        return recursively_apply(active.once, gathered)


@functools.cache
def _view_class(cls: type) -> type:
    return type(f"ReplicaView{cls.__name__}", (_ReplicaView, cls), {})


def _replica_view(accelerator: Any) -> Any:
    view = object.__new__(_view_class(type(accelerator)))
    view.__dict__ = accelerator.__dict__  # the same state, the same attributes: only the view's methods differ
    return view


@contextlib.contextmanager
def replica_view(trainer: Any, active: Replicas) -> Iterator[None]:
    """For the duration: `trainer.accelerator` (and TRL's module-level gathers) as the replica's."""
    if _ACTIVE.get() is not None:  # nested (a wrapped method calling another)
        yield
        return
    token = _ACTIVE.set(active)
    accelerator = trainer.accelerator
    trainer.accelerator = _replica_view(accelerator)
    try:
        yield
    finally:
        trainer.accelerator = accelerator
        _ACTIVE.reset(token)


def _applies(trainer: Any) -> Replicas | None:
    from ..targets import is_dense_qwen35_module, is_qwen35_module

    model = getattr(trainer, "model", None)
    if model is None or not is_qwen35_module(model):
        return None
    found = replicas(getattr(trainer, "accelerator", None))
    if found is not None and not is_dense_qwen35_module(model):
        raise NotImplementedError(f"{type(trainer).__name__} (GRPO/RLOO) on a Qwen3.5-MoE model under cp or tp is not built in "
                                  "qwen35_accel: its generation and log-probs would run on each rank's chunks or heads without the "
                                  "replica handling dense models get. Use data parallelism alone (FSDP2, ep) for RL on MoE.")
    return found


def trl_replica_view(original: Callable[..., Any]) -> Callable[..., Any]:
    """The wrapper of a sampling trainer's `_generate_and_score_completions` / `_compute_loss`:
    run inside `replica_view` on a dense Qwen3.5 model under cp or tp (stock otherwise)."""

    @functools.wraps(original)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        active = _applies(self)
        if active is None:
            return original(self, *args, **kwargs)
        with replica_view(self, active):
            return original(self, *args, **kwargs)

    return wrapper


def trl_generate_without_cp(original: Callable[..., Any]) -> Callable[..., Any]:
    """The wrapper of a sampling trainer's `_generate_single_turn` on a dense Qwen3.5 model.
    Under cp or tp: the model's CP paused for the generation (whole sequences and a cache on
    every rank), its FSDP2 units gathered once for the call where they fit (`units_gathered`),
    not once per new token, and the group's leading rank's completions kept on every rank
    (`_as_the_group_leader_drew`). With `QWEN35_ACCEL_RL_GENERATION=split` (any world): per-row
    sampling, and under cp > 1 each cp rank generating its share of the group's rows
    (`_generate_split`)."""

    @functools.wraps(original)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        split = _per_row_sampling(self)
        active = _applies(self)
        if active is None and not split:
            return original(self, *args, **kwargs)
        with contextlib.ExitStack() as stack:
            if active is not None:
                from ...parallel.context_parallel.model import context_parallel_paused
                from ...parallel.gathered_generation import units_gathered

                stack.enter_context(context_parallel_paused(self.model_wrapped))
                stack.enter_context(units_gathered(self.model_wrapped, self.accelerator.device, _cache_bytes(self, args, kwargs)))
            if not split:
                result = original(self, *args, **kwargs)
                return result if active is None else _as_the_group_leader_drew(result, self.accelerator.torch_device_mesh)
            return _generate_split(self, original, args, kwargs)

    return wrapper


def _as_the_group_leader_drew(result: Any, mesh: Any) -> Any:
    """Replicated generation: every rank of a cp×tp group generated the same rows from the same
    seed, which gives the same completions only where every rank decodes bit-identically (on a GPU
    a rank's own kernel choice, Triton's autotuning among them, can flip a sampled token, and the
    group's ranks would then train on different rows). The group's leading rank (cp and tp
    coordinate 0) decides: its `result` is broadcast over the cp group, then over the tp group
    (a pickled list of token ids per row: small beside the generation)."""
    device = mesh_device(mesh)
    for name in ("cp", "tp"):
        if mesh_dim_size(mesh, name) > 1:
            group = mesh[name].get_group()
            box = [result]
            dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group,
                                       device=device if device.type != "cpu" else None)
            result = box[0]
    return result


def _cache_bytes(trainer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """The generation cache this call's rows need (`generation_cache_bytes`): its prompts (TRL's
    `prompt_ids`, lists of token ids) each with `max_completion_length` new tokens, in the
    parameters' dtype, split over tp."""
    from ...model.detect import unwrap_qwen35
    from ...parallel.gathered_generation import generation_cache_bytes

    prompts = kwargs.get("prompt_ids", args[0] if args else None)
    if not prompts:
        return 0
    model = unwrap_qwen35(trainer.model)
    tokens = max(len(p) for p in prompts) + (getattr(trainer.args, "max_completion_length", None) or 0)
    dtype = next(model.parameters()).dtype
    mesh = getattr(trainer.accelerator, "torch_device_mesh", None)
    tp = mesh_dim_size(mesh, "tp") if mesh is not None else 1
    return generation_cache_bytes(model.config, len(prompts), tokens, dtype, tp)


def _per_row_sampling(trainer: Any) -> bool:
    from ...settings import PluginSettings
    from ..targets import is_dense_qwen35_module

    model = getattr(trainer, "model", None)
    return (model is not None and is_dense_qwen35_module(model)
            and PluginSettings.from_env().rl_generation == "split")


_CALLS = "_qwen35_accel_generation_calls"  # (global step, generation calls made in it)
_said_split: set[tuple[int, int]] = set()


def _generate_split(trainer: Any, original: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """`original(trainer, prompt_ids, images, multimodal_fields, ...)` with per-row sampling
    (`row_sampling`): row i of this replica's `rows` prompts drawn from the generator of
    `row_seed(seed, global step, call within the step, dp index × rows + i)`. Under cp > 1 (text
    prompts) this rank generates rows [c·rows/cp, (c+1)·rows/cp) of cp coordinate c and the cp
    group all-gathers the completions (a rank without rows generates a copy of row 0 and discards
    it: every rank runs the same generation calls). Returns what `original` returns for all rows."""
    from .row_sampling import row_seed, with_row_sampling

    bound = inspect.signature(original).bind(trainer, *args, **kwargs).arguments
    prompt_ids, images, multimodal = bound["prompt_ids"], bound.get("images"), bound.get("multimodal_fields")
    _refuse_per_row_bypass(trainer)
    rows = len(prompt_ids)
    step = int(trainer.state.global_step)
    last_step, calls = trainer.__dict__.get(_CALLS, (step, 0))
    call = calls if last_step == step else 0
    trainer.__dict__[_CALLS] = (step, call + 1)
    first = trainer.accelerator.process_index * rows  # the replica's index (dp index under cp/tp)
    seeds = [row_seed(trainer.args.seed, step, call, first + i) for i in range(rows)]

    mesh = getattr(trainer.accelerator, "torch_device_mesh", None)
    cp = mesh_dim_size(mesh, "cp") if mesh is not None else 1
    shares = cp > 1 and images is None and not multimodal
    if shares:
        coordinate = mesh["cp"].get_local_rank()
        lo, hi = coordinate * rows // cp, (coordinate + 1) * rows // cp
    else:
        lo, hi = 0, rows
    mine = list(range(lo, hi)) or [0]
    _say_split_once(rows, cp if shares else 1)
    config = trainer.generation_config
    trainer.generation_config = with_row_sampling(config, [seeds[i] for i in mine])
    device = getattr(trainer.accelerator, "device", torch.device("cpu"))
    # The global RNG left as before the call, in every world: Transformers' `multinomial` still draws from it (on
    # the one-hot distributions) a number of times that depends on the rank's rows, and TRL draws from it after
    # generating (its shuffle of the generation batch), which every rank of a group must draw alike.
    try:
        with torch.random.fork_rng(devices=[device] if device.type != "cpu" else [], device_type=device.type):
            if shares:
                bound["prompt_ids"] = [prompt_ids[i] for i in mine]
                result = original(**bound)
            else:
                result = original(trainer, *args, **kwargs)
    finally:
        trainer.generation_config = config
    if not shares:
        return result
    # GRPO returns (completion_ids, logprobs or None), RLOO completion_ids: lists of per-row values.
    fields = result if isinstance(result, tuple) else (result,)
    if hi == lo:
        fields = tuple(None if field is None else [] for field in fields)
    parts: list[Any] = [None] * cp
    dist.all_gather_object(parts, fields, group=mesh["cp"].get_group())
    gathered = tuple(None if any(part[k] is None for part in parts) else [row for part in parts for row in part[k]]
                     for k in range(len(fields)))
    return gathered if isinstance(result, tuple) else gathered[0]


def _refuse_per_row_bypass(trainer: Any) -> None:
    """NotImplementedError (on every rank) where the trainer generates outside Transformers'
    `generate`, which per-row sampling lives in: the setting would be ignored."""
    refused = [what for what, present in (
        ("vLLM generation (use_vllm=True)", getattr(trainer, "use_vllm", False)),
        ("continuous batching (use_transformers_continuous_batching=True)",
         getattr(trainer, "use_transformers_continuous_batching", False)),
        ("a rollout_func", getattr(trainer, "rollout_func", None) is not None),
    ) if present]
    if refused:
        raise NotImplementedError(
            f"QWEN35_ACCEL_RL_GENERATION=split samples inside Transformers' generate; {type(trainer).__name__} "
            f"generates through {', '.join(refused)}, which would ignore it. Unset the variable (or set it to replicated)."
        )


def _say_split_once(rows: int, cp: int) -> None:
    key = (rows, cp)
    if key in _said_split or (dist.is_initialized() and dist.get_rank() != 0):
        return
    _said_split.add(key)
    if cp > 1:
        where = f"each of the {cp} cp ranks generates {rows // cp}-{-(-rows // cp)} of the group's {rows} rows, gathered after"
    else:
        where = f"every rank generates its {rows} rows"
    logger.warning("qwen35_accel: RL generation with per-row sampling (QWEN35_ACCEL_RL_GENERATION=split): %s", where)


def trl_gather_once(original: Callable[..., Any]) -> Callable[..., Any]:
    """TRL's module-level `gather` (rewards, RLOO's KL): one copy per replica while a replica view is active."""

    @functools.wraps(original)
    def wrapper(tensor: Any) -> Any:
        gathered = original(tensor)
        active = _ACTIVE.get()
        if active is None:
            return gathered
        from accelerate.utils import recursively_apply

        return recursively_apply(active.once, gathered)

    return wrapper


def trl_gather_object_once(original: Callable[..., Any]) -> Callable[..., Any]:
    """TRL's module-level `gather_object` (logged prompts, completions, metric names): the lists
    of the replicas' leading ranks only while a replica view is active."""

    @functools.wraps(original)
    def wrapper(obj: Any) -> Any:
        active = _ACTIVE.get()
        if active is None or not dist.is_initialized():
            return original(obj)
        parts: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(parts, obj)
        return [item for rank in active.keep for item in parts[rank]]

    return wrapper


def _refusals(trainer: Any, cp: int) -> list[str]:
    found = [
        ("vLLM generation (use_vllm=True)", getattr(trainer, "use_vllm", False)),
        ("continuous batching (use_transformers_continuous_batching=True)",
         getattr(trainer, "use_transformers_continuous_batching", False)),
        ("a rollout_func", getattr(trainer, "rollout_func", None) is not None),
        ("tools", bool(getattr(trainer, "tools", None))),
        ("an environment_factory", getattr(trainer, "environment_factories", None) is not None),
    ]
    return [what for what, present in found if present]


def trl_sampling_setup(original: Callable[..., Any]) -> Callable[..., Any]:
    """The wrapper of `GRPOTrainer.get_train_dataloader` / `RLOOTrainer.get_train_dataloader`
    (the first thing `train()` does that reads the generation batch; the plugin's points on TRL's
    modules are installed while TRL's `__init__` runs, too late to wrap it): on a dense Qwen3.5
    model under cp or tp, once per trainer, the refusals, the replica's generation batch and
    its seed (see the module)."""

    @functools.wraps(original)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        active = _applies(self)
        if active is not None and not self.__dict__.get(_SET_UP):
            _set_up_replica(self, active)
        if _per_row_sampling(self):
            _refuse_per_row_bypass(self)
        return original(self, *args, **kwargs)

    return wrapper


_SET_UP = "_qwen35_accel_replica_set_up"


def _set_up_replica(trainer: Any, active: Replicas) -> None:
    from accelerate.utils import set_seed

    mesh = trainer.accelerator.torch_device_mesh
    cp, tp = mesh_dim_size(mesh, "cp"), mesh_dim_size(mesh, "tp")
    name = type(trainer).__name__
    if cp > 1 and getattr(trainer, "_is_vlm", False):
        raise NotImplementedError(
            f"{name} on a vision-language model under context parallelism (cp_size={cp}) is not supported by "
            "qwen35_accel: TRL samples completions from image prompts once per process, and sharing those rows, "
            "their images and their completions within a cp group is not built. Run it with cp_size 1 (tp_size and "
            "data parallelism as configured), or pass text-only prompts (the tokenizer as processing_class)."
        )
    refused = _refusals(trainer, cp)
    if refused:
        raise NotImplementedError(
            f"{name} under context/tensor parallelism (cp_size={cp}, tp_size={tp}) with {', '.join(refused)} is not "
            "supported by qwen35_accel: the ranks of a cp×tp group must train on the same completions, and these "
            "generate or score them outside the model, once per process (never shared within the group). Use "
            "Transformers generation without them, or run with cp_size and tp_size 1."
        )
    args = trainer.args
    generation_batch_size = args.per_device_train_batch_size * active.dp_size * args.steps_per_generation
    if generation_batch_size % trainer.num_generations:
        raise ValueError(
            f"{name} under cp/tp: the generation batch counts data-parallel replicas (dp={active.dp_size}, not the "
            f"{active.world} processes): per_device_train_batch_size ({args.per_device_train_batch_size}) x dp "
            f"({active.dp_size}) x steps_per_generation ({args.steps_per_generation}) = {generation_batch_size}, "
            f"which num_generations ({trainer.num_generations}) does not divide. Change one of them."
        )
    evaluation_batch = args.per_device_eval_batch_size * active.dp_size
    generations_eval = getattr(trainer, "num_generations_eval", None) or trainer.num_generations
    if args.eval_strategy != "no" and evaluation_batch % generations_eval:
        raise ValueError(
            f"{name} under cp/tp: an evaluation batch counts data-parallel replicas (dp={active.dp_size}, not the "
            f"{active.world} processes): per_device_eval_batch_size ({args.per_device_eval_batch_size}) x dp "
            f"({active.dp_size}) = {evaluation_batch}, which the evaluation's generations per prompt "
            f"({generations_eval}) do not divide. Change one of them."
        )
    args.generation_batch_size = generation_batch_size
    logs = getattr(trainer, "_logs", None)
    if isinstance(logs, dict):  # TRL sized its completion logs by the old batch
        for key, value in logs.items():
            if isinstance(value, deque):
                logs[key] = deque(value, maxlen=generation_batch_size)
            elif isinstance(value, defaultdict):
                logs[key] = defaultdict(functools.partial(deque, maxlen=generation_batch_size))
    # TRL seeded `seed + process index` at the end of its __init__, with nothing drawn since:
    # the replica's seed is the one its process has in the run without cp/tp.
    set_seed(args.seed + active.dp_index)
    trainer.__dict__[_SET_UP] = True
