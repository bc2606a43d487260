"""What a launch prints for models and settings the plugin does not take over.

`accelerate launch --config_file accelerate_configs/cpu_fsdp2.yaml recipes/sft.py` with a
stray `QWEN35_ACCEL_*` name, and with a Qwen3.5 MoE model.
"""

from __future__ import annotations


import pytest
import torch
from _launched import Run, register

from qwen35_accel.testing.launch import RECIPE, accelerate_launch_command, describe, run_launch
from test_trainer_launch import COMMON, PREPARED, losses, save_tiny_llama

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

TOKENIZER = str(RECIPE.parent / "configs" / "tokenizer")
STRAY = {"QWEN35_ACCEL_FOO": "1"}


def _tiny_moe(path) -> None:
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    torch.manual_seed(0)
    layers = 3
    Qwen3_5MoeForCausalLM(
        Qwen3_5MoeTextConfig(
            vocab_size=264, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
            moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
            layer_types=["full_attention" if (i + 1) % 3 == 0 else "linear_attention" for i in range(layers)],
            eos_token_id=256, pad_token_id=256,
        )
    ).save_pretrained(path)


# The successful launches run in the batched cpu_fsdp2.yaml launch (tests/_launched.py).
register(**{
    "messages/llama-stray": Run("cpu_fsdp2.yaml", RECIPE, (
        *COMMON, "--output_dir", "{out}", "--model_name_or_path", "{in}", "--tokenizer_name_or_path", TOKENIZER,
        "--per_device_train_batch_size", "2"), env=STRAY, setup=save_tiny_llama),
    # The fix the note names: fsdp_transformer_layer_cls_to_wrap in fsdp_config (FSDP_TRANSFORMER_CLS_TO_WRAP, what it sets).
    "messages/moe-fixed": Run("cpu_fsdp2.yaml", RECIPE, (
        *COMMON, "--output_dir", "{out}", "--model_name_or_path", "{in}", "--tokenizer_name_or_path", TOKENIZER,
        "--per_device_train_batch_size", "2"), env={"FSDP_TRANSFORMER_CLS_TO_WRAP": "Qwen3_5MoeDecoderLayer"}, setup=_tiny_moe),
})


@pytest.mark.launches("messages/llama-stray")
def test_an_unknown_setting_warns_in_a_llama_run_and_stops_a_qwen35_run(launched, tmp_path):
    llama = launched("messages/llama-stray")
    # Stock Accelerate's path for Llama, as without the stray name (it used to raise here).
    assert "unknown setting(s) ['QWEN35_ACCEL_FOO']" in llama.stderr and PREPARED not in llama.stderr
    history = losses(llama.out)
    assert len(history) == 4 and history[-1] < history[0]

    result = run_launch(
        accelerate_launch_command("cpu_fsdp2.yaml", RECIPE, *COMMON, "--output_dir", str(tmp_path / "qwen35_out")),
        env=STRAY,
    )
    assert result.returncode != 0 and PREPARED not in result.stderr, describe(result)
    assert "ValueError: unknown setting(s) ['QWEN35_ACCEL_FOO']" in result.stderr, describe(result)


@pytest.mark.launches("messages/moe-fixed")
def test_a_qwen35_moe_model_is_told_it_takes_accelerates_path_and_how_its_wrap_policy_is_fixed(launched, tmp_path):
    from qwen35_accel.integrations.preparation import accelerate_keeps_present_wrap_classes_only

    moe = tmp_path / "moe"
    _tiny_moe(moe)
    args = (*COMMON, "--model_name_or_path", str(moe), "--tokenizer_name_or_path", TOKENIZER,
            "--per_device_train_batch_size", "2")
    result = run_launch(accelerate_launch_command("cpu_fsdp2.yaml", RECIPE, *args, "--output_dir", str(tmp_path / "a")))
    notes = [line for line in result.stderr.splitlines() if "Qwen3_5MoeForCausalLM is a Qwen3.5 MoE model" in line]
    assert len(notes) == 1, describe(result)  # one line (global rank 0), before Accelerate's error if any
    assert "Accelerate's own FSDP2 path runs" in notes[0]
    if accelerate_keeps_present_wrap_classes_only():
        # Accelerate >= 1.16 wraps the decoder layers the model has: it trains, and the line predicts no failure.
        assert result.returncode == 0 and PREPARED not in result.stderr, describe(result)
        assert "fsdp_transformer_layer_cls_to_wrap" not in notes[0]
        history = losses(tmp_path / "a")
        assert len(history) == 4 and history[-1] < history[0]
    else:
        assert result.returncode != 0, describe(result)
        assert "add `fsdp_transformer_layer_cls_to_wrap: Qwen3_5MoeDecoderLayer` to fsdp_config" in notes[0]
        assert "Could not find the transformer layer class Qwen3_5MoeVisionBlock in the model." in result.stderr

    # The fix the line names works (stock Accelerate's FSDP2 on the MoE model), on every version.
    fixed = launched("messages/moe-fixed")
    assert "Qwen3.5 MoE model" in fixed.stderr and "fsdp_transformer_layer_cls_to_wrap" not in fixed.stderr
    history = losses(fixed.out)
    assert len(history) == 4 and history[-1] < history[0]


def test_the_moe_line_predicts_the_failure_of_a_configured_class_the_model_lacks(tmp_path):
    """Names given in fsdp_config are used as given by every Accelerate: a class the model lacks
    stops the wrap, and the line says which and what to write instead."""
    from accelerate.utils import FullyShardedDataParallelPlugin
    from transformers import AutoModelForCausalLM

    from qwen35_accel.integrations.preparation import _moe_note

    _tiny_moe(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                            transformer_cls_names_to_wrap=["Qwen3_5MoeDecoderLayer", "Qwen3_5MoeVisionBlock"])
    note = _moe_note(plugin, model)
    assert "its wrap policy looks for ['Qwen3_5MoeVisionBlock'], which this model lacks" in note
    assert note.endswith("add `fsdp_transformer_layer_cls_to_wrap: Qwen3_5MoeDecoderLayer` to fsdp_config")
    plugin.transformer_cls_names_to_wrap = ["Qwen3_5MoeDecoderLayer"]
    assert "lacks" not in _moe_note(plugin, model)
