#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Plots kfac_fashion_mnist's CSV: test accuracy against epochs and against training wall
time, one line per (model, optimizer, seed). Several CSVs may be given; their rows are pooled.

usage: plot_fashion_mnist.py RESULTS.csv [MORE.csv ...] OUT.png

Exit status: 0 done, 2 bad input, 3 matplotlib is not installed.
"""

import csv
import sys

LABELS = {"sgd": "SGD+momentum", "kfac": "SGD+momentum+K-FAC",
          "kfac_reference": "SGD+momentum+K-FAC, kfac-pytorch's modes"}
COLORS = {"sgd": "tab:blue", "kfac": "tab:orange", "kfac_reference": "tab:gray"}
REUSE = "kfac_reuse_"  # K-FAC with --eigenbasis-reuse TAU: kfac_reuse_TAU
REUSE_COLORS = ["tab:green", "tab:red", "tab:purple", "tab:brown"]


def label(optimizer):
    if optimizer.startswith(REUSE):
        return f"SGD+momentum+K-FAC, eigenbasis reuse τ={optimizer[len(REUSE):]}"
    return LABELS.get(optimizer, optimizer)
STYLES = {"cnn": "-", "resnet": "--"}


def main(argv):
    if len(argv) < 3:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    csv_paths, png_path = argv[1:-1], argv[-1]
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        print(f"plot_fashion_mnist.py: matplotlib is not installed for {sys.executable} "
              "(apt install python3-matplotlib)", file=sys.stderr)
        return 3

    runs = {}  # (model, optimizer, seed) -> [(epoch, accuracy, seconds)]
    try:
        for path in csv_paths:
            with open(path, newline="") as f:
                for row in csv.DictReader(f):
                    key = (row["model"], row["optimizer"], row["seed"])
                    runs.setdefault(key, []).append(
                        (int(row["epoch"]), float(row["test_accuracy"]), float(row["seconds"])))
    except (OSError, KeyError, ValueError) as e:
        print(f"plot_fashion_mnist.py: cannot read {csv_paths}: {e!r}", file=sys.stderr)
        return 2
    if not runs:
        print(f"plot_fashion_mnist.py: {csv_paths} hold no rows", file=sys.stderr)
        return 2

    reuse = sorted({k[1] for k in runs if k[1].startswith(REUSE)}, key=lambda o: float(o[len(REUSE):]))
    colors = dict(COLORS, **{o: REUSE_COLORS[i % len(REUSE_COLORS)] for i, o in enumerate(reuse)})
    models = sorted({k[0] for k in runs})
    seeds = sorted({k[2] for k in runs})
    fig, (by_epoch, by_time) = plt.subplots(1, 2, figsize=(11, 4.4), sharey=True)
    labelled = set()
    for (model, optimizer, seed), points in sorted(runs.items()):
        points = [p for p in points if p[0] > 0]  # epoch 0 (the initial model) is off the scale
        text = label(optimizer) + (f", {model}" if len(models) > 1 else "")
        style = dict(color=colors.get(optimizer), linestyle=STYLES.get(model, "-"), marker="o", markersize=3,
                     alpha=1.0 if len(seeds) == 1 else 0.6,
                     label=None if text in labelled else text)
        labelled.add(text)
        by_epoch.plot([p[0] for p in points], [100 * p[1] for p in points], **style)
        by_time.plot([p[2] for p in points], [100 * p[1] for p in points], **style)
    # The axis starts at 75 % so that the last epochs' differences (tenths of a point) show;
    # the few earlier points below it are counted in the first panel, not dropped silently.
    accuracies = [100 * p[1] for points in runs.values() for p in points if p[0] > 0]
    bottom = max(0.0, min(86.0, min(accuracies)) - 1.0)
    below = 0
    if bottom < 75.0:
        bottom, below = 75.0, sum(a < 75.0 for a in accuracies)
    top = max(94.0, max(accuracies) + 1.0)
    for ax, xlabel in ((by_epoch, "epoch"), (by_time, "training wall time (s)")):
        ax.set_xlabel(xlabel)
        ax.grid(True, alpha=0.3)
        ax.set_ylim(bottom, top)
        for level in (88, 90):
            ax.axhline(level, color="grey", linewidth=0.6, linestyle=":")
        ax.legend(loc="lower right")
    if below:
        by_epoch.text(0.02, 0.02, f"{below} point{'s' if below > 1 else ''} below 75 % not shown",
                      transform=by_epoch.transAxes, fontsize=8, color="grey")
    by_epoch.xaxis.set_major_locator(MaxNLocator(integer=True))
    by_epoch.set_ylabel("test accuracy (%)")
    by_epoch.set_title("test accuracy per epoch")
    by_time.set_title("test accuracy against training time")
    seed_text = f"seed {seeds[0]}" if len(seeds) == 1 else f"seeds {', '.join(seeds)}"
    compared = ("K-FAC with exact and with reused eigenbases" if reuse
                else "SGD with momentum vs SGD with momentum + K-FAC")
    fig.suptitle(f"Fashion-MNIST ({' and '.join(models)}, {seed_text}): {compared}")
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
