"""What each Flower adapter buys, and the same code on each supported Flower, side by side in one run.

A variant is an interpreter (its venv holds one Flower release), a code tree (default: this one) and the
adapters turned off (tpflower.app.flower_guard.OFF_ENV). One sample of a variant, in its own process tree: the
simulation engine's empty round (``bench flower``'s empty-rounds case) and TP-Join-ADMM epoch, then on one
secure deployment (``simulations.deploy start``, as ``bench deploy``) the empty round with the CPU seconds per
round of each role, the TP-Join-ADMM epoch and the TP-Join-SGD epoch (batch 8192). Repeats are interleaved
(every variant once, then again), the 1-minute load recorded beside each sample, and medians reported.

    python -m simulations.bench adapters                 -> bench_results/adapters.json (each adapter off)
    python -m simulations.bench adapters --variant 1.42=.venv142/bin/python --variant 1.41=.venv/bin/python
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
METRICS = ("sim_empty_round_s", "sim_admm_epoch_s", "empty_round_s", "admm_epoch_s", "sgd_epoch_s", "cpu_s_per_round")


@dataclass(frozen=True)
class Variant:
    """An interpreter, a code tree and the adapters turned off."""

    name: str
    python: str = sys.executable
    root: str = str(ROOT)
    off: str = ""
    env: dict[str, str] = field(default_factory=dict)


def parse_variant(text: str) -> Variant:
    """``NAME=PYTHON[@ROOT][+OFF]``: e.g. ``1.42=.venv142/bin/python``, ``before=.venv/bin/python@/tmp/old``,
    ``no-held-pulls=.venv/bin/python+held-pulls``."""
    name, _, rest = text.partition("=")
    rest, _, off = rest.partition("+")
    python, _, root = rest.partition("@")
    return Variant(name, str(Path(python or sys.executable).absolute()), str(Path(root or ROOT).resolve()), off)


def sample(
    rounds: int, admm_epochs: int, sgd_epochs: int, sim_rounds: int, dataset: str, parts: str = "sim,deploy"
) -> dict[str, Any]:
    """One sample of the code tree this process imports (run as a file: an older tree has its own bench
    modules, whose helpers this uses): the simulation engine's part and the deployment's, as ``parts`` says
    (``sgd_epochs`` < 2: no deployed SGD run)."""
    import tempfile  # noqa: PLC0415
    from importlib.metadata import version  # noqa: PLC0415

    from simulations import deploy  # noqa: PLC0415
    from simulations.bench import deploy as bench_deploy  # noqa: PLC0415
    from simulations.bench.common import run_isolated  # noqa: PLC0415
    from simulations.bench.loj import run_algorithm  # noqa: PLC0415

    out: dict[str, Any] = {"flwr": version("flwr"), "load_avg_1min": os.getloadavg()[0]}
    if "sim" in parts:
        empty = {"rounds": sim_rounds, "dataset": dataset}
        out["sim_empty_round_s"] = run_isolated("simulations.bench.flower", "empty_rounds_case", empty)[
            "s_per_round_flower"
        ]
        admm = {"algorithm": "admm", "dataset": dataset, "epochs": admm_epochs, "runtime": "flower", "overrides": ()}
        out["sim_admm_epoch_s"] = run_algorithm(admm)["epoch_wall_s"]
    if "deploy" not in parts:
        return out
    overrides = f"algorithm=admm dataset={dataset}"
    with tempfile.TemporaryDirectory(prefix="tpflower-bench-") as tmp:
        root = Path(tmp)
        app = root / "empty"
        app.mkdir()
        (app / "pyproject.toml").write_text(bench_deploy.EMPTY_PYPROJECT.format(version=version("tpflower")))
        (app / "empty_rounds.py").write_text(bench_deploy.EMPTY_APP)
        dep = deploy.start(overrides, state_dir=root / "deploy", home=root / "home", cwd=root)
        try:
            bench_deploy.wait_for_warm_up(dep)
            result = root / "empty.json"
            config = (
                f"overrides={json.dumps(overrides)} rounds={rounds + 1} nodes={len(dep.processes) - 1} "
                f"out={json.dumps(str(result))} state-dir={json.dumps(str(root / 'deploy'))}"
            )
            cmd = ["flwr", "run", str(app), dep.connection, "--stream", "--run-config", config]
            bench_deploy._run(cmd, dep.env(), 1800)
            measured = json.loads(result.read_text())
            out["empty_round_s"] = statistics.median(measured["times"][1:])  # the first loads each node's table
            out["cpu_s_per_round"] = round(sum(measured["cpu_s_per_round"].values()), 4)
            out["cpu_by_role"] = {k: round(v, 4) for k, v in measured["cpu_s_per_round"].items()}
            for algorithm, epochs in (("admm", admm_epochs), ("sgd", sgd_epochs)):
                if epochs < 2:
                    continue
                run_dir = root / f"run-{algorithm}"
                job = " ".join(
                    [f"algorithm={algorithm} dataset={dataset} epochs={epochs}", *bench_deploy.EXTRA[algorithm]]
                )
                bench_deploy._run(deploy.flwr_run_command(dep.connection, job, run_dir), dep.env(), 1800)
                history = json.loads((run_dir / "results.json").read_text())["history"]
                out[f"{algorithm}_epoch_s"] = statistics.median(bench_deploy._epochs(history))
        finally:
            deploy.stop(dep)
    return out


def run_sample(v: Variant, args: dict[str, Any]) -> dict[str, Any]:
    """:func:`sample` in a fresh process of ``v``'s interpreter, code tree and adapters."""
    from tpflower.app.flower_guard import OFF_ENV  # noqa: PLC0415

    env = {**os.environ, "PYTHONPATH": v.root, OFF_ENV: v.off, **v.env}
    env["PATH"] = f"{Path(v.python).parent}{os.pathsep}{env.get('PATH', '')}"  # its venv's flwr CLI
    code = (
        "import json, runpy, sys; sys.path.insert(0, sys.argv[3]); "
        "s = runpy.run_path(sys.argv[1])['sample']; print(json.dumps(s(**json.loads(sys.argv[2]))))"
    )
    started = time.perf_counter()
    done = subprocess.run(
        [v.python, "-c", code, __file__, json.dumps(args), v.root], cwd=v.root, env=env, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise RuntimeError(f"variant {v.name} failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["sample_wall_s"] = round(time.perf_counter() - started, 1)
    return result


def side_by_side(variants: list[Variant], reps: int, args: dict[str, Any], out: Path | None = None) -> dict[str, Any]:
    """``reps`` interleaved samples of every variant, their medians and each variant's ratio to the first."""
    samples: dict[str, list[dict[str, Any]]] = {v.name: [] for v in variants}
    report: dict[str, Any] = {"case": "adapters", "args": args, "reps": reps}
    for rep in range(reps):
        for v in variants:
            s = run_sample(v, args)
            samples[v.name].append(s)
            print(json.dumps({"rep": rep, "variant": v.name, **s}), flush=True)
            report["variants"] = summary(variants, samples)
            if out is not None:  # what is done so far survives a stopped run
                out.write_text(json.dumps(report, indent=1) + "\n")
    return report


def summary(variants: list[Variant], samples: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    rows = []
    for v in variants:
        got = samples[v.name]
        medians = {m: statistics.median(s[m] for s in got) for m in METRICS if got and all(m in s for s in got)}
        rows.append(
            {
                "variant": v.name,
                "off": v.off,
                "code": "this tree" if v.root == str(ROOT) else v.root,
                "flwr": sorted({s["flwr"] for s in got}),
                "median": {m: round(x, 4) for m, x in medians.items()},
                "load_avg_1min": [round(s["load_avg_1min"], 2) for s in got],
                "samples": got,
            }
        )
    base = rows[0]["median"]
    for row in rows:
        row["over_first"] = {m: round(x / base[m], 3) for m, x in row["median"].items() if base.get(m)}
    return rows


def adapters_suite(
    variant_args: list[str], reps: int, epochs: int, out: Path | None, parts: str = "sim,deploy", sgd_epochs: int = 2
) -> dict[str, Any]:
    """The variants given, or this interpreter with all adapters on, then each off (one at a time). ``parts``:
    "sim" and/or "deploy" (the default: the deployment's for the variants given, else both); ``sgd_epochs``
    < 2: no deployed SGD run."""
    from tpflower.app.flower_guard import ADAPTERS  # noqa: PLC0415

    if variant_args:
        variants = [parse_variant(t) for t in variant_args]
    else:
        variants = [Variant("all on"), *(Variant(f"without {n}", off=n) for n in ADAPTERS)]
    args = {
        "rounds": 10,
        "admm_epochs": epochs,
        "sgd_epochs": sgd_epochs,
        "sim_rounds": 100,
        "dataset": "movielens",
        "parts": parts,
    }
    return side_by_side(variants, reps, args, out)
