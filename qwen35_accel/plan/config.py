"""What `plan` reads before it builds anything: the Accelerate YAML (mesh sizes, the run it
describes), the model's config, and the options checked against them."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}
VISION_TOWER_CHOICES = ("trainable", "frozen", "none")
BACKENDS = ("nccl", "gloo")


def dtype_bytes(dtype: Any) -> int:
    """Bytes per element of a torch dtype (4 for one not listed)."""
    return DTYPE_BYTES.get(str(dtype).removeprefix("torch."), 4)


class PlanError(Exception):
    """A configuration `plan` cannot lay out; the message names what to change."""


def load_yaml(path: str) -> Any:
    """The YAML as `accelerate launch` reads it (its `ClusterConfig`)."""
    from accelerate.commands.config.config_args import load_config_from_file

    if not os.path.isfile(path):
        raise PlanError(f"no such config file: {path}")
    return load_config_from_file(path)


def check_engine(cluster: Any, path: str) -> None:
    """PlanError for a YAML whose run qwen35_accel does not lay out as FSDP2 units: DeepSpeed (ZeRO lays
    the model out; the plugin keeps the gates in fp32 beside it, not planned) and FSDP v1 (refused for
    Qwen3.5 models at prepare). A plan of FSDP2 units for them would describe a run that does not happen."""
    distributed = str(getattr(cluster.distributed_type, "value", cluster.distributed_type))
    if distributed == "DEEPSPEED":
        raise PlanError(
            f"{path} runs DeepSpeed (distributed_type: DEEPSPEED): ZeRO lays the model out and qwen35_accel keeps "
            "A_log/dt_bias in fp32 beside its engine (docs/deepspeed.md); `plan` has no memory model of ZeRO and lays "
            "out only the FSDP2 runs qwen35_accel prepares: not planned. DeepSpeed estimates ZeRO's model states "
            "itself: deepspeed.runtime.zero.stage3.estimate_zero3_model_states_mem_needs_all_live(model, "
            "num_gpus_per_node=…, num_nodes=…) (stage_1_and_2.estimate_zero2_model_states_mem_needs_all_live for "
            "ZeRO-1/2); the plugin adds on every rank the gates' fp32 values, gradients and AdamW moments (16 bytes "
            "× 2 × value heads per GatedDeltaNet layer). For a plan of units, memory and CP/TP, pass an FSDP2 YAML "
            "(accelerate_configs/fsdp2.yaml)"
        )
    version = str((cluster.fsdp_config or {}).get("fsdp_version", "1"))
    if distributed == "FSDP" and version != "2":
        raise PlanError(
            f"{path} runs FSDP v1 (fsdp_version: {version}), which qwen35_accel refuses for Qwen3.5 models (one dtype "
            f"per flattened unit: the gates would be refused or bf16-rounded); convert it with `accelerate to-fsdp2 "
            f"--config_file {path} --output_file NEW` and plan that"
        )


def mesh_sizes(cluster: Any) -> dict[str, int]:
    """{"world", "dp_replicate", "dp_shard", "cp", "tp"} from the YAML's `num_processes` and
    `parallelism_config` (dp_shard takes what the others leave when it is not given)."""
    raw = cluster.parallelism_config or {}
    world = int(cluster.num_processes or 1)

    def size(name: str) -> int:
        return int(raw.get(f"parallelism_config_{name}_size") or 1)

    sizes = {"dp_replicate": size("dp_replicate"), "cp": size("cp"), "tp": size("tp")}
    shard = raw.get("parallelism_config_dp_shard_size")
    rest = sizes["dp_replicate"] * sizes["cp"] * sizes["tp"]
    sizes["dp_shard"] = int(shard) if shard else max(1, world // rest)
    total = rest * sizes["dp_shard"]
    if total != world:
        raise PlanError(
            f"dp_replicate {sizes['dp_replicate']} x dp_shard {sizes['dp_shard']} x cp {sizes['cp']} "
            f"x tp {sizes['tp']} = {total} does not match num_processes {world}; change num_processes or the "
            "parallelism_config sizes so that they agree"
        )
    return {"world": world, **sizes}


@dataclass(frozen=True)
class PlannedRun:
    """The run `plan` describes: `device` "cpu" or "cuda", the process groups' `backend`
    ("gloo" or "nccl"), the GatedDeltaNet `kernels` ("torch": Transformers' torch rule and
    conv; "fla": FLA's chunked rule and causal-conv1d, assumed installed), and `source`,
    what decided it."""

    device: str
    backend: str
    kernels: str
    source: str

    def as_dict(self) -> dict[str, str]:
        """`plan --json`'s `run`."""
        return asdict(self)


def planned_run(cluster: Any, backend: str | None) -> PlannedRun:
    """A YAML made for CPU processes (`use_cpu: true`, or `distributed_type: MULTI_CPU`) is
    a CPU run over gloo with torch's kernels; any other is a CUDA run over nccl with FLA and
    causal-conv1d (planned on any machine: no GPU is needed to plan one). `backend`
    (`--backend`) overrides the YAML: gloo plans the CPU run, nccl the CUDA one."""
    if backend is not None and backend not in BACKENDS:
        raise PlanError(f"--backend {backend!r} is not one of {', '.join(BACKENDS)}; pass one of them")
    distributed = str(getattr(cluster.distributed_type, "value", cluster.distributed_type))
    cpu_yaml = bool(cluster.use_cpu) or distributed == "MULTI_CPU"
    if backend is not None:
        source = f"--backend {backend}"
    elif cpu_yaml:
        source = "the YAML: use_cpu: true" if cluster.use_cpu else "the YAML: distributed_type: MULTI_CPU"
    else:
        source = "the YAML: a GPU config (use_cpu: false)"
    cpu = backend == "gloo" if backend is not None else cpu_yaml
    return PlannedRun("cpu", "gloo", "torch", source) if cpu else PlannedRun("cuda", "nccl", "fla", source)


def model_config(model: str) -> Any:
    """The Transformers config of `--model`: "tiny", "tiny-vlm" or a model directory."""
    if model == "tiny":
        from ..model.tiny import tiny_text_config

        return tiny_text_config()
    if model == "tiny-vlm":
        from ..model.tiny import tiny_vlm_config

        return tiny_vlm_config()
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model)
    except (OSError, ValueError) as error:
        raise PlanError(f"--model {model!r}: {str(error).splitlines()[0]}; pass a model directory or 'tiny'") from None


