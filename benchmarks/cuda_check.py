"""CUDA checks of the context-parallel path, for a machine with one GPU.

    python benchmarks/cuda_check.py [--device cuda] [--out DIR] [--smoke]

One GPU cannot host a 2-rank NCCL group, so the 2-rank checks use gloo with CUDA tensors
(both ranks on the same GPU): that exercises the device handling of every CP op (no
CPU-only tensors, devices of masks, positions, identity matrices) and the CUDA kernels
(SDPA with an explicit mask, the chunked rule), while NCCL itself stays untested here.
Checks:
0. FLA preflight: the kernel decision, Triton / tilelang / nvcc, one forward + backward of
   FLA's rule at Qwen3.5's head counts (bf16 layer inputs; an fp32 chunk summary), timed;
1. environment: versions, GPU, optional kernels as `qwen35_accel.ops.kernels` finds them
   (flash-linear-attention, causal-conv1d: version, used or why not), Triton, tilelang;
2. ops: a chunk's affine summary folded over 8 chunks equals Transformers' chunked rule
   on the GPU (fp32, TF32 off; and bf16 inputs against the fp32 rule);
3. model: CP layers (no FSDP) over 2 ranks equal the single-process model on the GPU
   (fp32: loss, averaged gradients; bf16 at a longer sequence: within bf16 tolerance);
4. FSDP2 + CP through `PARALLELIZER.apply` on the GPU over gloo (reported, not required:
   gloo's CUDA collective coverage decides whether it runs);
5. tensor parallelism through `PARALLELIZER.apply` on the GPU (tp 2, and cp 2 x tp 2 on
   4 ranks), fp32: loss and every gathered gradient against the single-process model;
6. packed rows, one process: every document against that document alone (logits, every
   gradient), through the varlen kernels when causal-conv1d / FLA are installed;
7. the CP kernel interfaces: the kernels chosen for the device (FLA's chunk rule,
   causal-conv1d's conv when installed) against the torch kernels, outputs and input
   gradients (a chunk summary from fp32 and from bf16 q/k/v; the halo conv on channel-last
   bf16 input, with seq_idx);
8. TF32 in the CP summaries: FLA's fp32 chunk summaries (M, U; values 2·128 wide, fp32
   state) against an fp64 recurrence, per chunk and folded over 2·cp chunks, for cp 1-8
   (Triton's fp32 dots are TF32 unless TRITON_F32_DEFAULT=ieee; docs/limits.md bounds it).
`--checks NAME ...` runs only those (e.g. `TRITON_F32_DEFAULT=ieee ... --checks tf32_summaries`).
Writes `cuda_check.json` (all numbers, and under "run" the date, versions, machine and load
average before / after) to --out and prints a summary. `--smoke` (tiny shapes; `--device cpu`
on a machine without a GPU) runs checks 1-4 and tp 2 in one 2-rank world, leaves out the
4-rank one, and writes nothing unless --out or --results-dir is given.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import os
import tempfile
import time
import traceback
from pathlib import Path

import torch

import _report


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def check_environment(device: str) -> dict:
    import accelerate
    import transformers

    from qwen35_accel.ops import kernels

    info = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "accelerate": accelerate.__version__,
        "device": device,
        # What `qwen35-accel env` reports: per optional package, the version and whether we use it.
        "kernels": {p: kernels.status(p).line() for p in ("fla", "causal_conv1d")},
        "transformers_calls": {p: kernels.transformers_uses(p) for p in ("fla", "causal_conv1d")},
        "fla": kernels.fla_status().usable,
        "causal_conv1d": kernels.conv_status().usable,
    }
    for name in ("triton", "tilelang"):
        try:
            info[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            info[name] = None
    info["TRITON_F32_DEFAULT"] = os.environ.get("TRITON_F32_DEFAULT")
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
        info["cuda"] = torch.version.cuda
    return info


def check_fla_preflight(device: str, smoke: bool = False) -> dict:
    """Before the other checks: what `ops.kernels` decides, the versions FLA's backward depends
    on (Triton, tilelang, nvcc), and one forward + backward of FLA's chunk rule at Qwen3.5's
    shapes (16 key / 32 value heads of 128), timed (the first call compiles and autotunes):
    bf16 q/k/v as the non-CP layer passes them, and an fp32 chunk summary (values 2·128 wide,
    fp32 state) as the CP layer does. FLA is called even where `ops.kernels` finds it
    unusable, so that its own error shows beside our reason."""
    if device != "cuda":
        return {"skipped": "needs CUDA"}
    import shutil

    from qwen35_accel.ops import kernels
    from qwen35_accel.ops.gated_delta import chunk_summary

    result: dict = {"decision": {p: kernels.status(p).line() for p in ("fla", "causal_conv1d")},
                    "capability": ".".join(map(str, torch.cuda.get_device_capability(0))), "nvcc": shutil.which("nvcc")}
    for name in ("triton", "tilelang", "fla-core", "flash-linear-attention"):
        try:
            result[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            result[name] = None
    try:
        fla = importlib.import_module("fla.ops.gated_delta_rule").chunk_gated_delta_rule
    except Exception as exc:  # noqa: BLE001 (reported)
        result["fla_import"] = f"{type(exc).__name__}: {exc}"[:500]
        return result
    seq, hk, hv, d = (256, 2, 4, 32) if smoke else (4096, 16, 32, 128)
    gen = torch.Generator(device="cpu").manual_seed(7)
    base = [torch.randn(1, seq, hk, d, generator=gen), torch.randn(1, seq, hk, d, generator=gen),
            torch.randn(1, seq, hv, d, generator=gen), -torch.empty(1, seq, hv).uniform_(0.002, 0.05, generator=gen),
            torch.rand(1, seq, hv, generator=gen)]

    def bf16_layer(q, k, v, g, beta):
        return fla(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)[0].float().square().mean()

    def fp32_summary(q, k, v, g, beta):
        return sum(t.float().square().mean() for t in chunk_summary(q, k, v, g, beta, kernel=fla))

    for name, dtype, fn in (("bf16_layer", torch.bfloat16, bf16_layer), ("fp32_summary", torch.float32, fp32_summary)):
        # g in fp32 and the rest in the compute dtype, as the layer passes them
        leaves = [t.to(device, dtype if i != 3 else torch.float32).requires_grad_(True) for i, t in enumerate(base)]
        torch.cuda.synchronize()
        started = time.perf_counter()
        try:
            fn(*leaves).backward()
            torch.cuda.synchronize()
            result[name] = {"s_first_call": round(time.perf_counter() - started, 2),
                            "grads_finite": all(bool(t.grad.isfinite().all()) for t in leaves)}
        except Exception as exc:  # noqa: BLE001 (reported: this is what the check is for)
            result[name] = {"error": f"{type(exc).__name__}: {exc}"[:800]}
        print(f"  fla_preflight {name}: {result[name]}", flush=True)
    return result


def _fp64_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               initial: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule token by token in fp64 (the reference): q, k [batch, seq, k_heads,
    k_dim], v [batch, seq, v_heads, v_dim], g, beta [batch, seq, v_heads]; q/k l2-normalised
    and q scaled by k_dim^-0.5 as `use_qk_l2norm_in_kernel=True` does. Returns (output
    [batch, seq, v_heads, v_dim], final state [batch, v_heads, k_dim, v_dim]), fp64."""
    groups = v.shape[2] // k.shape[2]
    q, k, v, g, beta = (t.double() for t in (q, k, v, g, beta))
    q = q / q.norm(dim=-1, keepdim=True).clamp_min(1e-6) * q.shape[-1] ** -0.5
    k = k / k.norm(dim=-1, keepdim=True).clamp_min(1e-6)
    q, k = q.repeat_interleave(groups, dim=2), k.repeat_interleave(groups, dim=2)
    b, seq, h, dk = k.shape
    state = v.new_zeros(b, h, dk, v.shape[-1]) if initial is None else initial.double().clone()
    outs = []
    for t in range(seq):
        state = state * g[:, t].exp()[..., None, None]
        delta = (v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], state)) * beta[:, t, :, None]
        state = state + k[:, t, :, :, None] * delta[:, :, None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], state))
    return torch.stack(outs, dim=1), state


