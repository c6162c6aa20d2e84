#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Plots bench_eigensolver's JSON output (float): the eigendecomposition's time against n for
the backend (cpu_eigen::symmetric_eigen), bare LAPACK syevd, Eigen's solver and, when given,
torch.linalg.eigh on the CPU (what kfac-pytorch calls; bench/torch_eigh.py --device cpu), and
every rate as a fraction of the GEMM rate measured in the same run (gemm_reference).

    build/bench/bench_eigensolver --benchmark_out=eig.json --benchmark_out_format=json
    /usr/bin/python3 bench/torch_eigh.py --device cpu > torch_eigh.jsonl      # optional
    python3 bench/plot_eigensolver.py eig.json [torch_eigh.jsonl] eigensolver.png

Needs matplotlib (Debian: python3-matplotlib).
"""
import json
import re
import sys

try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError:
    sys.exit("plot_eigensolver.py needs matplotlib: apt install python3-matplotlib")

# bench family -> legend (every rate is bench_eigensolver's, 14/3 n³ flops per decomposition)
SERIES = {
    "eigh_backend": "kfac symmetric_eigen",
    "eigh_lapack_syevd": "LAPACK ssyevd (bare)",
    "eigh_eigen_saes": "Eigen SelfAdjointEigenSolver",
}
NAME = re.compile(r"^(\w+)<(float|double)>/n:(\d+)")


def read_benchmarks(path):
    """{(family, n): (median ms, GFLOP/s)} for float, medians where repeated."""
    out = {}
    for b in json.load(open(path))["benchmarks"]:
        m = NAME.match(b.get("run_name", b["name"]))
        if not m or m.group(2) != "float" or b.get("error_occurred"):
            continue
        aggregate = b.get("aggregate_name")
        if aggregate not in (None, "median"):
            continue
        key = (m.group(1), int(m.group(3)))
        if aggregate is None and key in out:
            continue  # a repetition; the median comes as its own entry
        ms = b["real_time"] * {"ms": 1.0, "us": 1e-3, "ns": 1e-6, "s": 1e3}[b["time_unit"]]
        out[key] = (ms, b.get("GFLOP/s", 0.0))  # the counter is already in GFLOP/s
    return out


def main() -> int:
    if len(sys.argv) not in (3, 4):
        sys.exit(__doc__)
    bench = read_benchmarks(sys.argv[1])
    torch_ms = {}
    if len(sys.argv) == 4:
        for line in open(sys.argv[2]):
            r = json.loads(line)
            if r.get("dtype") == "float32":
                torch_ms[r["n"]] = r["eigh_ms"]
    gemm = {n: rate for (family, n), (_, rate) in bench.items() if family == "gemm_reference"}

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for family, label in SERIES.items():
        points = sorted((n, v) for (f, n), v in bench.items() if f == family)
        if not points:
            continue
        left.plot([n for n, _ in points], [v[0] for n, v in points], marker="o", label=label)
        rel = [(n, v[1] / gemm[n]) for n, v in points if n in gemm and gemm[n] > 0]
        if rel:
            right.plot([n for n, _ in rel], [r for _, r in rel], marker="o", label=label)
    if torch_ms:
        points = sorted(torch_ms.items())
        left.plot([n for n, _ in points], [ms for _, ms in points], marker="s", linestyle="--",
                  label="torch.linalg.eigh (kfac-pytorch)")
        rel = [(n, 14.0 / 3.0 * n ** 3 / (ms * 1e-3) / 1e9 / gemm[n]) for n, ms in points if n in gemm]
        if rel:
            right.plot([n for n, _ in rel], [r for _, r in rel], marker="s", linestyle="--",
                       label="torch.linalg.eigh (kfac-pytorch)")
    left.set(xscale="log", yscale="log", xlabel="n", ylabel="time per decomposition (ms)",
             title="eigendecomposition, float, values + vectors")
    right.set(xscale="log", xlabel="n", ylabel="rate at 14/3 n³ / GEMM rate at 2n³",
              title="fraction of this machine's SGEMM rate")
    for ax in (left, right):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(sys.argv[-1], dpi=110)
    return 0


if __name__ == "__main__":
    sys.exit(main())
