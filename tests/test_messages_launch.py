"""What a launch prints for models and settings the plugin does not take over.

`accelerate launch --config_file accelerate_configs/cpu_fsdp2.yaml recipes/sft.py` with a
stray `QWEN35_ACCEL_*` name. (A Qwen3.5 MoE model there is the plugin's now: tests/test_moe_launch.py.)
"""

from __future__ import annotations


import pytest
from _launched import Run, register

from qwen35_accel.testing.launch import RECIPE, accelerate_launch_command, describe, run_launch
from test_trainer_launch import COMMON, PREPARED, losses, save_tiny_llama

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

TOKENIZER = str(RECIPE.parent / "configs" / "tokenizer")
STRAY = {"QWEN35_ACCEL_FOO": "1"}


# The successful launches run in the batched cpu_fsdp2.yaml launch (tests/_launched.py).
register(**{
    "messages/llama-stray": Run("cpu_fsdp2.yaml", RECIPE, (
        *COMMON, "--output_dir", "{out}", "--model_name_or_path", "{in}", "--tokenizer_name_or_path", TOKENIZER,
        "--per_device_train_batch_size", "2"), env=STRAY, setup=save_tiny_llama),
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
