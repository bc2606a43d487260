"""The fp32 gate holder: same model as Transformers, fp32 storage, HF checkpoints."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from qwen35_accel.model.fp32_gate import HOLDER_NAME, install_fp32_gate
from qwen35_accel.testing.tiny import build_tiny_causal_lm, build_tiny_vlm, random_batch

GATE_KEYS = ("A_log", "dt_bias")


def _gdn_layers(model):
    return [layer.linear_attn for layer in model.model.layers if layer.block_type == "linear_attention"]


def test_install_converts_every_gated_delta_net_once():
    model = build_tiny_causal_lm(num_hidden_layers=6)  # 4 GatedDeltaNet, 2 attention
    assert install_fp32_gate(model) == 4
    assert install_fp32_gate(model) == 0
    for gdn in _gdn_layers(model):
        assert "A_log" not in gdn._parameters and "dt_bias" not in gdn._parameters
        holder = getattr(gdn, HOLDER_NAME)
        assert {n for n, _ in holder.named_parameters()} == set(GATE_KEYS)
        assert gdn.A_log is holder.A_log  # attribute access still works


def test_parameter_objects_survive_the_surgery_upcast_in_place():
    # Optimizers (and Accelerate's bookkeeping) created before the surgery keep their parameters.
    model = build_tiny_causal_lm(dtype=torch.bfloat16)
    before = [(gdn.A_log, gdn.dt_bias) for gdn in _gdn_layers(model)]
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    install_fp32_gate(model)
    for (A_log, dt_bias), gdn in zip(before, _gdn_layers(model)):
        holder = getattr(gdn, HOLDER_NAME)
        assert holder.A_log is A_log and holder.dt_bias is dt_bias
        assert A_log.dtype == dt_bias.dtype == torch.float32
    model(**random_batch(1, 8, model.config.vocab_size, seed=0)).loss.backward()
    A_log = before[0][0]
    expected = A_log.detach() - A_log.grad
    optimizer.step()
    assert torch.equal(A_log.detach(), expected)


def test_parameter_names_are_the_transformers_names():
    reference = build_tiny_causal_lm()
    model = build_tiny_causal_lm()
    install_fp32_gate(model)
    names = [n for n, _ in model.named_parameters()]
    assert names == [n for n, _ in reference.named_parameters()] or sorted(names) == sorted(n for n, _ in reference.named_parameters())
    assert set(names) == set(model.state_dict())
    for name in names:  # each name resolves to the parameter it labels
        assert model.get_parameter(name) is dict(model.named_parameters())[name]
    assert all(HOLDER_NAME in n for n, _ in type(model).named_parameters(model) if n.endswith(GATE_KEYS))


def test_vlm_text_layers_are_converted():
    assert install_fp32_gate(build_tiny_vlm()) == 2


def test_fp32_forward_and_backward_are_bitwise_those_of_transformers():
    reference, model = build_tiny_causal_lm(seed=3), build_tiny_causal_lm(seed=3)
    install_fp32_gate(model)
    batch = random_batch(2, 40, reference.config.vocab_size, seed=1)
    ref_out, out = reference(**batch), model(**batch)
    assert torch.equal(out.logits, ref_out.logits)
    ref_out.loss.backward()
    out.loss.backward()
    ref = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, ref[name.replace(f".{HOLDER_NAME}.", ".")].grad), name


def test_cached_generation_is_that_of_transformers_and_counts_its_tokens():
    """Greedy decoding with Transformers' cache (prefill, then one token at a time through the
    conv state's single-token update): the same ids, and the cache counts the same tokens (from
    Transformers 5.25 the linear-attention layers count their own, which positions read)."""
    reference, model = build_tiny_causal_lm(seed=3), build_tiny_causal_lm(seed=3)
    install_fp32_gate(model)
    prompt = random_batch(2, 7, reference.config.vocab_size, seed=2)["input_ids"]
    settings = {"max_new_tokens": 6, "do_sample": False, "return_dict_in_generate": True, "pad_token_id": 0}
    with torch.no_grad():
        want, got = reference.generate(prompt, **settings), model.generate(prompt, **settings)
    assert torch.equal(got.sequences, want.sequences), (got.sequences, want.sequences)
    counts = [(out.past_key_values.get_seq_length(i) if i is not None else out.past_key_values.get_seq_length())
              for out in (got, want) for i in (None, 0)]
    assert counts[:2] == counts[2:] and counts[2] == 7 + 6 - 1, counts  # the last token is not fed back
    # A decoding loop of one's own: positions from the cache's count.
    step = got.sequences[:, -1:]
    with torch.no_grad():
        mine, theirs = (m(input_ids=step, cache=out.past_key_values).logits
                        for m, out in ((model, got), (reference, want)))
    assert torch.equal(mine, theirs)


def test_assisted_decoding_is_that_of_transformers_or_refused_as_transformers_refuses_it():
    """Prompt-lookup decoding, greedy: from Transformers 5.25 the linear-attention cache keeps the
    states after each candidate token to crop the rejected ones (the layer then runs those tokens
    one by one); the same ids as Transformers'. Transformers 5.24
    refuses it for Qwen3.5 (a stateful model): the same refusal."""
    reference, model = build_tiny_causal_lm(seed=3), build_tiny_causal_lm(seed=3)
    install_fp32_gate(model)
    kept = []
    layer = model.model.layers[0].linear_attn
    rule = layer._rule_keeping_states
    layer._rule_keeping_states = lambda *args: kept.append(args[6]) or rule(*args)  # (…, keep, final_state, documents, kwargs)
    prompt = random_batch(1, 7, reference.config.vocab_size, seed=2)["input_ids"].repeat(1, 2)  # lookups that hit
    settings = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
    outcomes = []
    for m in (reference, model):
        try:
            with torch.no_grad():
                outcomes.append(m.generate(prompt, prompt_lookup_num_tokens=3, **settings))
        except ValueError as refused:
            outcomes.append(str(refused))
    if isinstance(outcomes[0], str):
        assert outcomes[1] == outcomes[0] and "assisted generation is not supported" in outcomes[0], outcomes
        return
    assert torch.equal(outcomes[1], outcomes[0]), outcomes
    assert kept and max(kept) > 1, kept  # candidates ran through the state-keeping rule


def test_state_dict_has_transformers_keys_and_fp32_gate_in_bf16_model():
    reference = build_tiny_causal_lm(dtype=torch.bfloat16)
    model = build_tiny_causal_lm(dtype=torch.bfloat16)
    install_fp32_gate(model)
    sd = model.state_dict()
    assert set(sd) == set(reference.state_dict())
    assert not any(HOLDER_NAME in k for k in sd)
    for key, value in sd.items():
        if key.endswith(GATE_KEYS):
            assert value.dtype == torch.float32, key
            # bf16 values upcast exactly: nothing lost in the conversion
            assert torch.equal(value, reference.state_dict()[key].float()), key
        else:
            assert value.dtype == torch.bfloat16, key


def test_dtype_casts_keep_the_holder_fp32():
    model = build_tiny_causal_lm()
    install_fp32_gate(model)
    before = _gdn_layers(model)[0].A_log.detach().clone()
    for cast in (lambda m: m.to(torch.bfloat16), lambda m: m.half(), lambda m: m.to("cpu", torch.bfloat16)):
        cast(model)
        gdn = _gdn_layers(model)[0]
        assert gdn.A_log.dtype == gdn.dt_bias.dtype == torch.float32
        assert torch.equal(gdn.A_log, before)
        assert gdn.in_proj_qkv.weight.dtype != torch.float32



def test_a_gate_set_by_name_lands_in_the_holder_and_only_in_fp32():
    """Transformers' loader sets each loaded parameter with `setattr(module, "A_log", Parameter)`."""
    model = build_tiny_causal_lm()
    install_fp32_gate(model)
    gdn = _gdn_layers(model)[0]
    value = torch.nn.Parameter(torch.randn_like(gdn.A_log))
    gdn.A_log = value
    assert getattr(gdn, HOLDER_NAME).A_log is value and gdn.A_log is value and "A_log" not in gdn._parameters
    assert dict(model.named_parameters())["model.layers.0.linear_attn.A_log"] is value
    with pytest.raises(TypeError, match="dt_bias of a GatedDeltaNet with an fp32 gate holder must be fp32, got torch.bfloat16"):
        gdn.dt_bias = torch.nn.Parameter(gdn.dt_bias.detach().bfloat16())

