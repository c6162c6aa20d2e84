#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Plots kfac_schedule_study's JSON output: per model, the second-order makespan, the
load imbalance, the per-rank second-order memory and the gradient traffic of a plain step
against the world size, one line per strategy (compute-balanced assignment).

    python3 bench/plot_study.py study.json study.png

Needs matplotlib (Debian: python3-matplotlib).
"""
import json
import sys

try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError:
    sys.exit("plot_study.py needs matplotlib: apt install python3-matplotlib")


def main() -> int:
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    rows = [r for r in json.load(open(sys.argv[1])) if r["assignment"] == "compute"]
    models = sorted({r["model"] for r in rows})
    strategies = ["comm_opt", "hybrid_opt", "mem_opt", "dp_kfac"]
    panels = [("second_order_makespan_s", "second-order makespan (s)", True),
              ("load_imbalance", "load imbalance (max / mean)", True),
              ("second_order_bytes_per_rank", "second-order data per rank (MB)", True),
              ("bytes_plain_step", "bytes per plain step, per rank (MB)", False)]
    fig, axes = plt.subplots(len(models), len(panels), figsize=(5 * len(panels), 3.6 * len(models)),
                             squeeze=False)
    for i, model in enumerate(models):
        for j, (key, label, log_y) in enumerate(panels):
            ax = axes[i][j]
            for s in strategies:
                pts = sorted((r["world"], r[key] / (1e6 if "bytes" in key else 1.0))
                             for r in rows if r["model"] == model and r["strategy"] == s)
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=s)
            ax.set_xscale("log", base=2)
            if log_y:
                ax.set_yscale("log")
            ax.set_xlabel("workers W")
            ax.set_ylabel(label)
            ax.set_title(model.replace(".txt", ""), fontsize=10)
            ax.grid(True, alpha=0.3)
            if i == 0 and j == 0:
                ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(sys.argv[2], dpi=110)
    return 0


if __name__ == "__main__":
    sys.exit(main())
