"""What the memory model reads: the model's shape, the parallel sizes, the step's options, and
the bytes per rank it answers with (`MemoryEstimate`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

Device = Literal["cpu", "cuda"]
OPTIMIZERS = ("adamw", "sgd", "none")
# Optimizer state per trainable parameter, in units of the parameter's storage dtype.
OPTIMIZER_STATES = {"adamw": 2, "sgd": 1, "none": 0}
CHUNK = 64  # the chunk length of the chunked gated delta rule (Transformers' and FLA's)
DEFAULT_LOSS_TILE_BYTES = 2**28  # fp32 logits per loss tile: at most 256 MiB (tiled_blocks.TILE_BYTES)


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a Qwen3.5 text model that memory depends on. A MoE model (`experts` > 0)
    has no dense MLP (`intermediate` 0): each layer's sparse block holds `experts` routed
    experts of width `expert_intermediate` (top `experts_per_token` per token), a shared expert
    of width `shared_intermediate`, and `router_loss`: the config's `output_router_logits`
    (every layer's router logits kept for the load-balancing loss)."""

    hidden: int
    intermediate: int
    vocab: int
    linear_layers: int  # GatedDeltaNet layers
    full_layers: int  # gated full-attention layers
    heads: int
    kv_heads: int
    head_dim: int
    rotary_dim: int
    k_heads: int  # GatedDeltaNet key heads
    v_heads: int  # GatedDeltaNet value heads
    k_dim: int
    v_dim: int
    conv_kernel: int
    tied_embeddings: bool = False
    attention_bias: bool = False
    experts: int = 0
    experts_per_token: int = 0
    expert_intermediate: int = 0
    shared_intermediate: int = 0
    router_loss: bool = False

    @classmethod
    def from_config(cls, config: Any) -> ModelShape:
        """From a Transformers Qwen3.5 config (text or multimodal: its text config is used)."""
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        rope = getattr(text, "rope_parameters", None) or {}
        factor = rope.get("partial_rotary_factor", getattr(text, "partial_rotary_factor", 1.0))
        kinds = list(text.layer_types)
        experts = int(getattr(text, "num_experts", 0) or 0)
        moe = dict(
            experts=experts, experts_per_token=text.num_experts_per_tok, expert_intermediate=text.moe_intermediate_size,
            shared_intermediate=text.shared_expert_intermediate_size, router_loss=bool(getattr(text, "output_router_logits", False)),
        ) if experts else {}
        return cls(
            hidden=text.hidden_size,
            intermediate=0 if experts else text.intermediate_size,
            vocab=text.vocab_size,
            linear_layers=kinds.count("linear_attention"),
            full_layers=kinds.count("full_attention"),
            heads=text.num_attention_heads,
            kv_heads=text.num_key_value_heads,
            head_dim=head_dim,
            rotary_dim=int(head_dim * factor),
            k_heads=text.linear_num_key_heads,
            v_heads=text.linear_num_value_heads,
            k_dim=text.linear_key_head_dim,
            v_dim=text.linear_value_head_dim,
            conv_kernel=text.linear_conv_kernel_dim,
            tied_embeddings=bool(getattr(config, "tie_word_embeddings", getattr(text, "tie_word_embeddings", False))),
            attention_bias=bool(getattr(text, "attention_bias", False)),
            **moe,
        )

    @property
    def layers(self) -> int:
        return self.linear_layers + self.full_layers

    @property
    def conv_dim(self) -> int:
        return 2 * self.k_heads * self.k_dim + self.v_heads * self.v_dim

    def layer_parameters(self, kind: str) -> tuple[int, int]:
        """(parameters split by tp, parameters replicated over tp) of one decoder layer of
        `kind` ("linear_attention" or "full_attention"), MLP and both norms included; a MoE
        layer's routed experts apart (`expert_parameters`): the shared expert split as the MLP,
        the router and the shared expert's gate whole."""
        h = self.hidden
        split = 3 * h * (self.shared_intermediate if self.experts else self.intermediate)
        whole = 2 * h  # input and post-attention norms
        if self.experts:
            whole += self.experts * h + h  # the router, the shared expert's gate
        if kind == "linear_attention":
            value = self.v_heads * self.v_dim
            split += self.conv_dim * h + value * h + 2 * self.v_heads * h  # in_proj_qkv, z, b, a
            split += self.conv_dim * self.conv_kernel + 2 * self.v_heads + value * h  # conv, gate holder, out_proj
            whole += self.v_dim  # the gated norm
        else:
            q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
            split += (2 * q + 2 * kv) * h + q * h  # q_proj (query and gate), k/v_proj, o_proj
            if self.attention_bias:
                split += 2 * q + 2 * kv + h
            whole += 2 * self.head_dim  # q_norm, k_norm
        return split, whole

    def expert_parameters(self) -> int:
        """One MoE layer's routed experts (`gate_up_proj` [E, 2I, H], `down_proj` [E, H, I]); 0 for dense."""
        return 3 * self.experts * self.expert_intermediate * self.hidden

    def parameters(self) -> int:
        """All parameters of the text model."""
        total = self.vocab * self.hidden * (1 if self.tied_embeddings else 2) + self.hidden
        for kind, count in (("linear_attention", self.linear_layers), ("full_attention", self.full_layers)):
            total += count * (sum(self.layer_parameters(kind)) + self.expert_parameters())
        return total


