"""The exact releases of one default run, per family (the basis of tpflower.releases.DEFAULT_CAPS).

``python -m simulations.bench.releases [--datasets synthetic,movielens,nycflights13]``: every registered
federated algorithm at its defaults (``algorithm=<its conf> dataset=<d>``, scenario join; ucq where the dataset
has shards), in process; counts the replies each node charges as exact releases (phases declared ``exact``,
tpflower.guard) and writes bench_results/releases.json: per run the most any one node released, per family
the largest over its runs, and the default cap = 20 x that (tpflower.releases.DEFAULT_RUNS).

The mini-batch families (PER_EPOCH: the same messages every epoch, one ``predict`` before the first) run one
epoch (``algorithm.min_steps=0``) and are extrapolated to a default run's epochs E (``epochs``, or more on a
small training join: ``algorithm.min_steps``): count(E) = 1 + E (count(1) - 1); ``--check`` runs them at both
on the synthetic schema and asserts the extrapolation is exact there.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

import yaml

import tpflower.client
from simulations.bench.common import machine_info
from simulations.federated import run_in_process
from strategies.join_sgd import epochs_for_steps, sgd_schedule
from tpflower import registry
from tpflower.config import CONF_DIR, compose_config
from tpflower.datasets import load_spec
from tpflower.releases import DEFAULT_RUNS

OUT = Path(__file__).resolve().parents[2] / "bench_results" / "releases.json"
#: families whose node answers the same messages every epoch after one start message
PER_EPOCH = ("join_sgd", "celu", "ucq_sgd")


def conf_name(entry: registry.AlgorithmEntry) -> str:
    for path in sorted(Path(CONF_DIR, "algorithm").glob("*.yaml")):
        if yaml.safe_load(path.read_text()).get("name") == entry.selector:
            return path.stem
    raise ValueError(f"no conf/algorithm YAML selects {entry.selector!r}")


def count_run(overrides: list[str]) -> tuple[dict[str, int], Any]:
    """Exact releases per node ("table/shard") of one in-process run of ``overrides``, and the run."""
    counts: Counter[str] = Counter()
    charge = tpflower.client.charge_exact_release

    def counting(client, phase: str, dry_run: bool = False) -> None:
        if not dry_run:
            counts[f"{client.settings.table}/{client.settings.shard}"] += 1
        charge(client, phase, dry_run)

    tpflower.client.charge_exact_release = counting
    try:
        run = run_in_process(compose_config(*overrides), None, log=lambda _: None)
    finally:
        tpflower.client.charge_exact_release = charge
    return dict(counts), run


def default_epochs(cfg: Any, strategy: Any) -> int:
    """The epochs of a default run of the mini-batch family ``cfg`` selects: ``epochs``, or more on a training
    join whose batches fall short of ``algorithm.min_steps`` (strategies.join_sgd.sgd_epochs), from the
    mini-batches per epoch of ``strategy`` (a finished run of it, the same training join)."""
    per_epoch = sgd_schedule(strategy)[0].per_epoch  # (a default run: no DP, batches of 1024)
    return epochs_for_steps(int(cfg.epochs), per_epoch, int(cfg.algorithm.get("min_steps") or 0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--datasets", default="synthetic,movielens,nycflights13")
    parser.add_argument("--out", default=str(OUT))
    parser.add_argument("--check", action="store_true", help="check the one-epoch extrapolation on synthetic")
    parser.add_argument("--skip", default="", help="algorithms not to run (comma-separated registry names)")
    parser.add_argument("--merge", default="", help="earlier JSON outputs whose runs to keep (comma-separated)")
    a = parser.parse_args()
    runs = [r for path in a.merge.split(",") if path for r in json.loads(Path(path).read_text())["runs"]]
    skip = set(a.skip.split(","))
    for dataset in a.datasets.split(","):
        spec = load_spec(compose_config(f"dataset={dataset}").dataset)
        scenarios = ["join", *(["ucq"] if any(t.shards is not None for t in spec.tables) else [])]
        for entry in registry.entries():
            if not entry.federated or entry.scenario not in scenarios or entry.name in skip:
                continue
            overrides = [f"algorithm={conf_name(entry)}", f"scenario={entry.scenario}", f"dataset={dataset}"]
            start = time.perf_counter()
            per_epoch = entry.family in PER_EPOCH
            try:
                if per_epoch:
                    counts, one = count_run([*overrides, "epochs=1", "algorithm.min_steps=0"])
                    epochs = default_epochs(compose_config(*overrides), one.strategy)
                    counts = {n: 1 + epochs * (c - 1) for n, c in counts.items()}
                    if a.check and dataset == "synthetic":
                        # (a run's early stopping may end it sooner: the extrapolation is the run to its last epoch)
                        full = count_run([*overrides, "algorithm.early_stopping=0"])[0]
                        assert counts == full, f"{entry.name}: the extrapolation {counts} is not the run's {full}"
                else:
                    counts = count_run(overrides)[0]
            except Exception as exc:  # a default that does not run on this dataset (e.g. pcg on a classification label)
                runs.append(
                    {"algorithm": entry.name, "family": entry.family, "dataset": dataset, "skipped": str(exc)[:200]}
                )
                print(f"{entry.name} {dataset}: skipped ({str(exc)[:120]})", flush=True)
                continue
            most = max(counts.values(), default=0)
            seconds = round(time.perf_counter() - start, 1)
            runs.append(
                {
                    "algorithm": entry.name,
                    "family": entry.family,
                    "dataset": dataset,
                    "most_per_node": most,
                    "per_node": counts,
                    "seconds": seconds,
                    "extrapolated_from_one_epoch": per_epoch,
                    **({"epochs": epochs} if per_epoch else {}),
                }
            )
            print(f"{entry.name} {dataset}: {most} exact releases on one node ({seconds:.0f} s)", flush=True)
            write(runs, a.out)  # after every run: a long suite keeps what it measured
    write(runs, a.out)


def write(runs: list[dict], out_path: str) -> None:
    """The runs, each family's largest and its default cap (DEFAULT_RUNS x the largest) as JSON."""
    largest: dict[str, int] = {}
    for r in runs:
        if "most_per_node" in r:
            largest[r["family"]] = max(largest.get(r["family"], 0), r["most_per_node"])
    out = {
        "machine": machine_info(),
        "runs": runs,
        "largest": largest,
        "default_caps": {f: DEFAULT_RUNS * n for f, n in sorted(largest.items())},
    }
    Path(out_path).write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
