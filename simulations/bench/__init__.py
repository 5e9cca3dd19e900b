"""Benchmarks: speed and memory goals, measured and written to JSON (quoted in the README). One module per suite
(simulations/bench/SUITE.py); the command line in simulations/bench/__main__.py, shared helpers in common.py.

    python -m simulations.bench mapping [--n-joined 10000000]      -> bench_results/mapping.json
    python -m simulations.bench setup [--n-joined 10000000]        -> bench_results/setup.json
    python -m simulations.bench loj [--epochs 3]                   -> bench_results/loj.json
    python -m simulations.bench flower                             -> bench_results/flower.json
    python -m simulations.bench celu [--datasets ...] [--seeds 3]  -> bench_results/celu.json
    python -m simulations.bench convergence [--epochs 10] [--mlp]  -> bench_results/convergence.json
    python -m simulations.bench scale [--scale-n 1e6,1e7,4e7,1e8] [--server-n 1e7] [--mapping-n 100000000]
                                                                  -> bench_results/scale.json
    python -m simulations.bench deploy [--datasets movielens,star_2m] -> bench_results/deploy.json
    python -m simulations.bench coreset --dataset D --task ridge|kmeans [--reps 10] [--ms 500,1000,2000,4000]
                                                                  -> bench_results/coreset-D-TASK.json
    python -m simulations.bench privacy [--jobs 2]                 -> bench_results/privacy.json
    python -m simulations.bench predict [--n-joined 100000]        -> bench_results/predict.json
    python -m simulations.bench lbfgs [--cases nycflights13_delayed/mlp,...] -> bench_results/lbfgs.json
    python -m simulations.bench auto [--datasets ...]              -> bench_results/auto.json
    python -m simulations.bench convergence --matrix --gbdt [--quick] [--no-bundled] [--keep]
                                                                  -> bench_results/convergence-matrix-gbdt.json
    python -m simulations.bench selection [--epochs 10]            -> bench_results/selection.json
    python -m simulations.bench wide [--categories 0,1000,5000] [--n-fact 200000] -> bench_results/wide.json

Each case runs in a fresh subprocess so that its peak RSS (ru_maxrss) is its own; the cases of one
invocation run one after the other on the same machine, so their ratios are measured side by side.
"""
