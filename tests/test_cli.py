"""`qwen35-accel plan` / `env`: `env`, a text plan and a refused config run as a user would, in a
fresh process; the other plans call the command's `main` in this process (tests/_cli.py: the same
arguments, output and exit code, without an interpreter start and its imports per call)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from _cli import run_cli
from qwen35_accel.ops.kernels import KERNEL_NAMES

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "accelerate_configs"


def cli(*args: str, env: dict[str, str] | None = None) -> dict:
    """`qwen35-accel ARGS --json` in this process (tests/_cli.py)."""
    result = run_cli(*args, "--json", env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


def cli_in_a_fresh_process(*args: str) -> dict:
    result = subprocess.run(
        [sys.executable, "-m", "qwen35_accel.cli", *args, "--json"], capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


def test_plan_tiny_shows_mesh_dtype_uniform_units_and_cp_layout():
    p = cli("plan", "--model", "tiny", "--config", str(CONFIGS / "cpu_fsdp2_dp2_cp2.yaml"), "--seq-len", "1024")
    assert p["mesh"] == {"world": 4, "dp_replicate": 1, "dp_shard": 2, "cp": 2, "tp": 1} and p["fsdp_shards"] == 4
    for layer in p["layers"]:
        modules = [u["modules"][0] for u in layer["units"]]
        assert modules[0] == f"model.layers.{layer['layer']}"
        if layer["type"] == "linear_attention":
            holder = next(u for u in layer["units"] if u["modules"][0].endswith("linear_attn._fp32_params"))
            assert holder["storage"] == holder["compute"] == "float32" and holder["params"] == 8
    assert p["sharded_bytes_all_ranks"] == p["model_bytes"]
    # The prefetch chain as set on the units: embedding -> layer 0 ... last layer -> tail.
    last = len(p["layers"]) - 1
    assert p["prefetch"]["forward"]["model.embed_tokens"][0] == "model.layers.0"
    assert p["prefetch"]["forward"][f"model.layers.{last}"] == ["model.norm+lm_head"]
    assert p["prefetch"]["backward"]["model.norm+lm_head"][0] == f"model.layers.{last}"
    off = cli("plan", "--model", "tiny", "--config", str(CONFIGS / "cpu_fsdp2.yaml"), env={"QWEN35_ACCEL_FSDP2_PREFETCH": "0"})
    assert off["prefetch"] == {"forward": {}, "backward": {}}
    cp = p["context_parallel"]
    assert cp["layout"][0].startswith("rank 0: chunks 0 and 3 of 4")
    # GatedDeltaNet traffic does not depend on the sequence; attention's does.
    longer = cli("plan", "--model", "tiny", "--config", str(CONFIGS / "cpu_fsdp2_dp2_cp2.yaml"), "--seq-len", "4096")
    assert longer["context_parallel"]["linear_attention_bytes_per_rank"] == cp["linear_attention_bytes_per_rank"]
    assert longer["context_parallel"]["full_attention_bytes_per_rank"] == 4 * cp["full_attention_bytes_per_rank"]


def test_plan_reports_the_state_exchange_the_run_takes(tmp_path):
    """Per backend and cp, the exchange `auto` resolves to and its bytes (the formula
    `benchmarks/cp_comm.py` checks against the profiler); tp splits the heads."""
    from qwen35_accel.plan.comm import cp_comm as _cp_comm
    from qwen35_accel.parallel.context_parallel.state_exchange import exchange_bytes
    from qwen35_accel.testing.tiny import tiny_text_config

    config = tiny_text_config()
    heads, k, v = config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim
    seen = {}
    for cp, tp, backend, want in ((2, 1, "nccl", "allgather"), (2, 1, "gloo", "scan"), (8, 1, "nccl", "scan"),
                                  (8, 2, "nccl", "scan")):
        cp_plan = _cp_comm(config, cp, tp, 1024, 4, "auto", backend)
        assert (cp_plan["backend"], cp_plan["state_exchange"]) == (backend, want), cp_plan
        formula = exchange_bytes(want, cp, heads // tp, k, v)
        assert cp_plan["state_exchange_bytes_per_rank"] == formula["forward"] > 0
        assert cp_plan["state_exchange_kept_bytes_per_rank"] == formula["kept"]
        seen[cp, tp, backend] = cp_plan
    assert seen[8, 2, "nccl"]["state_exchange_bytes_per_rank"] * 2 == seen[8, 1, "nccl"]["state_exchange_bytes_per_rank"]
    assert seen[8, 2, "nccl"]["full_attention_bytes_per_rank"] * 2 == seen[8, 1, "nccl"]["full_attention_bytes_per_rank"]

    # Through the command: the config's cp and tp, --backend, and the setting a run would read.
    text = (CONFIGS / "cpu_fsdp2_cp2.yaml").read_text()
    path = tmp_path / "cp8_tp2.yaml"
    path.write_text(text.replace("num_processes: 2", "num_processes: 16").replace("parallelism_config_cp_size: 2", "parallelism_config_cp_size: 8")
                    .replace("parallelism_config_tp_size: 1", "parallelism_config_tp_size: 2"))
    assert cli("plan", "--model", "tiny", "--config", str(path), "--seq-len", "1024", "--backend", "nccl")["context_parallel"] == seen[8, 2, "nccl"]
    # Without --backend a CPU YAML's run is over gloo.
    assert cli("plan", "--model", "tiny", "--config", str(path), "--seq-len", "1024")["context_parallel"] == _cp_comm(
        config, 8, 2, 1024, 4, "auto", "gloo")
    forced = cli("plan", "--model", "tiny", "--config", str(CONFIGS / "cpu_fsdp2_cp2.yaml"), "--seq-len", "1024",
                 "--backend", "gloo", env={"QWEN35_ACCEL_CP_STATE_EXCHANGE": "allgather"})["context_parallel"]
    assert forced["state_exchange"] == "allgather" and forced["state_exchange_reason"] == "QWEN35_ACCEL_CP_STATE_EXCHANGE"
    assert forced["state_exchange_bytes_per_rank"] == exchange_bytes("allgather", 2, heads, k, v)["forward"]


def test_plan_27b_config_on_meta_adds_up_to_the_model(tmp_path):
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    layers = 64  # Qwen3.5-27B-like shape: 3 GatedDeltaNet layers per full-attention layer
    config = Qwen3_5TextConfig(
        vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=layers,
        num_attention_heads=24, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
        linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
        tie_word_embeddings=False, dtype="bfloat16",
    )
    config.architectures = ["Qwen3_5ForCausalLM"]
    config.save_pretrained(tmp_path)
    p = cli("plan", "--model", str(tmp_path), "--config", str(CONFIGS / "fsdp2.yaml"))
    assert 25e9 < p["parameters"] < 29e9 and p["mixed_precision"] == "bf16"
    # A GPU YAML is a CUDA plan on any machine, FLA and causal-conv1d assumed.
    assert p["run"] == {"device": "cuda", "backend": "nccl", "kernels": "fla", "source": "the YAML: a GPU config (use_cpu: false)"}
    assert (p["memory_assumptions"]["device"], p["memory_assumptions"]["fla"]) == ("cuda", True)
    assert p["sharded_bytes_all_ranks"] == p["model_bytes"] == 4 * p["parameters"]  # fp32 master weights
    assert p["bytes_per_rank_max"] * p["fsdp_shards"] >= p["model_bytes"]
    unit = p["layers"][0]["units"][0]
    assert (unit["storage"], unit["compute"]) == ("float32", "bfloat16")
    assert len(p["layers"]) == layers


def test_plan_takes_qwen36_27b_as_published_a_qwen3_5_vlm(tmp_path):
    """Qwen3.6-27B ships as `model_type` `qwen3_5`, `Qwen3_5ForConditionalGeneration`, with its model
    card's text shape (hidden 5120, 64 layers as 16 x (3 GatedDeltaNet + 1 gated attention), GatedDeltaNet
    48 value / 16 key heads of 128, attention 24 / 4 heads of 256, rotary 64, FFN 17408, vocab 248320,
    262,144 positions, rope theta 1e7): the plugin's units and head-parallel TP plan take it as they take
    Qwen3.5-27B (config only, on meta)."""
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5Config

    layers = 64
    text = dict(
        vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=layers, num_attention_heads=24,
        num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, max_position_embeddings=262144,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000, "partial_rotary_factor": 0.25,
                         "mrope_section": [11, 11, 10], "mrope_interleaved": True},
        tie_word_embeddings=False, dtype="bfloat16",
    )
    config = Qwen3_5Config(text_config=text, tie_word_embeddings=False)
    config.architectures = ["Qwen3_5ForConditionalGeneration"]
    config.save_pretrained(tmp_path)
    p = cli("plan", "--model", str(tmp_path), "--config", str(CONFIGS / "fsdp2_tp2.yaml"))
    assert p["architecture"] == "Qwen3_5ForConditionalGeneration" and 26e9 < p["parameters"] < 29e9, p["parameters"]
    assert len(p["layers"]) == layers and p["mesh"]["tp"] == 2
    for index, layer in enumerate(p["layers"]):
        holders = [u for u in layer["units"] if u["modules"][0].endswith("._fp32_params")]
        if (index + 1) % 4:  # a GatedDeltaNet layer: its fp32 gate holder, this rank's 24 of 48 heads (A_log, dt_bias)
            assert [(u["storage"], u["compute"], u["params"]) for u in holders] == [("float32", "float32", 48)], layer
        else:
            assert not holders, layer


def test_plan_counts_activation_offload_and_suggests_it_a_million_tokens_of_27b_on_8_gpus(tmp_path):
    """fsdp2_cp2.yaml at cp 8 (dp_shard 1) with checkpointing: 1,048,576 tokens per row of the 27B-like
    shape do not fit 141 GB per GPU without offload (`--suggest` proposes it), and fit with
    `fsdp_activation_checkpointing_offload`, every layer's input then in host memory."""
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    layers, hidden, seq = 64, 5120, 1 << 20
    config = Qwen3_5TextConfig(
        vocab_size=248320, hidden_size=hidden, intermediate_size=17408, num_hidden_layers=layers,
        num_attention_heads=24, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
        linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
        tie_word_embeddings=False, dtype="bfloat16",
    )
    config.architectures = ["Qwen3_5ForCausalLM"]
    config.save_pretrained(tmp_path / "model")
    yaml = (CONFIGS / "fsdp2_cp2.yaml").read_text().replace("parallelism_config_dp_shard_size: 4", "parallelism_config_dp_shard_size: 1")
    yaml = yaml.replace("parallelism_config_cp_size: 2", "parallelism_config_cp_size: 8")
    yaml = yaml.replace("fsdp_activation_checkpointing: false", "fsdp_activation_checkpointing: true")
    plans = {}
    for offload in (False, True):
        path = tmp_path / f"cp8_offload_{offload}.yaml"
        path.write_text(yaml.replace("fsdp_activation_checkpointing: true",
                                     f"fsdp_activation_checkpointing: true\n  fsdp_activation_checkpointing_offload: {str(offload).lower()}"))
        plans[offload] = cli("plan", "--model", str(tmp_path / "model"), "--config", str(path), "--seq-len", str(seq),
                             "--gpu-memory", "141GB", "--suggest", "--host-memory", "2TB")
    without, with_offload = plans[False], plans[True]
    assert without["mesh"]["cp"] == 8 and not without["fits"]
    assert without["suggested_offload"]["total"] <= 141e9
    assert with_offload["fits"] and with_offload["memory_assumptions"]["activation_offload"]
    per_layer = seq // 8 * hidden * 2  # a layer's input, this rank's chunk, bf16: 1.25 GiB
    host = layers * 2 * 2**30  # each in a pinned buffer, rounded up to a power of two by torch's host allocator
    assert with_offload["memory_per_rank"]["host_activations"] == host == with_offload["offload"]["host_bytes_per_rank"]
    assert without["memory_per_rank"]["activations"] - with_offload["memory_per_rank"]["activations"] == (layers - 2) * per_layer
    assert "suggested_offload" not in with_offload  # it fits as configured
    # Each layer's input copies (1.25 GiB at 25 GB/s: 54 ms each way) hide behind the compute the plan assumes.
    off = with_offload["offload"]
    assert off["seconds_per_layer_each_way"] == per_layer / 25e9 and off["copy_to_host_hidden"] and off["copy_back_hidden"]
    assert off["forward_seconds_per_layer"]["linear_attention"] > 3 * off["seconds_per_layer_each_way"]
    # Host memory is per node: the 8 ranks of the one machine hold 8 x 128 GiB pinned (1 TiB), within 80 % of 2 TB.
    assert (off["ranks_per_node"], off["host_bytes_per_node"], off["host_fits"]) == (8, 8 * host, True)
    assert "offload" not in without
    suggested = without["suggested_offload"]  # --host-memory checks the suggestion too
    assert (suggested["ranks_per_node"], suggested["host_bytes_per_node"], suggested["host_fits"]) == (8, 8 * host, True)


