"""Shared helpers of the benchmark suites: peak RSS, the subprocess runner, a process-tree memory monitor.

The suites' own processes stay light: torch, flwr and ray are imported by the cases, each in its own subprocess
(run_isolated), never at the top of a suite module or by the command line. Importing torch in the parent changes
what the children measure (a mapping case's peak RSS grew from 172 to 219 MB with torch loaded in its parent).
"""

from __future__ import annotations

import json
import os
import platform
import resource
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

#: the join-key secret of the benchmarks' synthetic tables
SECRET = b"bench-secret"
REPO_ROOT = str(Path(__file__).resolve().parents[2])  # the checkout the benches run from

#: benches that compare optimisation (rounds to a target, DP costs, convergence) train on the whole training split
#: and report the last model, as they were measured before model selection (its own suite: selection)
WHOLE_TRAINING = "validation_fraction=0"

#: the algorithms whose runs a small training join lengthens (algorithm.min_steps, docs/algorithms.md#small-training-joins)
MIN_STEPS_ALGORITHMS = ("sgd", "vfl_sgd", "celu", "vfl_celu")


def fixed_epochs(*overrides: str) -> tuple[str, ...]:
    """``overrides``, and for an algorithm of :data:`MIN_STEPS_ALGORITHMS` ``algorithm.min_steps=0``: a bench
    trains the epochs it names (its published rows were measured so), not more on a small join."""
    chosen = [o.split("=", 1)[1] for o in overrides if o.startswith("algorithm=")]
    pinned = bool(chosen) and chosen[-1] in MIN_STEPS_ALGORITHMS and not any("min_steps" in o for o in overrides)
    return (*overrides, "algorithm.min_steps=0") if pinned else overrides


def peak_rss_mb() -> float:
    """This process's peak resident set size in MB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux reports KiB


def ints(text: str) -> list[int]:
    """A comma-separated list of integers ("" -> none); 1e6-style and 10_000_000 spellings accepted."""
    return [int(float(x)) for x in text.replace("_", "").split(",") if x.strip()]


def machine_info() -> dict[str, Any]:
    """The machine a suite ran on (written into its JSON)."""
    return {"cpus": os.cpu_count(), "python": platform.python_version()}


def code_commit(root: str = REPO_ROOT) -> str:
    """The checkout's commit (short), with "+changes" when its tracked files differ from it."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "-uno"], cwd=root, capture_output=True, text=True)
    return head.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


