"""Run several launchers at once, as if on several machines; end them all if one fails.

    python tests/scripts/two_machines.py '[["accelerate", "launch", ...], [...]]'

Each command's stdout and stderr are printed after all have ended (prefixed by its index),
on this process's stdout and stderr. Exit code: 0 if every command exited 0, else the
first non-zero one. A launcher whose peer machine failed would wait for it at the
rendezvous or in a collective until gloo's timeout, so the others are terminated (then
killed) at once. The caller bounds the whole run (`run_process_tree`, which kills every
process of it, launchers and ranks, on timeout).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time


def main(commands: list[list[str]]) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        outs = [open(f"{tmp}/{i}.out", "w+") for i in range(len(commands))]
        errs = [open(f"{tmp}/{i}.err", "w+") for i in range(len(commands))]
        processes = [subprocess.Popen(c, stdout=o, stderr=e) for c, o, e in zip(commands, outs, errs)]
        failed = 0
        while [p.poll() for p in processes].count(None):  # poll every one (any() would stop at the first)
            codes = [p.returncode for p in processes if p.returncode not in (None, 0)]
            if codes and not failed:
                failed = codes[0]
                for p in processes:
                    if p.poll() is None:
                        p.terminate()  # torch elastic's agent ends its ranks on SIGTERM
                deadline = time.monotonic() + 15.0
                while [p.poll() for p in processes].count(None) and time.monotonic() < deadline:
                    time.sleep(0.1)
                for p in processes:
                    if p.poll() is None:
                        p.kill()
            time.sleep(0.1)
        for i, (o, e) in enumerate(zip(outs, errs)):
            o.seek(0)
            e.seek(0)
            sys.stdout.write("".join(f"[machine {i}] {line}" for line in o))
            sys.stderr.write("".join(f"[machine {i}] {line}" for line in e))
        return failed or next((p.returncode for p in processes if p.returncode), 0)


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