def check_tf32_summaries(device: str, smoke: bool = False) -> dict:
    """How far the chunk summaries (M, U) a CP layer computes drift from fp64, per cp.

    The CP layer hands its kernel fp32 q/k/v (values `[v | 0]`, 2·128 wide) and an fp32 state
    `[0 | I]`; Triton computes fp32 `tl.dot` as TF32 unless told otherwise
    (`TRITON_F32_DEFAULT=ieee`), so FLA's summaries carry TF32 rounding, and the fold over the
    2·cp chunks adds each chunk's error. For cp in 1, 2, 4, 8 the sequence is cut into 2·cp
    chunks; each chunk's (M, U) from FLA's kernel and from the torch kernel (fp32, TF32 off)
    is compared with the same chunk's summary from an fp64 token-by-token recurrence, and the
    folded output and final state with the fp64 recurrence over the whole sequence.
    Relative errors: max |a − ref| / max |ref|.
    """
    if device != "cuda":
        return {"skipped": "needs CUDA"}
    from qwen35_accel.ops import kernels
    from qwen35_accel.ops.gated_delta import chunk_summary, fold_states, read_state, torch_kernel

    torch.backends.cuda.matmul.allow_tf32 = False
    gen = torch.Generator(device="cpu").manual_seed(5)
    b, seq, hk, hv, d = (1, 256, 2, 4, 32) if smoke else (1, 8192, 2, 4, 128)
    q, k = torch.randn(b, seq, hk, d, generator=gen), torch.randn(b, seq, hk, d, generator=gen)
    v = torch.randn(b, seq, hv, d, generator=gen)
    g = -torch.empty(b, seq, hv).uniform_(0.002, 0.05, generator=gen)  # weak decay: the carried state matters
    beta = torch.rand(b, seq, hv, generator=gen)
    inputs = [t.to(device) for t in (q, k, v, g, beta)]
    ref_out, ref_final = _fp64_rule(*inputs)
    fla = kernels.fla_status()
    result: dict = {"fla": fla.line(), "TRITON_F32_DEFAULT": os.environ.get("TRITON_F32_DEFAULT", "(unset: tf32)"),
                    "shape": {"seq": seq, "k_heads": hk, "v_heads": hv, "k_dim": d, "v_dim": d, "kernel_value_width": 2 * d}}
    candidates = {"fla_fp32": fla.function, "torch_fp32": torch_kernel()}
    for cp in (1, 2, 4, 8):
        n = 2 * cp
        length = seq // n
        chunks = [[t[:, i * length:(i + 1) * length] for t in inputs] for i in range(n)]
        # fp64 summaries of every chunk at once: chunks as the batch, values [v | 0], state [0 | I].
        stacked = [torch.cat([c[j] for c in chunks]) for j in range(5)]
        aug = torch.cat([stacked[2], stacked[2].new_zeros(*stacked[2].shape[:-1], d)], dim=-1)
        eye = torch.eye(d, device=device, dtype=torch.float64).expand(n * b, hv, d, d)
        _, final64 = _fp64_rule(stacked[0], stacked[1], aug, stacked[3], stacked[4],
                                torch.cat([eye.new_zeros(n * b, hv, d, d), eye], dim=-1))
        U64, M64 = final64.split([d, d], dim=-1)
        row: dict = {}
        for name, kernel in candidates.items():
            if kernel is None:
                row[name] = f"not run: {fla.reason}"
                continue
            with torch.no_grad():
                parts = [chunk_summary(*c, kernel=kernel) for c in chunks]
            states = fold_states([p[2] for p in parts], [p[3] for p in parts])
            out = torch.cat([read_state(o0, w, s) for (o0, w, _, _), s in zip(parts, states)], dim=1)
            row[name] = {
                "M_rel_err": max(_rel(p[2], M64[i * b:(i + 1) * b]) for i, p in enumerate(parts)),
                "U_rel_err": max(_rel(p[3], U64[i * b:(i + 1) * b]) for i, p in enumerate(parts)),
                "output_rel_err": _rel(out, ref_out),
                "final_state_rel_err": _rel(states[-1], ref_final),
            }
        result[f"cp{cp}"] = row
        print(f"  tf32_summaries cp={cp} ({n} chunks of {length}): "
              + "; ".join(f"{k_}: " + (", ".join(f"{m} {x:.2e}" for m, x in r.items()) if isinstance(r, dict) else r)
                          for k_, r in row.items()), flush=True)
    torch.cuda.synchronize()
    return result


