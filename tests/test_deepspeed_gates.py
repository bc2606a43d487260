"""The gates kept outside DeepSpeed's engine (`integrations/deepspeed/gates.py`), in one process and
without DeepSpeed: hidden holders leave the forward, the state dict and its loading as they were, and the
optimizer surgery gives the gates an fp32 optimizer of the user's class and group hyperparameters.
The launches under DeepSpeed: tests/test_deepspeed.py."""

from __future__ import annotations

import pytest
import torch

from qwen35_accel import install_fp32_gate
from qwen35_accel.integrations.deepspeed.gates import hide_holders, take_gates_out
from qwen35_accel.testing.tiny import build_tiny_causal_lm, random_batch

GATES = ("A_log", "dt_bias")


def _trainer_groups(model: torch.nn.Module) -> list[dict]:
    """The Trainer's two groups: weight decay for all but biases and norms (A_log decays, dt_bias does not)."""
    decay = [p for n, p in model.named_parameters() if not n.endswith("bias") and "norm" not in n]
    rest = [p for n, p in model.named_parameters() if n.endswith("bias") or "norm" in n]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


def test_hidden_holders_keep_the_forward_and_the_state_dict_and_leave_parameters():
    model = build_tiny_causal_lm(seed=0)
    install_fp32_gate(model)
    batch = random_batch(2, 12, model.config.vocab_size, seed=1)
    before_loss, before_state = model(**batch).loss, {k: v.clone() for k, v in model.state_dict().items()}
    holders = hide_holders(model)
    assert len(holders) == 2 and not any(name.endswith(GATES) for name, _ in model.named_parameters())
    assert torch.equal(model(**batch).loss, before_loss)
    after_state = model.state_dict()
    assert set(after_state) == set(before_state)
    for key, value in before_state.items():
        assert torch.equal(after_state[key], value) and after_state[key].dtype == value.dtype, key
    changed = {k: (v + 1 if k.endswith(GATES) else v) for k, v in before_state.items()}
    model.load_state_dict(changed, strict=True)
    assert all(torch.equal(h.A_log, before_state[k] + 1) for h, k in zip(holders, sorted(k for k in changed if k.endswith("A_log"))))


def test_the_gates_leave_the_users_optimizer_for_an_fp32_one_of_its_class_and_groups():
    model = build_tiny_causal_lm(seed=0)
    optimizer = torch.optim.AdamW(_trainer_groups(model), lr=3e-4, betas=(0.8, 0.9), eps=1e-7)
    originals = {n: p for n, p in model.named_parameters() if n.endswith(GATES)}
    install_fp32_gate(model)
    gates = take_gates_out(hide_holders(model), optimizer, None)
    left = {id(p) for g in optimizer.param_groups for p in g["params"]}
    assert not any(id(p) in left for p in originals.values())
    assert len(left) == sum(1 for _ in model.parameters())  # every other parameter stays
    assert type(gates.optimizer) is torch.optim.AdamW and gates.follows == [0, 1]
    decayed, kept = gates.optimizer.param_groups
    assert {id(p) for p in decayed["params"]} == {id(p) for n, p in originals.items() if n.endswith("A_log")}
    assert {id(p) for p in kept["params"]} == {id(p) for n, p in originals.items() if n.endswith("dt_bias")}
    assert (decayed["weight_decay"], kept["weight_decay"]) == (0.1, 0.0)
    assert all(g["lr"] == 3e-4 and g["betas"] == (0.8, 0.9) and g["eps"] == 1e-7 for g in (decayed, kept))
    assert all(p.dtype == torch.float32 for p in gates.params)


def _bitsandbytes(name: str, bits: int) -> type:
    """A torch optimizer class named and placed as bitsandbytes' `name` with `optim_bits` (bitsandbytes is not
    installed here; Accelerate tells its classes by module, name and bits, and so does the plugin)."""
    return type(name, (torch.optim.Optimizer,), {
        "__module__": "bitsandbytes.optim.adamw", "optim_bits": bits,
        "__init__": lambda self, params, lr: torch.optim.Optimizer.__init__(self, params, {"lr": lr, "weight_decay": 0.0}),
    })


@pytest.mark.parametrize("make,expected", [
    (lambda groups: torch.optim.SGD(groups, lr=0.3, momentum=0.9), torch.optim.Adam),
    (lambda groups: torch.optim.AdamW(groups, lr=3e-4, betas=(0.9, 0.95)), torch.optim.AdamW),
    (lambda groups: torch.optim.Adagrad(groups, lr=1e-2), torch.optim.Adagrad),
    (lambda groups: _bitsandbytes("AdamW", 32)(groups, lr=1e-3), torch.optim.AdamW),
    (lambda groups: _bitsandbytes("AdamW", 8)(groups, lr=1e-3), torch.optim.Adam),
], ids=["sgd", "adamw", "adagrad", "bnb-adamw-32bit", "bnb-adamw-8bit"])
def test_under_zero_offload_the_gates_take_the_steps_accelerate_gives_the_others(make, expected):
    """ZeRO-Offload with zero_force_ds_cpu_optimizer (its default): Accelerate rebuilds the script's torch optimizer
    as DeepSpeedCPUAdam (AdamW mode for AdamW, Adam mode for any other class but Adagrad: DeepSpeedCPUAdagrad)
    from its groups; the gates' fp32 optimizer is that step in torch, with the same groups' hyperparameters."""
    from qwen35_accel.integrations.accelerate.deepspeed_preparation import offload_class, replaces_optimizer_under_offload

    model = build_tiny_causal_lm(seed=0)
    optimizer = make(_trainer_groups(model))
    offload = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    assert replaces_optimizer_under_offload(offload, optimizer)
    assert not replaces_optimizer_under_offload({**offload, "zero_force_ds_cpu_optimizer": False}, optimizer)
    assert not replaces_optimizer_under_offload({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "none"}}}, optimizer)
    install_fp32_gate(model)
    gates = take_gates_out(hide_holders(model), optimizer, None, step_class=offload_class(optimizer))
    assert offload_class(optimizer) is expected and type(gates.optimizer) is expected
    decayed, kept = gates.optimizer.param_groups
    assert (decayed["weight_decay"], kept["weight_decay"]) == (0.1, 0.0)
    assert decayed["lr"] == optimizer.defaults["lr"]
    if expected is not torch.optim.Adagrad:
        assert decayed["betas"] == optimizer.defaults.get("betas", (0.9, 0.999))  # DeepSpeedCPUAdam's default
    unchanged = build_tiny_causal_lm(seed=0)
    plain = make(_trainer_groups(unchanged))
    install_fp32_gate(unchanged)
    assert type(take_gates_out(hide_holders(unchanged), plain, None).optimizer) is type(plain)  # without offload


