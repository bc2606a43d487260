"""Every benchmark runs: `python benchmarks/X.py --smoke` (tiny shapes, one or two steps).

Each script runs from the repository root as `python benchmarks/X.py --smoke` runs it (its
`__main__`, its argv), the smokes one after the other in one interpreter, a batch of runs
without a launcher of their own (tests/_launched.py: the interpreter's start and imports are paid
once, not per script; a script that fails fails the smokes' tests, with its output); the two whose
picture is tested without matplotlib run as subprocesses of their own, with a hard timeout. A
smoke run writes no results file (benchmarks/results stays as it is) unless given
--results-dir, which some of the tests use to check the results header (date, versions, load),
that fsdp_step.py appends a run instead of overwriting, and that the scripts which draw write
their results first and lose only the picture without matplotlib (an optional dependency, made
absent in the script's process).
The full runs are not tests: they take minutes and their numbers are committed under
benchmarks/results.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import sys
from pathlib import Path

import pytest

from _launched import RUNS, Run, register
from qwen35_accel.local_world import START_METHOD_VAR
from qwen35_accel.testing.processes import ProcessTreeTimeout, run_process_tree

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
# The smokes start dozens of short worlds: forked from one server process that imported torch and Transformers
# once (START_METHOD_VAR), not spawned as fresh interpreters.
SMOKE_ENV = {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error", START_METHOD_VAR: "forkserver"}
# A guard against hangs, not a speed check: about 10x the slowest smoke on an idle 2-core machine
# (rl_cp_step.py, 38 s: five worlds of up to 4 ranks). At 180 s it failed once beside other CPU-heavy
# work (load average above 16 on 2 cores) and passed on every rerun, under load too: most likely the timeout.
TIMEOUT_S = 360

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]  # every script spawns local gloo worlds

# Runs the script (argv[1:]) as `python benchmarks/<script>` would, with matplotlib absent:
# a None entry in sys.modules makes `import matplotlib` raise ImportError.
WITHOUT_MATPLOTLIB = ("import runpy, sys; sys.modules['matplotlib'] = None; sys.argv = sys.argv[1:]; "
                      "sys.path[0] = 'benchmarks'; runpy.run_path(sys.argv[0], run_name='__main__')")
NO_PICTURE = 'no picture: matplotlib is not installed (pip install -e ".[benchmarks]" installs it)'


def _snapshot() -> dict[str, int]:
    """What a smoke run must not touch: benchmarks/results and a stray cuda_check.json in the root."""
    files = [p for p in RESULTS.iterdir() if p.is_file()] + [ROOT / "cuda_check.json"]
    return {str(p): p.stat().st_mtime_ns for p in files if p.exists()}


def _smoke(script: str, *extra: str, without_matplotlib: bool = False) -> str:
    """Run benchmarks/<script> --smoke; return its stdout (the test fails with the output's tail)."""
    env = dict(os.environ, **SMOKE_ENV)
    before = _snapshot()
    command = [sys.executable, *(["-c", WITHOUT_MATPLOTLIB] if without_matplotlib else []), f"benchmarks/{script}", "--smoke", *extra]
    try:  # the whole process tree (the script and the ranks it spawns) dies at the timeout
        proc = run_process_tree(command, timeout=TIMEOUT_S, env=env, cwd=ROOT)
    except ProcessTreeTimeout as error:
        pytest.fail(f"{script} --smoke: {error}")
    tail = f"--- stdout tail\n{proc.stdout[-3000:]}\n--- stderr tail\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, f"{script} --smoke exited {proc.returncode}\n{tail}"
    if "--results-dir" not in extra:
        assert _snapshot() == before, f"{script} --smoke wrote results files\n{tail}"
        assert "\nwrote " not in proc.stdout, tail
    return proc.stdout


BENCHMARKS = ROOT / "benchmarks"
_BEFORE = _snapshot()  # at collection: what no smoke run may have touched when its test reads it


def _earlier_fsdp_step_run(folder: Path) -> None:
    (folder / "fsdp_step.md").write_text("# Training step time\n\nan earlier run\n")


def _bench(script: str, *argv: str, **run: object) -> Run:
    return Run(None, BENCHMARKS / script, ("--smoke", *argv), env=SMOKE_ENV, stdout=True, batch="benchmarks", **run)


# The smokes run one after the other in one process of their own (a batch apart from the one-process
# reference runs of the other tests), in this order (`launched`).
register(**{
    "bench/gate_precision": _bench("gate_precision.py", "--seeds", "0", "1", "--results-dir", "{out}"),
    "bench/fsdp_step": _bench("fsdp_step.py", "--results-dir", "{in}", setup=_earlier_fsdp_step_run),
    "bench/tp_step": _bench("tp_step.py"),
    "bench/vocab_parallel_step": _bench("vocab_parallel_step.py"),
    "bench/cp_comm": _bench("cp_comm.py", "--results-dir", "{out}"),
    "bench/cp_step": _bench("cp_step.py"),
    "bench/cuda_check": _bench("cuda_check.py", "--device", "cpu"),
    "bench/launch_reliability": _bench("launch_reliability.py", "--configs", "cpu_fsdp2.yaml"),
    "bench/gpu_step": _bench("gpu_step.py"),
    "bench/gpu_step_budget_0": _bench("gpu_step.py", "--budget", "0"),
    "bench/loss_memory": _bench("loss_memory.py"),
    "bench/plan_table": _bench("plan_table.py"),
    "bench/vlm_placeholder_step": _bench("vlm_placeholder_step.py"),
    "bench/rl_cp_step": _bench("rl_cp_step.py", "--replica-layouts", "dp2,dp2xcp2"),
    "bench/offload_step": _bench("offload_step.py"),
    "bench/compile_step": _bench("compile_step.py"),
    "bench/moe_step": _bench("moe_step.py"),
    "bench/moe_gpu_step": _bench("moe_gpu_step.py"),
})


def _ran(launched, name: str) -> str:
    """The stdout of the smoke run `name` (batched; the test fails with the batch's output if it
    failed); a run without --results-dir wrote no results file."""
    stdout = launched(name).stdout
    if "--results-dir" not in RUNS[name].argv:
        assert _snapshot() == _BEFORE, f"{name} wrote results files\n{stdout[-3000:]}"
        assert "\nwrote " not in stdout, stdout[-3000:]
    return stdout


def _table_rows(stdout: str, header_start: str) -> list[list[str]]:
    """Cells of the markdown table whose header row starts with `header_start`."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def _bold_ratio(stdout: str, label: str) -> float:
    match = re.search(rf"\*\*{re.escape(label)}: ([0-9.]+)\*\*", stdout)
    assert match, f"no '{label}' in the output:\n{stdout[-3000:]}"
    return float(match.group(1))


def _assert_header(text: str) -> None:
    for field in ("- Command: `python benchmarks/", "- Date: ", "- Versions: torch ", "transformers ", "accelerate ",
                  "- Machine: ", "- Load average (1 / 5 / 15 min): before: ", "; after: "):
        assert field in text, f"results header lacks {field!r}:\n{text[:2000]}"


def _smoke_without_matplotlib(script: str, folder: Path, table_header: str) -> str:
    """A smoke run into `folder` with matplotlib absent: one line says how to get it, the
    results file holds the header and the table, no picture is drawn or linked."""
    stdout = _smoke(script, "--results-dir", str(folder), without_matplotlib=True)
    assert stdout.count(NO_PICTURE) == 1, stdout
    results = folder / script.replace(".py", ".md")
    written = results.read_text()
    _assert_header(written)
    assert table_header in written and ".png" not in written, written
    assert list(folder.iterdir()) == [results]
    return stdout


@pytest.mark.launches("bench/gate_precision")
def test_gate_precision_smoke(launched):
    stdout = _ran(launched, "bench/gate_precision")
    rows = _table_rows(stdout, "| seed | approach |")
    assert [r[0] for r in rows] == ["0", "0", "1", "1"], stdout
    for seed, approach, g, decay, out in rows:
        if approach.startswith("qwen35_accel"):
            assert float(g) == 0.0 and float(decay) == 0.0, stdout  # the fp32 gate unit is exact
        else:
            assert 0 < float(g) < 0.05, stdout  # bf16 A_log / dt_bias: off, but by a bf16 rounding
        assert math.isfinite(float(out)), stdout
    assert len(_table_rows(stdout, "| approach |")) == 2, stdout  # the spread over seeds
    written = (launched("bench/gate_precision").out / "gate_precision.md").read_text()
    _assert_header(written)
    assert "| seed | approach |" in written


@pytest.mark.launches("bench/fsdp_step")
def test_fsdp_step_smoke_appends_a_run(launched):
    stdout = _ran(launched, "bench/fsdp_step")
    rows = _table_rows(stdout, "| wrap |")
    assert [r[0] for r in rows] == ["qwen35_accel", "qwen35_accel (model holder unit)", "baseline", "baseline, same schedule"]
    for _, median_ms, to_baseline, to_same_schedule in rows:
        assert float(median_ms) > 0 and math.isfinite(float(to_baseline)) and math.isfinite(float(to_same_schedule)), stdout
    assert rows[2][2] == "1.000" and rows[3][3] == "1.000", stdout  # each baseline against itself
    written = (launched("bench/fsdp_step").inputs / "fsdp_step.md").read_text()
    assert written.startswith("# Training step time\n\nan earlier run\n\n## Run "), written[:500]
    _assert_header(written)


def _ratio_table(stdout: str) -> dict[str, float]:
    """tp_step / vocab_parallel_step: {row label: ratio}."""
    return {r[0]: float(r[3].split()[0]) for r in _table_rows(stdout, "| per rank |")}


@pytest.mark.launches("bench/tp_step")
def test_tp_step_smoke(launched):
    ratios = _ratio_table(_ran(launched, "bench/tp_step"))
    assert math.isfinite(ratios["step time, median"]) and ratios["step time, median"] > 0
    assert 0.3 < ratios["activation memory"] < 0.8  # each rank holds half the heads


@pytest.mark.launches("bench/vocab_parallel_step")
def test_vocab_parallel_step_smoke(launched):
    stdout = _ran(launched, "bench/vocab_parallel_step")
    ratios = _ratio_table(stdout)
    assert math.isfinite(ratios["step time, median"]) and ratios["step time, median"] > 0
    assert 0.3 < ratios["activation memory"] < 0.8, stdout
    relative = float(re.search(r"relative difference ([0-9.e+-]+)\)", stdout).group(1))
    assert relative < 1e-5, stdout  # fp32 rtol 1e-5: the same loss, its log-sum-exp reduced over vocab slices


@pytest.mark.launches("bench/cp_comm")
def test_cp_comm_smoke_writes_results_and_draws_where_matplotlib_is(launched):
    stdout, folder = _ran(launched, "bench/cp_comm"), launched("bench/cp_comm").out
    _assert_header((folder / "cp_comm.md").read_text())
    drawn = importlib.util.find_spec("matplotlib") is not None
    assert (folder / "cp_comm.png").exists() == drawn and (NO_PICTURE in stdout) != drawn, stdout
    measured = _table_rows(stdout, "| seq | ours fwd | ours bwd | all-gather fwd |")
    assert [r[0] for r in measured] == ["32", "64"] and all(r[5] == "yes" for r in measured), stdout
    assert "FORMULA MISMATCH" not in stdout
    computed = _table_rows(stdout, "| seq | ours fwd | ours bwd | ours fwd + bwd |")
    assert computed[0][0] == "1024" and computed[-1][0] == "131072", stdout
    assert all(math.isfinite(float(r[-1])) for r in computed), stdout
    # The state exchanges at cp 2 and 4: bytes sent and kept as their formulas, the same states.
    exchanges = _table_rows(stdout, "| shape | cp | exchange |")
    assert [(r[1], r[2]) for r in exchanges] == [("2", "allgather"), ("2", "scan"), ("4", "allgather"), ("4", "scan")], stdout
    # fp32 rtol 1e-5: the scan composes the same chunk maps in a tree, the all-gather in a row.
    assert all(r[8] == "yes" and float(r[9]) < 1e-5 for r in exchanges), stdout
    auto = {r[0]: (r[-2], r[-1]) for r in _table_rows(stdout, "| cp | all-gather fwd = bwd sent |")}
    assert auto == {"2": ("scan", "allgather"), "4": ("scan", "allgather"), "8": ("scan", "scan"),
                    "16": ("scan", "scan"), "32": ("scan", "scan")}, stdout


def test_cp_memory_smoke_without_matplotlib_writes_results_without_the_picture(tmp_path):
    stdout = _smoke_without_matplotlib("cp_memory.py", tmp_path, "| config | rank | local tokens |")
    ratio = _bold_ratio(stdout, "Activation memory per rank, cp 2 / cp 1 (worst rank)")
    assert 0.3 < ratio < 1.0, stdout
    losses = {float(r[-1]) for r in _table_rows(stdout, "| config | rank | local tokens |")}
    # fp32 rtol 1e-5 (cp 2 reduces over chunks in another order), plus the table's 6 decimals.
    assert len(losses) <= 2 and max(losses) - min(losses) <= 1e-5 * max(losses) + 1e-6, stdout


@pytest.mark.launches("bench/cp_step")
def test_cp_step_smoke(launched):
    stdout = _ran(launched, "bench/cp_step")
    ratio = _bold_ratio(stdout, "Step time per rank, cp 2 / cp 1 (medians)")
    assert math.isfinite(ratio) and ratio > 0, stdout
    rows = _table_rows(stdout, "| config | rank | median step (s) |")
    losses = [float(r[-1]) for r in rows if r[-1]]
    # cp 1 rank 0, cp 2 ranks 0 and 1: fp32 rtol 1e-5 (reduction order over cp), plus the table's 6 decimals.
    assert len(losses) == 3 and max(losses) - min(losses) <= 1e-5 * max(losses) + 1e-6, stdout


@pytest.mark.launches("bench/cuda_check")
def test_cuda_check_cpu_smoke(launched):
    stdout = _ran(launched, "bench/cuda_check")
    results = {}
    for line in stdout.splitlines():
        name, _, value = line.partition(" ")
        if name in ("ops", "attention_memory", "packing", "cp_kernels", "model_cp2", "fsdp2_cp2", "tp2", "cp2xtp2"):
            results[name] = json.loads(value)
    assert results["ops"]["fp32"]["output_rel_err"] < 1e-5, stdout  # fp32 rtol 1e-5: 8 folded chunk summaries vs one pass
    assert results["model_cp2"] == "ok", stdout  # with --smoke: the CP model, FSDP2 + CP and TP 2 checks
    assert results["attention_memory"] == {"skipped": "needs CUDA"}, stdout
    # fp32 rtol 1e-5: the packed row's documents against each alone (per-document kernels on CPU).
    assert results["packing"]["logits_rel_err"] < 1e-5 and results["packing"]["max_grad_rel_err"] < 1e-5, stdout
    assert results["packing"]["varlen_rule"] is False, stdout  # CPU tensors never take the CUDA kernels
    # On CPU the chosen kernels are the torch ones: the comparison runs and finds them equal.
    assert results["cp_kernels"]["conv_kernel"].endswith("torch_conv_kernel"), stdout
    assert results["cp_kernels"]["conv_packed_rel_err"] == 0.0 and results["cp_kernels"]["summary_U_rel_err"] == 0.0, stdout
    # bf16 q/k/v (the rounding alone, on CPU) differ from fp32 within bf16's resolution: the runs are independent.
    kernels = results["cp_kernels"]
    assert 0 < kernels["summary_bf16_inputs_M_rel_err"] < 0.05 and 0 < kernels["summary_bf16_inputs_max_grad_rel_err"] < 0.05, stdout
    report = json.loads(stdout[stdout.index("\n{") + 1:])  # the whole report, printed last
    # fp32 rtol 1e-5 (max |diff| / max |reference| below): reduction order over cp / tp ranks.
    assert report["model_check.json"]["fp32_seq64"]["loss_rel_err"] < 1e-5, stdout
    assert math.isfinite(report["fsdp_check.json"]["loss"]), stdout
    assert report["tp_check_world2.json"]["max_grad_rel_err"] < 1e-5, stdout


def test_packing_step_smoke_reports_both_layouts_and_exact_documents_also_without_matplotlib(tmp_path):
    stdout = _smoke_without_matplotlib("packing_step.py", tmp_path, "| layout |")
    rows = _table_rows(stdout, "| layout |")
    assert [r[0] for r in rows] == ["padded", "packed"], stdout
    assert all(float(r[1]) > 0 and float(r[2]) > 0 for r in rows), stdout
    parity = float(re.search(r"max \|packed - alone\| = ([0-9.e+-]+)", stdout).group(1))
    # fp32: each document of the packed row as if alone; logits below 1 here (0.65), so rtol 1e-5 as 1e-5 absolute.
    assert parity < 1e-5, stdout


@pytest.mark.launches("bench/launch_reliability")
def test_launch_reliability_smoke_counts_launches_that_exit_0(launched):
    stdout = _ran(launched, "bench/launch_reliability")
    rows = _table_rows(stdout, "| config |")
    assert rows == [["cpu_fsdp2.yaml", "1", "1", rows[0][3]]], stdout


@pytest.mark.launches("bench/gpu_step", "bench/gpu_step_budget_0")
def test_gpu_step_smoke_runs_the_three_configurations_on_the_same_model(launched):
    stdout = _ran(launched, "bench/gpu_step")
    rows = _table_rows(stdout, "| model | seq | config |")
    assert [r[2] for r in rows] == ["transformers", "ours cp 1", "ours cp 2"], stdout
    assert all(float(r[4]) > 0 and math.isfinite(float(r[4])) for r in rows), stdout
    losses = [float(r[-1]) for r in rows]  # fp32 on CPU: the same first-step loss (reduction order only)
    assert max(losses) - min(losses) <= 1e-5 * abs(losses[0]), stdout
    # A spent --budget starts no configuration and says so per row (a device session's fixed time).
    spent = _table_rows(_ran(launched, "bench/gpu_step_budget_0"), "| model | seq | config |")
    assert [(r[2], r[4]) for r in spent] == [(name, "skipped (--budget 0 s)") for name in ("transformers", "ours cp 1", "ours cp 2")]


@pytest.mark.launches("bench/loss_memory")
def test_loss_memory_smoke_reports_both_losses_equal(launched):
    out = _ran(launched, "bench/loss_memory")
    rows = {line for line in out.splitlines() if re.match(r"^\| 64 \| 256 \| [12] \| \d+×\d+ \| (hold|recompute) \|", line)}
    assert len(rows) == 4, out  # both modes at cp 1 and cp 2 (each printed as measured, then in the table)
    for row in rows:  # the tiled loss equals Transformers' (fp32: the same sums in tiles)
        assert float(row.strip("| ").split(" | ")[-1]) < 1e-5, row


@pytest.mark.launches("bench/plan_table")
def test_plan_table_smoke(launched):
    assert "| model | loss | cp 1 |" in _ran(launched, "bench/plan_table")


@pytest.mark.launches("bench/vlm_placeholder_step")
def test_vlm_placeholder_step_smoke(launched):
    assert "placeholder / none" in _ran(launched, "bench/vlm_placeholder_step")


@pytest.mark.launches("bench/rl_cp_step")
def test_rl_cp_step_smoke_reports_saved_bytes_step_and_generation_at_cp1_and_cp2(launched):
    stdout = _ran(launched, "bench/rl_cp_step")
    saved = _bold_ratio(stdout, "Saved bytes per rank, cp 2 / cp 1 (worst rank)")
    assert 0.3 < saved < 1.0, stdout  # each rank keeps its chunks' activations (tiny shapes: CP's fixed part weighs more)
    for label in ("Training step time (forward + backward), cp 2 / cp 1 (medians, slowest rank)",
                  "Generation of 4 new tokens x 3 rows, CP paused, every rank every row, FSDP2 gathering per forward, "
                  "cp 2 / cp 1 (medians, slowest rank)",
                  "Split (`QWEN35_ACCEL_RL_GENERATION=split`: per-row sampling, each cp rank 1-2 of the rows, units "
                  "gathered once), CPU time per rank, cp 2 / cp 1 per forward"):
        ratio = _bold_ratio(stdout, label)
        assert math.isfinite(ratio) and ratio > 0, stdout
    assert "Sampled tokens identical in every world: yes" in stdout, stdout
    assert "Per-row completions identical at cp 1 and cp 2: yes" in stdout, stdout
    layouts = _table_rows(stdout, "| layout | world | every row, per forward (s) |")
    assert [(r[0], r[1], r[-1]) for r in layouts] == [("dp2", "2", "yes"), ("dp2xcp2", "4", "yes")], stdout
    rows = _table_rows(stdout, "| config | rank | saved for backward: decoder (MiB) |")
    assert [(r[0], r[1]) for r in rows] == [("cp 1 (world 1)", "0"), ("cp 2 (world 2)", "0"), ("cp 2 (world 2)", "1")], stdout
    # cp 1 rank 0, cp 2 ranks 0 and 1: the same log-probs and gradient norm, fp32 rtol 1e-5 (reduction
    # order over cp), plus the table's printed decimals.
    for column, decimals in ((-2, 1e-4), (-1, 1e-6)):
        values = [float(r[column]) for r in rows]
        assert max(values) - min(values) <= 1e-5 * max(abs(v) for v in values) + decimals, stdout


@pytest.mark.launches("bench/offload_step")
def test_offload_step_smoke_reports_saved_bytes_and_step_time_with_and_without_offload(launched):
    stdout = _ran(launched, "bench/offload_step")
    saved = _bold_ratio(stdout, "Saved bytes on the device per rank (decoder), offload / no offload")
    assert 0 < saved < 0.8, stdout  # the layers' inputs left the device (tiny shapes: the embedding's part weighs more)
    step = _bold_ratio(stdout, "Step time, offload / no offload (medians, slowest rank)")
    assert math.isfinite(step) and step > 0, stdout
    rows = [r for r in _table_rows(stdout, "| seq | variant | rank |") if r[2] in ("0", "1")]
    assert [(r[1], r[2]) for r in rows] == [("checkpointing", "0"), ("checkpointing", "1"),
                                           ("checkpointing + offload", "0"), ("checkpointing + offload", "1")], stdout
    assert all(float(r[4]) > 0 and int(r[5]) == 3 for r in rows[2:]), stdout  # in host memory; 3 of 4 layers prefetched
    assert len({r[-1] for r in rows}) == 1, stdout  # the same loss to the printed decimals: offload copies exactly


@pytest.mark.launches("bench/compile_step")
def test_compile_step_smoke_reports_each_world_without_a_graph_break(launched):
    stdout = _ran(launched, "bench/compile_step")
    rows = _table_rows(stdout, "| world | compiled | eager (ms) | compiled (ms) |")
    assert [r[0] for r in rows] == ["one process", "FSDP2, 2 ranks", "CP 2, 2 ranks"], stdout
    assert [r[1] for r in rows] == [
        "the whole model",
        "norms, MLP, attention, GatedDeltaNet projections and gated output, GatedDeltaNet conv and gated delta rule (torch functions)",
        "norms, MLP, attention projections and output, GatedDeltaNet projections and gated output, GatedDeltaNet chunk "
        "summaries and reads (torch functions)",
    ], stdout
    assert [r[-1] for r in rows] == ["0", "0", "0"], stdout  # graph breaks in a compiled step


@pytest.mark.launches("bench/moe_step")
def test_moe_step_smoke(launched):
    """ep 2 against dp 2: the all-to-alls move what the routing implies, no more; each rank computes
    with half the experts and holds the same shards (FSDP2 shards dp's experts too)."""
    rows = {r[0]: r for r in _table_rows(_ran(launched, "bench/moe_step"), "| per rank |")}
    counted = rows["all-to-all bytes per layer and step, as the routing implies (2 × (pairs sent + pairs received) × hidden × 4 B)"]
    assert abs(float(counted[3].split()[0]) - 1.0) < 2e-3, counted
    assert float(rows["expert weights of a layer while it computes"][3]) == 0.5
    assert float(rows["parameters + gradients + AdamW state held"][3]) == 1.0
    assert float(rows["step time, median"][3].split()[0]) > 0


@pytest.mark.launches("bench/moe_gpu_step")
def test_moe_gpu_step_smoke_runs_ep1_and_ep2_on_the_same_model(launched):
    """The GPU MoE entry's CPU smoke (2 gloo ranks, tiny fp32 MoE): ep 1 and ep 2 both run and their
    first losses agree (the same weights and batch), with plan's prediction beside each."""
    rows = {r[0]: r for r in _table_rows(_ran(launched, "bench/moe_gpu_step"), "| config |")}
    assert set(rows) == {"ep 1", "ep 2"}, rows
    assert math.isclose(float(rows["ep 1"][5]), float(rows["ep 2"][5]), rel_tol=1e-5), rows
    assert all(float(r[4]) > 0 and float(r[1].replace(",", "")) > 0 for r in rows.values()), rows