def test_plan_host_memory_per_node_counts_the_ranks_of_a_node_and_refuses_a_bad_size():
    from qwen35_accel.memory import HOST_MEMORY_SHARE, host_per_node
    from qwen35_accel.plan import PlanError, host_memory_option

    per_rank = 100 * 2**30
    two_nodes = host_per_node(per_rank, world=16, machines=2, host_memory=10**12)
    assert (two_nodes["ranks_per_node"], two_nodes["host_bytes_per_node"]) == (8, 8 * per_rank)
    assert not two_nodes["host_fits"], "800 GiB of inputs on a node of 1 TB (80 % usable: 745 GiB)"
    assert host_per_node(per_rank, world=16, machines=2, host_memory=2 * 10**12)["host_fits"]
    assert "host_fits" not in host_per_node(per_rank, world=8, machines=1, host_memory=None)
    assert HOST_MEMORY_SHARE == 0.8
    with pytest.raises(PlanError, match="--host-memory '2x' is not a memory size"):
        host_memory_option("2x")
    nothing = run_cli("plan", "--model", "tiny", "--config", str(CONFIGS / "cpu_fsdp2.yaml"), "--seq-len", "256",
                      "--host-memory", "1TB")
    assert nothing.returncode == 2 and "--host-memory: nothing is kept in host memory in this plan" in nothing.stderr, \
        nothing.stderr[-2000:]