def test_an_optimizer_of_the_deepspeed_config_is_mirrored_or_refused_naming_it():
    from accelerate.utils.deepspeed import DummyOptim

    model = build_tiny_causal_lm(seed=0)
    install_fp32_gate(model)
    holders = hide_holders(model)
    gate_ids = {id(p) for h in holders for p in h.parameters()}
    dummy = DummyOptim(list(model.parameters()) + [p for h in holders for p in h.parameters()], lr=1e-3)
    gates = take_gates_out(holders, dummy, {"type": "AdamW", "params": {"lr": 2e-3, "weight_decay": 0.01}})
    assert not any(id(p) in gate_ids for p in dummy.params)
    assert type(gates.optimizer) is torch.optim.AdamW and gates.optimizer.param_groups[0]["lr"] == 2e-3
    with pytest.raises(NotImplementedError, match=r"the DeepSpeed config's optimizer 'lamb'.*mirrors \['adam', 'adamw', 'sgd'\]"):
        take_gates_out(holders, DummyOptim([p for h in holders for p in h.parameters()]), {"type": "Lamb"})


def test_the_gates_checkpoint_state_round_trips_and_refuses_another_models():
    """What a DeepSpeed checkpoint keeps of the gates (`gates_state`): their fp32 values and AdamW state; loaded
    into another instance it gives the same next step; a model of another shape is refused with the counts."""
    from qwen35_accel.integrations.deepspeed.gates import gates_state, load_gates_state

    def gates_after(steps: range, saved: dict | None = None):  # only the gates step; the batches by step number
        model = build_tiny_causal_lm(seed=0)
        install_fp32_gate(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        gates = take_gates_out(hide_holders(model), optimizer, None)
        if saved is not None:
            load_gates_state(gates, saved)
        for step in steps:
            model(**random_batch(2, 12, model.config.vocab_size, seed=step)).loss.backward()
            gates.reduce()
            gates.optimizer.step()
            gates.optimizer.zero_grad(set_to_none=True)
        return gates

    saved = gates_state(gates_after(range(2)))
    assert all(v.dtype == torch.float32 for v in saved["values"]) and saved["optimizer"]["state"]
    continued, uninterrupted = gates_after(range(2, 3), saved), gates_after(range(3))
    fresh = gates_after(range(2, 3), {"values": saved["values"], "optimizer": None})
    for a, b, c in zip(continued.params, uninterrupted.params, fresh.params):
        assert torch.equal(a, b) and not torch.equal(c, b)
    other = build_tiny_causal_lm(seed=0, num_hidden_layers=8)
    install_fp32_gate(other)
    optimizer = torch.optim.AdamW(other.parameters())
    other_gates = take_gates_out(hide_holders(other), optimizer, None)
    with pytest.raises(ValueError, match=r"\(4 tensors, .* this model's \(\d+ tensors"):
        load_gates_state(other_gates, saved)


def test_an_optimizer_built_after_the_gates_left_the_tree_is_refused_naming_why():
    """Gates hidden before the optimizer was built (a DeepSpeed engine made of the model earlier) are not
    in it: refused at the surgery with the cause, rather than training every weight but the gates."""
    model = build_tiny_causal_lm(seed=0)
    install_fp32_gate(model)
    holders = hide_holders(model)
    with pytest.raises(ValueError, match="holds none of the GatedDeltaNet gates.*precompute_ref_log_probs under ZeRO-3"):
        take_gates_out(holders, torch.optim.AdamW(model.parameters()), None)


def test_hiding_twice_finds_the_same_holders_and_showing_puts_them_back():
    """`hide_holders` again (a model TRL's DeepSpeed engine hid before) returns the hidden holders; `show_holders`
    (after TRL's stage-0 engine) returns them to the module tree, parameter names as before."""
    from qwen35_accel.integrations.deepspeed.gates import show_holders

    model = build_tiny_causal_lm(seed=0)
    install_fp32_gate(model)
    names = [name for name, _ in model.named_parameters()]
    holders = hide_holders(model)
    assert hide_holders(model) == holders and len(holders) == 2
    assert show_holders(model) == 2 and [name for name, _ in model.named_parameters()] == names
