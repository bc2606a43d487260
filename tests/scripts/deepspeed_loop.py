"""An Accelerate training loop as a user writes it (the Trainer's bf16 run under DeepSpeed is the recipe's, in
tests/test_deepspeed.py; this loop records what each training forward read), for DeepSpeed runs in bf16: the model loaded
in bf16 from MODEL_DIR, 4 SGD steps of 4 rows (the global batch, split over the processes), the
state dict `Accelerator.get_state_dict` gives saved with `save_pretrained` in OUTPUT_DIR, and on rank 0
`run.pt`: the losses, DeepSpeed's gradient norms, and every `A_log`/`dt_bias` value and dtype each
training forward read (a forward hook on each GatedDeltaNet: a test's instrument, not a user's). Then a
second copy of the checkpoint goes through TRL's `prepare_deepspeed` as `DPOTrainer` calls it for its
reference model (an inference engine of DeepSpeed's), and `run.pt` records what its first forward read.

    accelerate launch --config_file … tests/scripts/deepspeed_loop.py MODEL_DIR OUTPUT_DIR
"""

import sys

import torch
import trl.trainer.dpo_trainer as dpo_trainer  # before the Accelerator: the plugin patches TRL's modules imported by then
from accelerate import Accelerator
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM

GLOBAL_BATCH, LENGTH, STEPS = 4, 24, 4


def main(model_dir: str, out: str) -> None:
    accelerator = Accelerator()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1, model.config.vocab_size, (GLOBAL_BATCH * STEPS, LENGTH), generator=generator)
    rows = [{"input_ids": row, "labels": row.clone()} for row in ids]
    loader = DataLoader(rows, batch_size=GLOBAL_BATCH // accelerator.num_processes)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.3)
    seen: list[dict[str, tuple[str, torch.Tensor]]] = []

    def record(module, args, output):  # where the gates live once prepared: the module's `_fp32_params`, or its own
        holder = module.__dict__.get("_fp32_params") or module._modules.get("_fp32_params") or module
        seen.append({name: (str(getattr(holder, name).dtype), getattr(holder, name).detach().float().clone())
                     for name in ("A_log", "dt_bias")})

    def first_gated(net):
        return next(m for m in net.modules() if type(m).__name__.endswith("GatedDeltaNet"))

    first_gated(model).register_forward_hook(record)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses, norms = [], []
    for batch in loader:
        loss = model(**batch).loss
        accelerator.backward(loss)
        norms.append(float(model.get_global_grad_norm()))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    state_dict = accelerator.get_state_dict(model)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    first_gated(reference).register_forward_hook(record)
    engine = dpo_trainer.prepare_deepspeed(reference, accelerator)
    with torch.no_grad():
        engine(**next(iter(loader)))
    if accelerator.is_main_process:
        accelerator.unwrap_model(model).save_pretrained(out, state_dict=state_dict)
        torch.save({"losses": losses, "norms": norms, "seen": seen[:-1], "reference": seen[-1]}, f"{out}/run.pt")
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main(*sys.argv[1:3])