def check_ops(device: str, smoke: bool = False) -> dict:
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    from qwen35_accel.ops.gated_delta import chunk_summary, fold_states, read_state

    torch.backends.cuda.matmul.allow_tf32 = False
    gen = torch.Generator(device="cpu").manual_seed(0)
    b, seq, hk, hv, dk, dv = (1, 512, 2, 4, 32, 32) if smoke else (1, 2048, 4, 8, 128, 128)
    q = torch.randn(b, seq, hk, dk, generator=gen)
    k = torch.randn(b, seq, hk, dk, generator=gen)
    v = torch.randn(b, seq, hv, dv, generator=gen)
    g = -torch.empty(b, seq, hv).uniform_(0.002, 0.05, generator=gen)
    beta = torch.rand(b, seq, hv, generator=gen)
    inputs = [t.to(device) for t in (q, k, v, g, beta)]
    result = {}
    for name, dtype in (("fp32", torch.float32), ("bf16_inputs", torch.bfloat16)):
        cast = [t.to(dtype) if i < 3 else t for i, t in enumerate(inputs)]
        reference, final = torch_chunk_gated_delta_rule(
            *[t.float() for t in inputs[:3]], g=inputs[3], beta=inputs[4], output_final_state=True, use_qk_l2norm_in_kernel=True
        )
        n = 8
        parts = [chunk_summary(*(t[:, i * seq // n : (i + 1) * seq // n] for t in cast)) for i in range(n)]
        states = fold_states([p[2] for p in parts], [p[3] for p in parts])
        out = torch.cat([read_state(o0, w, s) for (o0, w, _, _), s in zip(parts, states)], dim=1)
        result[name] = {"output_rel_err": _rel(out, reference), "final_state_rel_err": _rel(states[-1], final)}
    torch.cuda.synchronize() if device == "cuda" else None
    return result


def check_attention_memory(device: str, smoke: bool = False) -> dict:
    """Peak memory of one CP query chunk's attention (forward + backward), bf16: the
    lower-right causal SDPA qwen35_accel uses vs an explicit [chunk, keys] boolean mask."""
    if device != "cuda":
        return {"skipped": "needs CUDA"}
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right

    b, h, hkv, chunk, keys, d = (1, 4, 2, 256, 1024, 64) if smoke else (1, 16, 4, 8192, 32768, 128)
    q = torch.randn(b, h, chunk, d, device=device, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(b, hkv, keys, d, device=device, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(b, hkv, keys, d, device=device, dtype=torch.bfloat16, requires_grad=True)
    mask = torch.arange(keys, device=device)[None, :] <= (keys - chunk + torch.arange(chunk, device=device))[:, None]
    result = {}
    outs = {}
    for name, kwargs in (("lower_right", dict(attn_mask=causal_lower_right(chunk, keys))), ("bool_mask", dict(attn_mask=mask))):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        started = time.perf_counter()
        out = F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kwargs)
        out.float().sum().backward()
        torch.cuda.synchronize()
        result[name] = {"peak_extra_MiB": (torch.cuda.max_memory_allocated() - base) / 2**20, "s": time.perf_counter() - started}
        outs[name] = (out.detach().float(), q.grad.float().clone())
        q.grad = k.grad = v.grad = None
    result["out_rel_err"] = _rel(outs["lower_right"][0], outs["bool_mask"][0])
    result["dq_rel_err"] = _rel(outs["lower_right"][1], outs["bool_mask"][1])
    return result


def check_packing(device: str, smoke: bool = False) -> dict:
    """Packed rows on the device, one process: every document of a packed row against that
    document alone through the unmodified model (fp32, TF32 off): logits and every
    gradient. With causal-conv1d / FLA installed the layers use their varlen kernels
    (`seq_idx` / `cu_seqlens`), which the CPU suite cannot reach."""
    from qwen35_accel.model import fp32_gate, kernel_functions
    from qwen35_accel.testing.tiny import build_tiny_causal_lm, packed_documents

    torch.backends.cuda.matmul.allow_tf32 = False
    lengths = [70, 24, 3, 1, 40] if smoke else [700, 240, 3, 1, 1400, 64, 65]
    reference = build_tiny_causal_lm(seed=0).to(device)
    model = build_tiny_causal_lm(seed=0).to(device)
    fp32_gate.install_fp32_gate(model)
    batch, documents = packed_documents(lengths, reference.config.vocab_size, seed=1)
    out = model(**{k: v.to(device) for k, v in batch.items()})
    out.logits.float().square().mean().backward()
    alone = torch.cat([reference(input_ids=d.to(device)).logits for d in documents], dim=1)
    alone.float().square().mean().backward()
    ref = dict(reference.named_parameters())
    grad_err = max(_rel(p.grad, ref[n.replace("._fp32_params.", ".")].grad) for n, p in model.named_parameters())
    probe = out.logits.new_zeros(1)
    return {
        "varlen_conv": kernel_functions.varlen_kernel("causal_conv1d", probe),
        "varlen_rule": kernel_functions.varlen_kernel("fla", probe),
        "logits_rel_err": _rel(out.logits, alone),
        "max_grad_rel_err": grad_err,
    }


def check_cp_kernels(device: str, smoke: bool = False) -> dict:
    """The kernels a CP GatedDeltaNet layer chooses on `device` against the torch kernels."""
    from qwen35_accel.ops.causal_conv import select_conv_kernel, torch_conv_kernel
    from qwen35_accel.ops.gated_delta import chunk_summary, select_kernel, torch_kernel
    from qwen35_accel.parallel.context_parallel.sharded_documents import conv_seq_idx

    torch.backends.cuda.matmul.allow_tf32 = False
    gen = torch.Generator(device="cpu").manual_seed(3)
    b, seq, h, dk, dv = (1, 256, 2, 32, 32) if smoke else (1, 4096, 8, 128, 128)
    g = -torch.empty(b, seq, h).uniform_(0.002, 0.05, generator=gen)
    inputs = [torch.randn(b, seq, h, dk, generator=gen), torch.randn(b, seq, h, dk, generator=gen),
              torch.randn(b, seq, h, dv, generator=gen), g, torch.rand(b, seq, h, generator=gen)]
    kernel = select_kernel(torch.device(device))
    result: dict = {"rule_kernel": f"{kernel.__module__}.{kernel.__name__}"}
    runs = []
    # The chosen kernel on fp32 inputs (what the CP layer passes) and on bf16 q/k/v (what the
    # non-CP path hands FLA under bf16 compute), each against the torch kernel in fp32.
    for k, dtype in ((kernel, torch.float32), (kernel, torch.bfloat16), (torch_kernel(), torch.float32)):
        leaves = [t.to(device, copy=True).requires_grad_(True) for t in inputs]  # fresh leaves per run
        parts = chunk_summary(*leaves, kernel=k, input_dtype=dtype)
        sum(p.float().square().mean() for p in parts).backward()
        runs.append(([p.detach() for p in parts], [t.grad for t in leaves]))
    for tag, run in (("summary", runs[0]), ("summary_bf16_inputs", runs[1])):
        for name, mine, ref in zip(("o0", "w", "M", "U"), run[0], runs[2][0]):
            result[f"{tag}_{name}_rel_err"] = _rel(mine, ref)
        result[f"{tag}_max_grad_rel_err"] = max(_rel(a, r) for a, r in zip(run[1], runs[2][1]))

    conv = select_conv_kernel(torch.device(device))
    result["conv_kernel"] = f"{conv.__module__}.{conv.__name__}"
    channels, taps, halo = (64, 4, 3) if smoke else (8192, 4, 3)
    offsets = torch.cat([torch.arange(5, 5 + 40), torch.arange(seq - 40)])[None].to(device)  # a document start inside
    hidden = torch.randn(b, halo + seq, channels, generator=gen).to(device, torch.bfloat16)
    weight = torch.randn(channels, taps, generator=gen).to(device, torch.bfloat16)
    bias = torch.randn(channels, generator=gen).to(device, torch.bfloat16)
    for packed in (False, True):
        seq_idx = conv_seq_idx(offsets, halo) if packed else None
        runs = []
        for k in (conv, torch_conv_kernel):
            leaves = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
            out = k(leaves[0].transpose(1, 2), leaves[1], leaves[2], seq_idx=seq_idx, activation="silu")[..., halo:]
            out.float().square().mean().backward()
            runs.append((out.detach(), [t.grad for t in leaves]))
        tag = "conv_packed" if packed else "conv"
        result[f"{tag}_rel_err"] = _rel(runs[0][0], runs[1][0])
        result[f"{tag}_max_grad_rel_err"] = max(_rel(a, r) for a, r in zip(runs[0][1], runs[1][1]))
    return result


def _model_worker(rank: int, world: int, device: str, out_dir: str, smoke: bool) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from qwen35_accel.context_parallel import shard_batch
    from qwen35_accel.model.fp32_gate import install_fp32_gate
    from qwen35_accel.parallel.context_parallel.model import install_context_parallel
    from qwen35_accel.testing.tiny import build_tiny_causal_lm, random_batch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if device == "cuda":
        torch.cuda.set_device(0)
    results: dict = {}
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))  # gloo group; tensors live on `device`
    wide = dict(hidden_size=256, linear_num_value_heads=8, linear_num_key_heads=4, linear_key_head_dim=64,
                linear_value_head_dim=64, head_dim=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=512)
    cases = (("fp32_seq64", torch.float32, 64, {}), ("bf16_seq256", torch.bfloat16, 256, {})) if smoke else (
        ("fp32_seq256", torch.float32, 256, {}), ("bf16_seq8192", torch.bfloat16, 8192, wide))
    for name, dtype, seq, shape in cases:
        reference = build_tiny_causal_lm(seed=0, dtype=dtype, **shape).to(device)
        model = build_tiny_causal_lm(seed=0, dtype=dtype, **shape).to(device)
        install_fp32_gate(model)
        install_context_parallel(model, mesh)
        batch = {k: v.to(device) for k, v in random_batch(1, seq, reference.config.vocab_size, seed=1).items()}
        ref = reference(**batch)
        ref.loss.backward()
        started = time.perf_counter()
        out = model(**shard_batch(batch, mesh))
        out.loss.backward()
        if device == "cuda":
            torch.cuda.synchronize()
        worst = 0.0
        ref_params = dict(reference.named_parameters())
        for pname, p in model.named_parameters():
            grad = p.grad.detach().float().clone()
            dist.all_reduce(grad, op=dist.ReduceOp.SUM)  # what FSDP's average over the cp group does, × cp
            worst = max(worst, _rel(grad / world, ref_params[pname].grad.float()))
        results[name] = {
            "loss": out.loss.item(), "reference_loss": ref.loss.item(),
            "loss_rel_err": abs(out.loss.item() - ref.loss.item()) / abs(ref.loss.item()),
            "max_grad_rel_err": worst, "cp_step_s": time.perf_counter() - started,
            "gate_dtype": str(model.model.layers[0].linear_attn.A_log.dtype),
        }
    if rank == 0:
        with open(os.path.join(out_dir, "model_check.json"), "w") as f:
            json.dump(results, f)


def _fsdp_worker(rank: int, world: int, device: str, out_dir: str, smoke: bool) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from qwen35_accel import PARALLELIZER
    from qwen35_accel.context_parallel import shard_batch
    from qwen35_accel.testing.tiny import build_tiny_causal_lm, random_batch

    if device == "cuda":
        torch.cuda.set_device(0)
    mesh = init_device_mesh(device, (1, world), mesh_dim_names=("dp_shard", "cp"))
    mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    model = PARALLELIZER.apply(build_tiny_causal_lm(seed=0).to(device), mesh)
    batch = {k: v.to(device) for k, v in random_batch(1, 64 if smoke else 256, model.config.vocab_size, seed=1).items()}
    loss = model(**shard_batch(batch, mesh["cp"])).loss
    loss.backward()
    if rank == 0:
        with open(os.path.join(out_dir, "fsdp_check.json"), "w") as f:
            json.dump({"loss": loss.item()}, f)


def _tp_worker(rank: int, world: int, device: str, out_dir: str, smoke: bool) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from qwen35_accel import PARALLELIZER
    from qwen35_accel.context_parallel import shard_batch
    from qwen35_accel.parallel.tensor_parallel import gather_tensor_parallel
    from qwen35_accel.testing.tiny import build_tiny_causal_lm, random_batch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if device == "cuda":
        torch.cuda.set_device(0)
    cp = world // 2
    mesh = init_device_mesh(device, (1, cp, 2), mesh_dim_names=("dp_shard", "cp", "tp"))
    mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    reference = build_tiny_causal_lm(seed=0).to(device)
    model = PARALLELIZER.apply(build_tiny_causal_lm(seed=0).to(device), mesh)
    batch = {k: v.to(device) for k, v in random_batch(2, 64 if smoke else 256, reference.config.vocab_size, seed=1).items()}
    ref = reference(**batch)
    ref.loss.backward()
    out = model(**(shard_batch(batch, mesh["cp"]) if cp > 1 else batch))
    out.loss.backward()
    worst, devices = 0.0, set()
    ref_params = {k.replace("._fp32_params.", "."): p for k, p in reference.named_parameters()}
    for name, p in model.named_parameters():
        devices.add(str(p.grad.device))
        grad = gather_tensor_parallel(model, name, p.grad)
        worst = max(worst, _rel(grad.float(), ref_params[name.replace("._fp32_params.", ".")].grad.float()))
    loss = out.loss.detach().clone()
    dist.all_reduce(loss, op=dist.ReduceOp.AVG)
    if rank == 0:
        with open(os.path.join(out_dir, f"tp_check_world{world}.json"), "w") as f:
            json.dump({"loss_rel_err": abs(loss.item() - ref.loss.item()) / abs(ref.loss.item()),
                       "max_grad_rel_err": worst, "grad_devices": sorted(devices)}, f)


def _smoke_worker(rank: int, world: int, device: str, out_dir: str, smoke: bool) -> None:
    """--smoke: the 2-rank checks (CP model, FSDP2 + CP, TP 2) in one world."""
    for worker in (_model_worker, _fsdp_worker, _tp_worker):
        worker(rank, world, device, out_dir, smoke)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=os.environ.get("OUT"),
                        help="where cuda_check.json goes (default: $OUT, else --results-dir, else the current folder)")
    parser.add_argument("--checks", nargs="+", default=None, metavar="NAME",
                        help="run only these checks (their names in cuda_check.json, e.g. tf32_summaries)")
    _report.add_arguments(parser)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    out = args.out if args.out is not None else args.results_dir if args.results_dir is not None else None if args.smoke else Path(".")
    with tempfile.TemporaryDirectory() as tmp:
        _checks(args.device, args.smoke, out, Path(tmp), args.checks)


def _checks(device: str, smoke: bool, out: Path | None, scratch: Path, only: list[str] | None = None) -> None:
    """Run every check (or those named in `only`), print each result; write cuda_check.json to
    `out` (None: nowhere)."""
    from qwen35_accel.testing.local_world import run_local_world

    run = _report.Run()
    work = str(scratch)  # the workers' own json files
    # A smoke run spawns one world (starting a world costs more than these checks): the 2-rank checks
    # run one after the other in it, and cp2xtp2 (4 ranks) is left out.
    skipped = {"skipped": "--smoke: ran in model_cp2's world"} if smoke else None
    report: dict = {"environment": check_environment(device)}
    for name, fn in (("fla_preflight", lambda: check_fla_preflight(device, smoke)),
                     ("ops", lambda: check_ops(device, smoke)),
                     ("attention_memory", lambda: check_attention_memory(device, smoke)),
                     ("packing", lambda: check_packing(device, smoke)),
                     ("cp_kernels", lambda: check_cp_kernels(device, smoke)),
                     ("tf32_summaries", lambda: check_tf32_summaries(device, smoke)),
                     ("model_cp2", lambda: run_local_world(_smoke_worker if smoke else _model_worker, 2, device, work, smoke,
                                                           threads_per_rank=4)),
                     ("fsdp2_cp2", lambda: skipped or run_local_world(_fsdp_worker, 2, device, work, smoke, threads_per_rank=4)),
                     ("tp2", lambda: skipped or run_local_world(_tp_worker, 2, device, work, smoke, threads_per_rank=4)),
                     ("cp2xtp2", lambda: (smoke and {"skipped": "--smoke: 4 ranks"}) or run_local_world(
                         _tp_worker, 4, device, work, smoke, threads_per_rank=2))):
        if only is not None and name not in only:
            continue
        started = time.perf_counter()
        try:
            value = fn()
            report[name] = value if value is not None else "ok"
        except Exception:  # report and go on: one failing check must not hide the others
            report[name] = {"error": traceback.format_exc()[-3000:]}
        report[f"{name}_seconds"] = round(time.perf_counter() - started, 1)
        print(name, json.dumps(report[name])[:1500], flush=True)
    for extra in ("model_check.json", "fsdp_check.json", "tp_check_world2.json", "tp_check_world4.json"):
        path = scratch / extra
        if path.exists():
            report[extra] = json.loads(path.read_text())
    print(json.dumps(report, indent=2)[:6000])
    if out is not None:
        report["run"] = run.fields()
        out.mkdir(parents=True, exist_ok=True)
        (out / "cuda_check.json").write_text(json.dumps(report, indent=2))
        print(f"\nwrote {out / 'cuda_check.json'}")


if __name__ == "__main__":
    main()