def vision_tower_choice(model: str, config: Any, choice: str | None, image_tokens: int, tokens: int) -> str:
    """`--vision-tower` checked against the config: "trainable", "frozen" or "none"."""
    if choice is not None and choice not in VISION_TOWER_CHOICES:
        raise PlanError(f"--vision-tower {choice!r} is not one of {', '.join(VISION_TOWER_CHOICES)}; pass one of them")
    if getattr(config, "vision_config", None) is None:
        if choice in ("trainable", "frozen") or image_tokens:
            given = f"--vision-tower {choice}" if choice in ("trainable", "frozen") else f"--image-tokens {image_tokens}"
            raise PlanError(f"{given}: --model {model} is a text model without a vision tower; drop the flag or pass a VLM config")
        return "none"
    choice = choice or "trainable"
    if image_tokens < 0 or image_tokens > tokens or (choice == "none" and image_tokens):
        need = "0 with --vision-tower none" if choice == "none" else f"0 to {tokens} (batch size x seq len: they are part of the sequence)"
        raise PlanError(f"--image-tokens {image_tokens}: pass {need}")
    return choice


def memory_options(gpu_memory: str | None, batch_size: int, optimizer: str, suggest: bool) -> int | None:
    """Check the memory options before anything is built; return `gpu_memory` in bytes."""
    from ..memory import StepOptions

    if suggest and gpu_memory is None:
        raise PlanError("--suggest needs --gpu-memory (e.g. --gpu-memory 141GB)")
    try:
        StepOptions(seq_len=1, batch_size=batch_size, optimizer=optimizer)
    except ValueError as error:
        raise PlanError(f"--batch-size/--optimizer: {error}") from None
    return _bytes_option("--gpu-memory", gpu_memory)


def host_memory_option(host_memory: str | None) -> int | None:
    """`--host-memory` in bytes (None when not given); PlanError naming the value otherwise."""
    return _bytes_option("--host-memory", host_memory)


def _bytes_option(flag: str, value: str | None) -> int | None:
    """A memory size option (e.g. 141GB) in bytes, None when not given; PlanError naming `flag`."""
    from ..memory import parse_bytes

    try:
        return None if value is None else parse_bytes(value)
    except ValueError as error:
        raise PlanError(f"{flag} {error}") from None