def test_unmodified_checkpoint_loads_into_converted_model_and_back():
    source = build_tiny_causal_lm(seed=1)
    converted = build_tiny_causal_lm(seed=2)
    install_fp32_gate(converted)
    converted.load_state_dict(source.state_dict())  # strict
    assert torch.equal(_gdn_layers(converted)[1].A_log, _gdn_layers(source)[1].A_log)

    target = build_tiny_causal_lm(seed=4)
    target.load_state_dict(converted.state_dict())  # strict, into an unmodified model
    batch = random_batch(1, 16, source.config.vocab_size, seed=0)
    assert torch.equal(target(**batch).logits, source(**batch).logits)


def test_save_pretrained_writes_fp32_gate_under_transformers_names(tmp_path):
    model = build_tiny_causal_lm(dtype=torch.bfloat16)
    install_fp32_gate(model)
    model.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
        gate = [k for k in keys if k.endswith(GATE_KEYS)]
        assert len(gate) == 4 and not any(HOLDER_NAME in k for k in keys)
        assert {f.get_slice(k).get_dtype() for k in gate} == {"F32"}
        assert f.get_slice("model.layers.0.linear_attn.in_proj_qkv.weight").get_dtype() == "BF16"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert type(loaded).__name__ == "Qwen3_5ForCausalLM"
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value.float()), key


def test_subclass_with_own_forward_is_refused():
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    class Custom(hf.Qwen3_5GatedDeltaNet):
        pass

    model = build_tiny_causal_lm()
    gdn = _gdn_layers(model)[0]
    gdn.__class__ = Custom
    with pytest.raises(TypeError, match="Custom"):
        install_fp32_gate(model)