@dataclass(frozen=True)
class Parallel:
    """Mesh sizes (world = their product), whether the lm_head is split by vocab over tp, and
    `ep` (MoE): the expert-parallel size carved out of dp_shard × cp (not a factor of the world)."""

    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    vocab_parallel_lm_head: bool = False
    ep: int = 1

    @property
    def world(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def fsdp_shards(self) -> int:
        return self.dp_shard * self.cp


@dataclass(frozen=True)
class StepOptions:
    """One training step's choices. `seq_len`: tokens per sequence (whole, before CP);
    `compute_bytes`: the compute dtype's size (2 under bf16/fp16, else the storage's);
    `param_bytes`: the storage dtype's size (4 under a bf16/fp16 policy: fp32 masters);
    `device`: where the step runs; `fla`: on "cuda", whether FLA and causal-conv1d are
    installed (the GatedDeltaNet kernels; without them Transformers' torch kernels run);
    `tiled_loss`: "recompute", "hold" or "off" (Transformers' loss), as the setting of that
    name (True is "recompute", False "off"); `reference_model`: the run also holds a frozen copy of
    the model (TRL's `ref_model` of DPO/KTO, of GRPO/RLOO with `beta` > 0), prepared as the
    policy is (see `estimate`); `reference_bytes`: its storage dtype's size, the checkpoint's as
    loaded (the plugin keeps a frozen model's dtype: 2 for a bf16 checkpoint under any policy);
    `activation_offload` (with checkpointing): the checkpointed layers' inputs in host memory."""

    seq_len: int
    batch_size: int = 1
    compute_bytes: int = 2
    param_bytes: int = 4
    optimizer: str = "adamw"
    activation_checkpointing: bool = False
    activation_offload: bool = False
    tiled_loss: bool | str = "recompute"
    loss_tile_bytes: int = DEFAULT_LOSS_TILE_BYTES
    forward_prefetch_depth: int = 1
    backward_prefetch_depth: int = 2
    device: Device = "cuda"
    fla: bool = True
    reference_model: bool = False
    reference_bytes: int = 4

    def __post_init__(self) -> None:
        from ..parallel.tiled_head import LOSS_MODES

        if isinstance(self.tiled_loss, bool):
            object.__setattr__(self, "tiled_loss", "recompute" if self.tiled_loss else "off")
        if self.tiled_loss not in ("off", *LOSS_MODES):
            raise ValueError(f"tiled_loss {self.tiled_loss!r} is not one of off, {', '.join(LOSS_MODES)}; pass one of them")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer {self.optimizer!r} is not one of {', '.join(OPTIMIZERS)}; pass one of them")
        if self.activation_offload and not self.activation_checkpointing:
            raise ValueError("activation_offload moves what checkpointed layers keep: it needs activation_checkpointing")
        if self.seq_len < 1 or self.batch_size < 1:
            raise ValueError(f"seq_len {self.seq_len}, batch_size {self.batch_size}: both must be at least 1")


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank (the most loaded rank); `total` is their sum, on the device. `reference_parameters`: a
    frozen reference model's parameter shards (0 without one). `host_activations`: with activation
    offload, the checkpointed layers' inputs in host memory (not in `total`)."""

    parameters: int
    gradients: int
    optimizer_states: int
    activations: int
    loss: int
    transient: int
    reference_parameters: int = 0
    host_activations: int = 0

    @property
    def total(self) -> int:
        return (self.parameters + self.gradients + self.optimizer_states + self.activations + self.loss + self.transient
                + self.reference_parameters)

    def as_dict(self) -> dict[str, int]:
        """The keys of `plan --json`'s `memory_per_rank` (integers, bytes)."""
        return {**asdict(self), "total": self.total}

