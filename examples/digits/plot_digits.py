#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Plots kfac_digits' CSV: test accuracy against epochs and against wall time, one line per
optimizer.

usage: plot_digits.py RESULTS.csv OUT.png

Exit status: 0 done, 2 bad input, 3 matplotlib is not installed (kfac_digits then tries
another python3 and otherwise prints a note).
"""

import csv
import sys


def main(argv):
    if len(argv) != 3:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    csv_path, png_path = argv[1], argv[2]
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        print(f"plot_digits.py: matplotlib is not installed for {sys.executable} "
              "(apt install python3-matplotlib)", file=sys.stderr)
        return 3

    runs = {}  # optimizer -> list of (epoch, accuracy, seconds), in file order
    try:
        with open(csv_path, newline="") as f:
            for row in csv.DictReader(f):
                runs.setdefault(row["optimizer"], []).append(
                    (int(row["epoch"]), float(row["test_accuracy"]), float(row["wall_seconds"])))
    except (OSError, KeyError, ValueError) as e:
        print(f"plot_digits.py: cannot read {csv_path}: {e!r}", file=sys.stderr)
        return 2
    if not runs:
        print(f"plot_digits.py: {csv_path} holds no rows", file=sys.stderr)
        return 2

    fig, (by_epoch, by_time) = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for name, points in runs.items():
        epochs = [p[0] for p in points]
        accuracy = [100.0 * p[1] for p in points]
        seconds = [p[2] for p in points]
        by_epoch.plot(epochs, accuracy, marker="o", markersize=3, label=name)
        by_time.plot(seconds, accuracy, marker="o", markersize=3, label=name)
    low = min(100.0 * p[1] for points in runs.values() for p in points[1:] or points)
    for ax, xlabel in ((by_epoch, "epoch"), (by_time, "training wall time (s)")):
        ax.set_xlabel(xlabel)
        ax.grid(True, alpha=0.3)
        ax.set_ylim(max(0.0, min(90.0, low) - 2.0), 100.0)
        ax.legend(loc="lower right")
    by_epoch.xaxis.set_major_locator(MaxNLocator(integer=True))
    by_epoch.set_ylabel("test accuracy (%)")
    by_epoch.set_title("test accuracy per epoch")
    by_time.set_title("test accuracy against wall time")
    fig.suptitle("UCI digits, MLP: SGD with momentum vs SGD with momentum + K-FAC")
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
