#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The flagship at large global batches (docs/examples.md, "Large batches"): SGD and K-FAC tuned on
tuning seeds at each batch, then the winners on held-out seeds, in one process or under
mpiexec.

  large_batch.py grid BINARY OUT_DIR --batch 1024 [--seeds 1] [--threads N] [--optimizers sgd,kfac]
      every grid point of --batch for each seed, one CSV each in OUT_DIR (points already there
      are skipped, so an interrupted grid continues).
  large_batch.py runs BINARY OUT_DIR --batch 1024 --grid GRID_DIR [--seeds 3,4,5] [--threads N]
                      [--launch "mpiexec -n 2"]
      each optimizer's best grid point in GRID_DIR (the fewest epochs to 90 % test accuracy,
      then the highest final accuracy, over its seeds) on each seed; --scale S: the point of
      learning-rate scale S instead.
  large_batch.py table OUT_DIR=LABEL [...]
      per directory and optimizer, the mean over seeds of the epochs and seconds to 88 % and
      90 % test accuracy and the final accuracy (a Markdown table).
  large_batch.py plot OUT_DIR=LABEL [...] PNG
      test accuracy against epochs and against training seconds, the mean over seeds.

The grid at global batch B (k = B / 128, the flagship's batch): the learning rate scaled by
s in {1, 2, 4, sqrt(k), k/4, k/2, k} (those up to k) from the batch-128 winners (SGD 0.03;
K-FAC 0.05): unscaled, the square-root and the linear scaling rules and points between, with a linear warmup over the first tenth of the
epochs (Goyal et al. 2017); K-FAC's KL clip scaled by s^2 (a clipped step's size is
sqrt(kl_clip / sum P.G), so s^2 scales the step as s scales SGD's), its factors updated every
step and its eigendecompositions every round(100 / k) steps, as many per epoch as at batch 128.
"""

import argparse
import math
import os
import shlex
import sys
from collections import defaultdict

sys.dont_write_bytecode = True  # no __pycache__ beside the sources
from study import first_reaching, option_args, read_rows, run_recorded, score  # noqa: E402  (this folder)

EPOCHS = {1024: 10, 4096: 20}  # ~590 and ~300 steps; batch 128 trains 5 epochs, 2,345 steps


def epochs_of(batch):
    return EPOCHS.get(batch, max(5, round(5 * math.sqrt(batch / 128))))


def scales(batch):
    """The learning-rate scales of the grid at `batch`, smallest first."""
    k = batch / 128
    return sorted({s for s in (1.0, 2.0, 4.0, math.sqrt(k), k / 4, k / 2, k) if s <= k})


def grid_points(optimizer, batch, max_scale=math.inf):
    k = batch / 128
    common = {"batch": batch, "warmup-epochs": epochs_of(batch) / 10}
    points = []
    for s in (s for s in scales(batch) if s <= max_scale):
        if optimizer == "sgd":
            points.append(dict(common, lr=round(0.03 * s, 4)))
        else:
            points.append(dict(common, **{"kfac-lr": round(0.05 * s, 4), "kl-clip": float(f"{3e-5 * s * s:.3g}"),
                                          "factor-update-steps": 1, "inv-update-steps": max(1, round(100 / k))}))
    return points


def point_name(optimizer, params, seed):
    keep = {k: v for k, v in params.items() if k in ("lr", "kfac-lr", "kl-clip")}
    return f"b{params['batch']}_{optimizer}_" + "_".join(f"{k}{v}" for k, v in keep.items()) + f"_seed{seed}"


def run_point(binary, out_dir, optimizer, params, seed, threads, launch):
    name = point_name(optimizer, params, seed)
    part = os.path.join(out_dir, name + ".csv.part")
    cmd = shlex.split(launch) + [binary, "--optimizer", optimizer, "--seed", str(seed), "--threads", str(threads),
                                 "--epochs", str(epochs_of(params["batch"])), "--csv", part,
                                 "--curvature-csv", os.path.join(out_dir, name + "_curvature.csv"),
                                 "--no-plot"] + option_args(params)
    return run_recorded(cmd, out_dir, name, optimizer, "cnn", seed)


def best_point(grid_dir, optimizer, batch):
    ranked = []
    for params in grid_points(optimizer, batch):
        prefix = point_name(optimizer, params, "")
        files = [f for f in os.listdir(grid_dir)
                 if f.startswith(prefix) and f.endswith(".csv") and not f.endswith("_curvature.csv")]
        if files:
            scores = [score(read_rows(os.path.join(grid_dir, f))) for f in files]
            # the fewest epochs to 90 % on average, then the highest mean final accuracy
            ranked.append(((sum(s[0] for s in scores) / len(scores), -sum(s[1] for s in scores) / len(scores)),
                           params))
    if not ranked:
        sys.exit(f"large_batch.py: no grid runs of {optimizer} at batch {batch} in {grid_dir}")
    return min(ranked, key=lambda r: r[0])[1]


def cmd_grid(args):
    os.makedirs(args.out, exist_ok=True)
    for optimizer in args.optimizers.split(","):
        for params in grid_points(optimizer, args.batch, args.max_scale):
            for seed in args.seeds.split(","):
                run_point(args.binary, args.out, optimizer, params, seed, args.threads, "")


def cmd_runs(args):
    os.makedirs(args.out, exist_ok=True)
    if args.scale is None:
        winners = {o: best_point(args.grid, o, args.batch) for o in args.optimizers.split(",")}
    else:  # another point of the grid than the winner
        winners = {o: p for o in args.optimizers.split(",")
                   for s, p in zip(scales(args.batch), grid_points(o, args.batch)) if math.isclose(s, args.scale)}
    for optimizer, params in winners.items():
        print(f"{optimizer} at batch {args.batch}: {params}", flush=True)
    for seed in args.seeds.split(","):
        for optimizer, params in winners.items():
            run_point(args.binary, args.out, optimizer, params, seed, args.threads, args.launch)


def runs_in(out_dir):
    """optimizer -> {seed: rows} for the CSVs of out_dir."""
    runs = defaultdict(dict)
    for f in sorted(os.listdir(out_dir)):
        if f.endswith(".csv") and not f.endswith("_curvature.csv"):
            rows = read_rows(os.path.join(out_dir, f))
            if rows:
                runs[rows[0]["optimizer"]][rows[0]["seed"]] = rows
    return runs


def labelled(dirs):
    return [d.partition("=")[::2] if "=" in d else (d, d) for d in dirs]


def reach_cell(seeds, target):
    """The mean epoch / training seconds at which the seeds' test accuracy first reached
    `target`, over the seeds that did, and how many did."""
    hits = [first_reaching(rows, target) for rows in seeds.values()]
    got = [h for h in hits if h]
    if not got:
        return "not reached"
    mean = f"{sum(h[0] for h in got) / len(got):.1f} / {sum(h[1] for h in got) / len(got):.0f}"
    return mean if len(got) == len(hits) else f"{mean} ({len(got)} of {len(hits)} seeds)"


def cmd_table(args):
    print("| run | optimizer | 88 %: epoch / s | 90 %: epoch / s | final accuracy | training s |")
    print("|---|---|---|---|---|---|")
    for out, label in labelled(args.out):
        for optimizer, seeds in sorted(runs_in(out).items(), key=lambda kv: (kv[0] != "sgd", kv[0])):
            finals = [float(rows[-1]["test_accuracy"]) for rows in seeds.values()]
            seconds = [float(rows[-1]["seconds"]) for rows in seeds.values()]
            print(f"| {label} | {optimizer} | {reach_cell(seeds, 0.88)} | {reach_cell(seeds, 0.90)} | "
                  f"{100 * sum(finals) / len(finals):.2f} % | {sum(seconds) / len(seconds):.0f} |")


def cmd_plot(args):
    """Left: accuracy against epochs (one-process runs); right: against training seconds, runs
    on several ranks dashed. A label "batch B" or "batch B, N ranks" picks the shade (the
    larger the batch, the darker) and the line style."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dirs = labelled(args.out[:-1])
    batches = sorted({label.split(",")[0] for _, label in dirs}, key=lambda b: int(b.split()[-1]))
    fig, (by_epoch, by_time) = plt.subplots(1, 2, figsize=(13, 5))
    for out, label in dirs:
        several = "ranks" in label
        shade = 0.45 + 0.55 * batches.index(label.split(",")[0]) / max(1, len(batches) - 1)
        for optimizer, seeds in sorted(runs_in(out).items()):
            kfac = optimizer.startswith("kfac")
            n = min(len(rows) for rows in seeds.values())
            mean = [[sum(float(rows[j][key]) for rows in seeds.values()) / len(seeds) for j in range(1, n)]
                    for key in ("epoch", "seconds", "test_accuracy")]
            color = plt.get_cmap("Oranges" if kfac else "Blues")(shade)
            name = f"{'SGD+K-FAC' if kfac else 'SGD'}, {label}"
            style = "--" if several else "-"
            if not several:
                by_epoch.plot(mean[0], [100 * a for a in mean[2]], style, color=color, label=name, marker=".")
            by_time.plot(mean[1], [100 * a for a in mean[2]], style, color=color, label=name, marker=".")
    for ax, xlabel in ((by_epoch, "epoch"), (by_time, "training seconds (2 cores)")):
        ax.axhline(90, color="gray", linewidth=0.6)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("test accuracy, %")
        ax.set_ylim(70, 92.5)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="center right")
    fig.suptitle("Fashion-MNIST CNN, SGD and SGD+K-FAC at global batches 128 to 4,096: mean of held-out seeds 3-5")
    fig.tight_layout()
    fig.savefig(args.out[-1], dpi=90)


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("grid", "runs"):
        p = sub.add_parser(name)
        p.add_argument("binary")
        p.add_argument("out")
        p.add_argument("--batch", type=int, required=True)
        p.add_argument("--seeds", default="1" if name == "grid" else "3,4,5")
        p.add_argument("--threads", type=int, default=0)
        p.add_argument("--optimizers", default="sgd,kfac")
        if name == "grid":
            p.add_argument("--max-scale", type=float, default=math.inf,
                           help="only the grid's points with a learning-rate scale up to this")
        if name == "runs":
            p.add_argument("--grid", required=True)
            p.add_argument("--launch", default="")
            p.add_argument("--scale", type=float, help="the grid point of this learning-rate scale, not the winner")
    sub.add_parser("table").add_argument("out", nargs="+")
    sub.add_parser("plot").add_argument("out", nargs="+")
    args = parser.parse_args(argv[1:])
    {"grid": cmd_grid, "runs": cmd_runs, "table": cmd_table, "plot": cmd_plot}[args.command](args)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