def run_isolated(module: str, call: str, args: dict[str, Any], echo_stderr: bool = False) -> Any:
    """``module.<call>(**args)`` in a fresh Python process (its peak RSS its own): the JSON result it prints
    last. ``call`` is a function name or an item of one (``CASES['loj']``); ``echo_stderr`` passes the case's
    progress lines on."""
    code = f"import json,sys; import {module} as m; print(json.dumps(m.{call}(**json.loads(sys.argv[1]))))"
    out = subprocess.run([sys.executable, "-c", code, json.dumps(args)], capture_output=True, text=True)
    if echo_stderr:
        sys.stderr.write(out.stderr[-20000:])
    if out.returncode != 0:
        raise RuntimeError(f"benchmark case {call} {args} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


#: the memory monitor's sampling period (s): every bench measures a run's peak the same way
SAMPLE_S = 0.25


class TreeMonitor:
    """Samples the memory of a process and all its descendants (from /proc) every ``interval`` seconds: the
    peaks of the root's RSS, of the tree's summed RSS and of its summed PSS (shared pages split between the
    processes that map them: Ray's processes and its object store included, shared pages counted once), and each
    process's PSS at the tree's PSS peak (:meth:`at_peak`). With ``limit_mb``, a tree whose PSS passes it is
    killed (``killed_at_mb``), before it takes the machine's memory from everything else."""

    def __init__(self, pid: int, interval: float = SAMPLE_S, limit_mb: float | None = None):
        self.pid, self.interval, self.limit_mb = pid, interval, limit_mb
        self.killed_at_mb: float | None = None  # the tree's PSS when it passed ``limit_mb`` and was killed
        self.peak = {"root_rss_mb": 0.0, "tree_rss_mb": 0.0, "tree_pss_mb": 0.0, "processes": 0}
        self.samples: list[tuple[float, float, float]] = []  # (t, root RSS, tree PSS) in MB
        self.by_process: dict[int, dict[str, Any]] = {}  # pid -> {"name", "peak_pss_mb", "at_s"}
        self.peak_share: list[tuple[int, float]] = []  # (pid, PSS MB) of every process at the tree's PSS peak
        self.peak_s = 0.0  # when the tree's PSS peaked (s from start)
        self._stop = threading.Event()
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def _children() -> dict[int, list[int]]:
        kids: dict[int, list[int]] = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
            kids.setdefault(ppid, []).append(int(entry.name))
        return kids

    @staticmethod
    def _memory_kb(pid: int) -> tuple[int, int]:
        rss = pss = 0
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Rss:"):
                    rss = int(line.split()[1])
                elif line.startswith("Pss:"):
                    pss = int(line.split()[1])
        except OSError:
            pass
        return rss, pss

    @staticmethod
    def _name(pid: int) -> str:
        """A process's name as Ray sets it (``ray::ClientAppActor...``, ``raylet``) or its command line's start."""
        try:
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            return "?"
        script = next((Path(a).name for a in argv[1:] if a.endswith(".py")), " ".join(argv[1:4]))
        return f"{comm}: {script}"[:80]

    def processes(self, min_mb: float = 50.0) -> list[dict[str, Any]]:
        """Every process of the tree whose PSS peaked above ``min_mb``: name, peak PSS and when (s from start),
        and its PSS over time (``pss``: (s, MB), at most about 100 samples)."""
        rows = [
            {**e, "pss": e["pss"][:: max(1, len(e["pss"]) // 100)]}
            for e in self.by_process.values()
            if e["peak_pss_mb"] >= min_mb
        ]
        return sorted(rows, key=lambda e: -e["peak_pss_mb"])

    def at_peak(self, min_mb: float = 20.0) -> dict[str, Any]:
        """The tree's PSS peak split by process: when (s from start) and each process's share (name, PSS MB)
        above ``min_mb``, largest first; the rest summed as "others"."""
        rows = sorted(self.peak_share, key=lambda e: -e[1])
        big = [
            {"pid": pid, "name": self.by_process[pid]["name"], "pss_mb": round(mb, 1)}
            for pid, mb in rows
            if mb >= min_mb
        ]
        rest = sum(mb for _, mb in rows if mb < min_mb)
        return {
            "at_s": self.peak_s,
            "tree_pss_mb": round(sum(mb for _, mb in rows), 1),
            "processes": big,
            "others_mb": round(rest, 1),
        }

    def tree(self) -> list[int]:
        kids, out, todo = self._children(), [], [self.pid]
        while todo:
            p = todo.pop()
            out.append(p)
            todo += kids.get(p, [])
        return out

    def sample(self) -> None:
        pids = self.tree()
        mem = [self._memory_kb(p) for p in pids]
        root_rss = mem[0][0] / 1024
        tree_rss, tree_pss = sum(m[0] for m in mem) / 1024, sum(m[1] for m in mem) / 1024
        pk = self.peak
        pk["root_rss_mb"] = max(pk["root_rss_mb"], root_rss)
        pk["tree_rss_mb"] = max(pk["tree_rss_mb"], tree_rss)
        now = round(time.perf_counter() - self._t0, 2)
        if tree_pss > pk["tree_pss_mb"]:
            pk["tree_pss_mb"], self.peak_s = tree_pss, now
            self.peak_share = [(pid, pss / 1024) for pid, (_, pss) in zip(pids, mem)]
        pk["processes"] = max(pk["processes"], len(pids))
        for pid, (_, pss) in zip(pids, mem):
            entry = self.by_process.get(pid)
            if entry is None:
                entry = self.by_process[pid] = {"name": self._name(pid), "peak_pss_mb": 0.0, "at_s": now, "pss": []}
            entry["pss"].append((now, round(pss / 1024)))
            if pss / 1024 > entry["peak_pss_mb"]:
                entry["peak_pss_mb"], entry["at_s"] = round(pss / 1024, 1), now
        self.samples.append((now, round(root_rss), round(tree_pss)))

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            if self.limit_mb is not None and self.killed_at_mb is None and self.samples[-1][2] > self.limit_mb:
                self.killed_at_mb = float(self.samples[-1][2])
                for pid in self.tree():  # the watched process and its descendants only
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
            self._stop.wait(self.interval)

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join()
        return {k: round(v, 1) for k, v in self.peak.items()}


def run_results(cfg: Any) -> Any:
    """One in-process run of ``cfg`` (the centralized baseline too) with no log: its RunResults. Call it in a
    case's own process: it imports torch and flwr."""
    from simulations.federated import run_in_process  # noqa: PLC0415
    from strategies.centralized import train_centralized  # noqa: PLC0415
    from tpflower.owner import simulation_secret  # noqa: PLC0415
    from tpflower.relation import load_relation  # noqa: PLC0415
    from tpflower.results import new_run_results  # noqa: PLC0415

    if str(cfg.algorithm.name) != "centralized":
        return run_in_process(cfg, None, log=lambda _: None).strategy.results
    rel = load_relation(cfg.dataset, simulation_secret(cfg), verbose=False)
    results = new_run_results(cfg, "centralized", rel.spec, rel.mapping)
    train_centralized(cfg, rel, results, log=lambda _: None)
    return results


#: the scale benchmarks' star schema: SCALE_DIMS dimension tables, each joined row fans out SCALE_FANOUT ways
SCALE_DIMS, SCALE_FANOUT = 3, 2


def scale_loader(n_joined: int, fanout: int = SCALE_FANOUT) -> dict[str, Any]:
    """The synthetic loader settings of the scale benchmark at N = ``n_joined`` joined rows (``fanout`` 1: the
    fact table itself has N rows, no duplication by the join)."""
    return {
        "name": "synthetic",
        "schema": "star",
        "n_fact": n_joined // fanout**SCALE_DIMS,
        "n_dims": SCALE_DIMS,
        "fanout": fanout,
        "dim_rows": 200,
        "widths": 4,
        "seed": 0,
    }


def scale_overrides(n_joined: int, fanout: int = SCALE_FANOUT) -> list[str]:
    """Hydra overrides selecting that dataset (conf/dataset/synthetic.yaml with a star schema)."""
    loader = scale_loader(n_joined, fanout)
    return ["dataset=synthetic", *(f"dataset.loader.{k}={v}" for k, v in loader.items() if k != "name")]
