"""`recipes/sft.py`, unchanged, with a fault injected on one rank (tests of failure handling).

    FAULT_RANK=1 FAULT_AT=step:2 accelerate launch … tests/scripts/sft_with_fault.py <recipe args>

FAULT_AT: `step:N` raises in a Trainer callback at the end of step N; `exit` raises after
training, saving and the Trainer's last collective. When the fault fires, the rank writes
`time.time()` to FAULT_STAMP (a file path), so a test can bound how long the launch took
to end after it. Every rank appends its pid to FAULT_PIDS.
"""

import importlib.util
import os
import sys
import time
from pathlib import Path

from transformers import Trainer, TrainerCallback

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "sft.py"
RANK = int(os.environ.get("RANK", "0"))
FAULTY = RANK == int(os.environ.get("FAULT_RANK", "1"))
FAULT_AT = os.environ.get("FAULT_AT", "step:2")


class InjectedFault(RuntimeError):
    pass


def fire(where: str) -> None:
    Path(os.environ["FAULT_STAMP"]).write_text(repr(time.time()))
    raise InjectedFault(f"injected fault on rank {RANK} at {where}")


class FaultAtStep(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            fire(f"step {self.step}")


class FaultyTrainer(Trainer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if FAULTY and FAULT_AT.startswith("step:"):
            self.add_callback(FaultAtStep(int(FAULT_AT.split(":")[1])))


def main() -> None:
    with open(os.environ["FAULT_PIDS"], "a") as pids:
        pids.write(f"{os.getpid()}\n")
    spec = importlib.util.spec_from_file_location("sft_recipe", RECIPE)
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    recipe.Trainer = FaultyTrainer  # the recipe builds its Trainer by this name
    recipe.main(sys.argv[1:])
    if FAULTY and FAULT_AT == "exit":
        fire("exit")


if __name__ == "__main__":
    main()