def test_plan_names_the_run_it_plans_and_backend_overrides_the_yaml():
    """The printed plan says which run it plans: a CPU YAML's (gloo, torch kernels), or with
    --backend the other one; the memory line counts that run's kernels."""
    text = subprocess.run(
        [sys.executable, "-m", "qwen35_accel.cli", "plan", "--model", "tiny", "--config", str(CONFIGS / "cpu_fsdp2.yaml"),
         "--seq-len", "256"], capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert text.returncode == 0, text.stderr[-3000:]
    assert "run planned: CPU processes over gloo, Transformers' torch GatedDeltaNet kernels (from the YAML: use_cpu: true;" in text.stdout
    assert "torch GatedDeltaNet kernels):" in text.stdout  # the memory line
    forced = cli("plan", "--model", "tiny", "--config", str(CONFIGS / "fsdp2.yaml"), "--seq-len", "256", "--backend", "gloo")
    assert forced["run"] == {"device": "cpu", "backend": "gloo", "kernels": "torch", "source": "--backend gloo"}
    assert (forced["memory_assumptions"]["device"], forced["memory_assumptions"]["fla"]) == ("cpu", False)


@pytest.mark.slow  # a plan of its own; the other plan tests cover the command
def test_plan_shows_tensor_parallel_slices_that_add_up_to_the_model():
    p = cli("plan", "--model", "tiny", "--config", str(CONFIGS / "cpu_fsdp2_tp2.yaml"))
    assert p["tensor_parallel"] == {"tp": 2, "status": "applied"} and p["mesh"]["tp"] == 2
    plain = cli("plan", "--model", "tiny", "--config", str(CONFIGS / "cpu_fsdp2.yaml"))
    assert p["parameters"] == plain["parameters"] and p["sharded_bytes_all_ranks"] == p["model_bytes"]
    holder = p["layers"][0]["units"][1]
    assert holder["modules"][0].endswith("_fp32_params") and holder["params"] * 2 == plain["layers"][0]["units"][1]["params"]


def test_env_lists_versions_plugin_and_patch_points():
    e = cli_in_a_fresh_process("env")  # a fresh process: what env imports, and what it leaves deferred
    assert e["versions"]["torch"] and e["autoload_entry_point"] == "qwen35_accel_autoload:activate"
    points = {pt["target"]: pt for pt in e["plugin"]["patch_points"]}
    assert e["plugin"]["active"] and all(pt["active"] for t, pt in points.items() if t.startswith("accelerate."))
    assert points["transformers.trainer.Trainer.save_model"]["deferred"]  # env does not import the Trainer
    assert {row["variable"] for row in e["settings_reference"]} >= {"QWEN35_ACCEL", "QWEN35_ACCEL_CPU_FSDP"}
    # Which GatedDeltaNet kernels a run takes here, and for each optional package what was found.
    kernels = e["kernels"]
    assert kernels["device"] == "cpu" and kernels["summary"][0].startswith("CPU run: the torch kernels run")
    summary = [line.strip() for line in kernels["summary"][1:]]
    assert [line.split(":")[0] for line in summary if line.startswith("GatedDeltaNet")] == ["GatedDeltaNet rule", "GatedDeltaNet conv"]
    assert set(kernels["packages"]) == {"fla", "causal_conv1d", "fla_conv"}
    for package, found in kernels["packages"].items():  # each candidate on its own line, with its verdict
        line = next(line for line in summary if line.startswith(KERNEL_NAMES[package]))
        assert found["distribution"] in line and found["reason"] in line
        assert isinstance(found["usable"], bool) and found["reason"] and isinstance(found["transformers_calls_it"], bool)


def test_plan_with_an_impossible_config_prints_one_line_naming_the_fix_and_exits_2(tmp_path):
    config = tmp_path / "tp3.yaml"  # the tiny model has 4 attention heads and 2 key/value heads
    config.write_text(
        (CONFIGS / "cpu_fsdp2_tp2.yaml").read_text()
        .replace("num_processes: 4", "num_processes: 6").replace("parallelism_config_tp_size: 2", "parallelism_config_tp_size: 3")
    )
    result = subprocess.run(
        [sys.executable, "-m", "qwen35_accel.cli", "plan", "--model", "tiny", "--config", str(config)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and result.stderr.strip().count("\n") == 0, result.stderr
    assert "tp size 3 must divide num_attention_heads = 4" in result.stderr
    assert "this model takes tp sizes [1, 2]" in result.stderr


def test_plan_of_a_deepspeed_or_fsdp1_yaml_says_that_run_is_not_laid_out_as_fsdp2(tmp_path):
    """A plan of FSDP2 units for a run that goes through DeepSpeed or FSDP v1 would describe a run that
    does not happen (issue 60): refused, naming the engine and the way to a plan."""
    from qwen35_accel.plan import PlanError, plan

    fsdp1 = tmp_path / "fsdp1.yaml"
    fsdp1.write_text((CONFIGS / "cpu_fsdp2.yaml").read_text().replace("  fsdp_version: 2\n", ""))  # Accelerate's default: 1
    deepspeed = tmp_path / "zero3.yaml"
    deepspeed.write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\nmixed_precision: bf16\nnum_machines: 1\n"
        "num_processes: 2\ndeepspeed_config:\n  zero_stage: 3\n"
    )
    with pytest.raises(PlanError, match=r"runs FSDP v1 \(fsdp_version: 1\).*accelerate to-fsdp2 --config_file"):
        plan("tiny", str(fsdp1))
    with pytest.raises(PlanError, match=r"runs DeepSpeed \(distributed_type: DEEPSPEED\): ZeRO lays the model out .* not planned"
                                         r".*estimate_zero3_model_states_mem_needs_all_live"):
        plan("tiny", str(deepspeed))


def test_env_with_an_unsupported_accelerate_says_why_the_plugin_is_off(monkeypatch, capsys):
    """What `env` prints in a process where Accelerate 1.14 is installed: the plugin's
    install() refuses that version, so no patch point is active."""
    import importlib.metadata

    import accelerate

    from qwen35_accel import cli
    from qwen35_accel.integrations import plugin

    real_version = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "1.14.0" if name == "accelerate" else real_version(name))
    monkeypatch.setattr(accelerate, "__version__", "1.14.0")
    plugin.uninstall()
    try:
        with pytest.warns(UserWarning, match="accelerate 1.14.0 is outside the tested range"):
            assert plugin.install() is False
        report = cli.env()
        cli.print_env(report)
    finally:
        monkeypatch.undo()
        plugin.install()
    out = capsys.readouterr().out
    assert report["versions_ok"] == {"torch": True, "transformers": True, "accelerate": False}
    assert "accelerate    1.14.0       UNSUPPORTED" in out
    assert f"plugin: NOT ACTIVE: accelerate 1.14.0 is outside the plugin's tested range {plugin.TESTED_ACCELERATE}" in out


def _cp8_yaml(tmp_path: Path, offload: bool) -> Path:
    """fsdp2_cp2.yaml at cp 8 (dp_shard 1, 8 GPUs) with activation checkpointing (and offload)."""
    yaml = (CONFIGS / "fsdp2_cp2.yaml").read_text().replace("parallelism_config_dp_shard_size: 4", "parallelism_config_dp_shard_size: 1")
    yaml = yaml.replace("parallelism_config_cp_size: 2", "parallelism_config_cp_size: 8")
    yaml = yaml.replace("fsdp_activation_checkpointing: false", "fsdp_activation_checkpointing: true\n"
                        f"  fsdp_activation_checkpointing_offload: {str(offload).lower()}")
    path = tmp_path / f"cp8_offload_{offload}.yaml"
    path.write_text(yaml)
    return path


def test_plan_knows_moe_a_million_tokens_of_35b_a3b_on_8_h200_with_ep_and_offload(tmp_path):
    """Transformers' default Qwen3.5-MoE text config is Qwen3.5-35B-A3B's shape (256 experts, top 8,
    40 layers, hidden 2048). At 1,048,576 tokens per row on 8 × H200 (cp 8, checkpointing): the plan
    lists each layer's experts as a unit of their own under QWEN35_ACCEL_EP=8, says what a rank
    computes with, and fits with activation offload (suggested where it is off); ep 8 gathers 1/8
    of a layer's experts, so it needs less than ep 1; where only a larger ep fits, --suggest names
    the smallest."""
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig

    config = Qwen3_5MoeTextConfig(dtype="bfloat16", tie_word_embeddings=False)
    config.architectures = ["Qwen3_5MoeForCausalLM"]
    config.save_pretrained(tmp_path / "model")
    seq = str(1 << 20)

    def planned(ep: int, offload: bool, memory: str = "141GB") -> dict:
        return cli("plan", "--model", str(tmp_path / "model"), "--config", str(_cp8_yaml(tmp_path, offload)), "--seq-len", seq,
                   "--gpu-memory", memory, "--suggest", env={"QWEN35_ACCEL_EP": str(ep)})

    ep8, ep1 = planned(8, False), planned(1, False)
    assert ep8["architecture"] == "Qwen3_5MoeForCausalLM" and ep8["mesh"]["cp"] == 8
    assert ep8["experts"] == {"per_layer": 256, "per_token": 8, "ep": 8, "efsdp": 1}
    assert [u["modules"] for u in ep8["layers"][0]["units"]][-1] == ["model.layers.0.mlp.experts"]
    assert not any(u["modules"] == ["model.layers.0.mlp.experts"] for u in ep1["layers"][0]["units"])
    # The same shards either way; ep gathers a layer's 32 experts instead of 256 (bf16: 1.4 GiB less per
    # layer in flight, 4 in backward with the unsharded gradient), less the combine buffer of the
    # recomputed layer (its 131,072 tokens × 8 returned rows, 4 GiB).
    assert ep8["memory_per_rank"]["parameters"] == ep1["memory_per_rank"]["parameters"]
    experts, returned = 3 * 256 * 512 * 2048 * 7 // 8, (1 << 17) * 8 * (2048 * 2 + 8)
    saved = experts * (3 * 2 + 2 + 4) - returned
    assert ep1["memory_per_rank"]["transient"] - ep8["memory_per_rank"]["transient"] == saved
    assert not ep8["fits"] and ep8["suggested_offload"]["total"] <= 141e9
    with_offload = planned(8, True)
    assert with_offload["fits"] and with_offload["memory_per_rank"]["total"] <= 141e9
    # Between ep 1's and ep 8's totals with offload, ep 1 does not fit and --suggest names the smallest ep that does.
    low, high = planned(1, True)["memory_per_rank"]["total"], with_offload["memory_per_rank"]["total"]
    budget = (low + high) // 2
    tight = planned(1, True, f"{budget}B")
    assert not tight["fits"] and tight["suggested_ep"] in (2, 4, 8)
    assert planned(tight["suggested_ep"], True, f"{budget}B")["fits"]
    if tight["suggested_ep"] > 2:
        assert not planned(tight["suggested_ep"] // 2, True, f"{budget}B")["fits"]


def test_plan_of_ep_x_tp_lists_each_ranks_held_experts_and_the_bytes_add_up(tmp_path):
    """cpu_fsdp2_tp2.yaml with QWEN35_ACCEL_EP=2 on a MoE of 8 experts: each layer's experts are held
    whole by their rank (2 of 8; no FSDP2 unit), listed beside the layer's units so every byte of
    the model is counted once over all ranks; a rank holds and computes with what it holds without
    ep too (FSDP2 shards the tp slices the same), it just gathers none of them."""
    from qwen35_accel.testing.tiny import tiny_moe_text_config

    tiny_moe_text_config(num_experts=8).save_pretrained(tmp_path / "moe8")
    args = ("plan", "--model", str(tmp_path / "moe8"), "--config", str(CONFIGS / "cpu_fsdp2_tp2.yaml"), "--seq-len", "256")
    held, tp = cli(*args, env={"QWEN35_ACCEL_EP": "2"}), cli(*args)
    assert held["tensor_parallel"]["status"] == "applied" and held["experts"]["ep"] == 2
    rows = [u for u in held["layers"][0]["units"] if u["modules"] == ["model.layers.0.mlp.experts (held: ep x tp)"]]
    hidden, inter = 32, tiny_moe_text_config().moe_intermediate_size
    assert len(rows) == 1 and rows[0]["params"] == 2 * 3 * inter * hidden, rows  # 2 experts: gate_up and down
    assert held["sharded_bytes_all_ranks"] == held["model_bytes"] == tp["sharded_bytes_all_ranks"]
    assert held["bytes_per_rank_max"] == tp["bytes_per_rank_max"]
    assert held["memory_per_rank"]["parameters"] == tp["memory_per_rank"]["parameters"]
    assert held["memory_per_rank"]["transient"] < tp["memory_per_rank"]["transient"]  # no expert gathered


# Qwen3.5-122B-A10B's text config as five public write-ups quote its config.json (a Megatron
# overlap study, an MLX expert-GEMM benchmark, a model table, two architecture notes; the file
# itself was not at hand): 48 layers (36 GatedDeltaNet + 12 attention), hidden 3072, 32 heads /
# 2 KV heads of 256, GatedDeltaNet 16 key / 64 value heads of 128, 256 experts top 8 of width
# 1024, a shared expert of 1024, vocab 248,320, untied. Built, it has 122.1 B parameters.
SHAPE_122B_A10B = dict(
    hidden_size=3072, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=2, head_dim=256,
    linear_num_key_heads=16, linear_num_value_heads=64, linear_key_head_dim=128, linear_value_head_dim=128,
    num_experts=256, num_experts_per_tok=8, moe_intermediate_size=1024, shared_expert_intermediate_size=1024,
    vocab_size=248320, tie_word_embeddings=False,
)


def test_plan_fits_131072_tokens_of_122b_a10b_per_row_on_4_nodes_of_8_h200(tmp_path):
    """The issue's goal: Qwen3.5-122B-A10B full fine-tuning (bf16 on fp32 masters, AdamW) at 131,072
    tokens per row on 4 nodes × 8 H200 (141 GB): cp 8 × dp_shard 4 with checkpointing, ep 8 (each
    rank 32 of the 256 experts per layer) and ep 32 (8 each) both fit; the plan adds up to the model."""
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig

    config = Qwen3_5MoeTextConfig(dtype="bfloat16", **SHAPE_122B_A10B)
    config.architectures = ["Qwen3_5MoeForCausalLM"]
    config.save_pretrained(tmp_path / "model")
    yaml = (CONFIGS / "fsdp2_cp2.yaml").read_text().replace("num_machines: 1", "num_machines: 4")
    yaml = yaml.replace("num_processes: 8", "num_processes: 32").replace("parallelism_config_cp_size: 2", "parallelism_config_cp_size: 8")
    yaml = yaml.replace("fsdp_activation_checkpointing: false", "fsdp_activation_checkpointing: true")
    (tmp_path / "4x8.yaml").write_text(yaml)
    for ep in (8, 32):
        p = cli("plan", "--model", str(tmp_path / "model"), "--config", str(tmp_path / "4x8.yaml"), "--seq-len", "131072",
                "--gpu-memory", "141GB", env={"QWEN35_ACCEL_EP": str(ep)})
        assert p["mesh"] == {"world": 32, "dp_replicate": 1, "dp_shard": 4, "cp": 8, "tp": 1}, p["mesh"]
        assert round(p["parameters"] / 1e9, 1) == 122.1 and p["sharded_bytes_all_ranks"] == p["model_bytes"]
        assert p["experts"] == {"per_layer": 256, "per_token": 8, "ep": ep, "efsdp": 32 // ep}
        assert p["fits"] and p["memory_per_rank"]["total"] <= 141e9, (ep, p["memory_per_rank"])
