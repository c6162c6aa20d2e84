#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Plots kfac_fashion_mnist's curvature CSVs (--curvature-csv): each layer's curvature share
(kfac::preconditioner::curvature(), docs/curvature-modes.md) after every epoch, one panel
per model, one line style per run label.

usage: plot_curvature.py LABEL=RUN_curvature.csv [LABEL=MORE_curvature.csv ...] OUT.png

Each argument's LABEL names its run in the legend ("reference", "curvature modes"); rows of
several seeds under one label are averaged per (model, layer, epoch).

Exit status: 0 done, 2 bad input, 3 matplotlib is not installed.
"""

import csv
import sys
from collections import defaultdict

STYLES = ["-", "--", ":", "-."]


def main(argv):
    if len(argv) < 3 or not all("=" in a for a in argv[1:-1]):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        print(f"plot_curvature.py: matplotlib is not installed for {sys.executable} "
              "(apt install python3-matplotlib)", file=sys.stderr)
        return 3
    labels = []
    # (model, label, layer) -> epoch -> shares over seeds
    series = defaultdict(lambda: defaultdict(list))
    for argument in argv[1:-1]:
        label, path = argument.split("=", 1)
        if label not in labels:
            labels.append(label)
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                series[(row["model"], label, row["layer"])][int(row["epoch"])].append(float(row["curvature_share"]))
    models = sorted({key[0] for key in series})
    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 4.2), squeeze=False)
    for ax, model in zip(axes[0], models):
        layers = sorted({key[2] for key in series if key[0] == model})
        colors = {layer: plt.cm.tab10(i % 10) for i, layer in enumerate(layers)}
        for (m, label, layer), epochs in sorted(series.items()):
            if m != model:
                continue
            xs = sorted(epochs)
            ys = [max(1e-12, sum(epochs[x]) / len(epochs[x])) for x in xs]
            ax.plot(xs, ys, STYLES[labels.index(label) % len(STYLES)], color=colors[layer], marker="o", markersize=3,
                    label=f"{layer} ({label})")
        ax.set_yscale("log")
        ax.set_title(f"{model}: curvature share of each layer's preconditioner")
        ax.set_xlabel("epoch")
        ax.set_ylabel("mean over directions of λ_A λ_G / damped")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(argv[-1], dpi=120)
    print(f"plot: {argv[-1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
