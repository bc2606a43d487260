"""Transformers' own sharding at load, as a user writes it under torchrun:
`from_pretrained(PATH, dtype=DTYPE, distributed_config=DistributedConfig(fsdp_size=WORLD, ...))`,
then one forward and backward. Prints the gates' dtype on rank 0.

    python -m torch.distributed.run --nproc_per_node 2 tests/scripts/distributed_config_load.py PATH DTYPE [--mixed_precision]
"""

import os
import sys

import torch
from transformers import AutoModelForCausalLM
from transformers.distributed import DistributedConfig

import qwen35_accel  # noqa: F401  (the plugin activates at `import torch` anyway; imported for clarity)


def main(path: str, dtype: str, mixed_precision: bool) -> None:
    world = int(os.environ["WORLD_SIZE"])
    config = DistributedConfig(fsdp_size=world, fsdp_mixed_precision=mixed_precision)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), distributed_config=config)
    ids = torch.randint(1, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    gates = {p.dtype for n, p in model.named_parameters() if n.endswith((".A_log", ".dt_bias"))}
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"gates {sorted(map(str, gates))}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], "--mixed_precision" in sys.argv[3:])
