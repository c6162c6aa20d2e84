#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Tunes and measures kfac_fashion_mnist the way examples/fashion_mnist/README.md describes: a small grid per
optimizer on the tuning seeds, then the winners on other seeds.

  study.py grid  BINARY OUT_DIR --model cnn --epochs 5 --seeds 1,2 [--threads N]
      runs every grid point (SGD: lr; K-FAC: lr x damping; kfaccurv: K-FAC with the curvature
      modes, damping x kl_clip; ekfac: the same with --method ekfac; --optimizers
      sgd,kfac,kfaccurv,ekfac) for each seed, one CSV each in
      OUT_DIR; points already there are skipped, so an interrupted grid continues.
  study.py best  OUT_DIR
      the mean final test accuracy of every grid point, best first, per model and optimizer.
  study.py runs  BINARY OUT_DIR --model cnn --epochs 5 --seeds 3,4,5 [--threads N] [--optimizers sgd,kfac,ekfac]
      the optimizers with the program's defaults (the grids' winners) on each seed.
  study.py table OUT_DIR[=LABEL] [OUT_DIR[=LABEL] ...]
      the held-out table of examples/fashion_mnist/README.md and docs/examples.md: per model, optimizer and seed, the first epoch and training seconds
      at 88 % and 90 % test accuracy and the final accuracy, with the means.
"""

import argparse
import csv
import glob
import os
import subprocess
import sys
from collections import defaultdict

GRID = {
    "sgd": [{"lr": lr} for lr in (0.02, 0.05, 0.1, 0.2)],
    # Damping up to 0.03 diverged or lagged in a first sweep (examples/fashion_mnist/README.md): with kl_clip 0.001 the
    # clipped step's size is about sqrt(kl_clip / damping), whatever the learning rate.
    "kfac": [{"kfac-lr": lr, "damping": d} for lr in (0.05, 0.1, 0.2) for d in (0.1, 0.3, 1.0)],
}
# K-FAC with the curvature modes (docs/curvature-modes.md): per-example statistics and
# bias-corrected averaging, so that the factors hold the curvature and nothing else, and the
# KL clip's trust region annealed with the learning rate (a clipped step's size is
# √(κ / Σ P·Γ) whatever the learning rate). Damping × kl_clip, as a clipped run's step is set by
# κ; the learning rate (0.05) matters only where the clip does not bind.
CURVATURE_MODES = {"statistics": "per_example", "averaging": "bias_corrected", "kl-clip-schedule": "cosine"}
GRID["kfaccurv"] = [dict(CURVATURE_MODES, **{"damping": d, "kl-clip": k})
                    for d in (0.003, 0.01, 0.03) for k in (3e-05, 0.0001, 0.0003)]
# SGD with as many points as that: learning rate × momentum.
GRID["sgdwide"] = [{"lr": lr, "momentum": m} for lr in (0.03, 0.05, 0.1, 0.2, 0.3) for m in (0.9, 0.95)]
# EKFAC (--method ekfac, docs/k-fac.md) with the same modes: the same damping × kl_clip grid.
EKFAC_MODES = dict(CURVATURE_MODES, method="ekfac")
GRID["ekfac"] = [dict(EKFAC_MODES, **{"damping": d, "kl-clip": k})
                 for d in (0.003, 0.01, 0.03) for k in (3e-05, 0.0001, 0.0003)]
# The ResNet's runs take 4× as long: 6 points each, around the CNN's winners.
RESNET_GRID = {
    "kfaccurv": [dict(CURVATURE_MODES, **{"damping": d, "kl-clip": k}) for d in (0.003, 0.01, 0.03)
                 for k in (3e-05, 0.0001)],
    "ekfac": [dict(EKFAC_MODES, **{"damping": d, "kl-clip": k}) for d in (0.003, 0.01, 0.03)
              for k in (3e-05, 0.0001)],
    "sgdwide": [{"lr": lr, "momentum": m} for lr in (0.05, 0.1, 0.2) for m in (0.9, 0.95)],
}


def grid_points(optimizer, model):
    return RESNET_GRID[optimizer] if model == "resnet" and optimizer in RESNET_GRID else GRID[optimizer]


def point_name(model, optimizer, params, seed):
    text = "_".join(f"{k}{v}" for k, v in params.items() if k not in EKFAC_MODES)
    return f"{model}_{optimizer}_{text}_seed{seed}" if text else f"{model}_{optimizer}_seed{seed}"


def option_args(params):
    """The program's options for a grid point: --key value, or --key alone for a flag (True)."""
    args = []
    for key, value in params.items():
        args += [f"--{key}"] if value is True else [f"--{key}", str(value)]
    return args


def run_recorded(cmd, out_dir, name, optimizer, model, seed):
    """Runs `cmd`, which writes OUT_DIR/NAME.csv.part, unless NAME.csv is there already (so an
    interrupted grid continues); keeps what it printed in NAME.log and prints its summary lines.
    A run that fails counts as diverged: chance accuracy. Returns the CSV's path."""
    path = os.path.join(out_dir, name + ".csv")
    if os.path.exists(path):
        return path
    print("+", " ".join(cmd), flush=True)
    result = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    with open(os.path.join(out_dir, name + ".log"), "w") as log:
        log.write(result.stdout)
    for line in result.stdout.splitlines():
        if line.startswith("summary"):
            print("  " + line, flush=True)
    if result.returncode != 0 or not os.path.exists(path + ".part"):
        # A diverged run counts as chance accuracy: write what there is, marked.
        print(f"  exit status {result.returncode}: recorded as diverged", flush=True)
        with open(path, "w") as f:
            f.write("optimizer,model,seed,epoch,lr,train_loss,test_loss,test_accuracy,seconds\n")
            f.write(f"{optimizer},{model},{seed},-1,0,nan,nan,0.1,0\n")
        return path
    os.replace(path + ".part", path)
    return path


def run_point(binary, out_dir, model, optimizer, params, seed, threads, epochs):
    name = point_name(model, optimizer, params, seed)
    part = os.path.join(out_dir, name + ".csv.part")
    cmd = [binary, "--model", model, "--optimizer", "sgd" if optimizer.startswith("sgd") else "kfac",
           "--seed", str(seed), "--threads", str(threads), "--epochs", str(epochs), "--csv", part,
           "--curvature-csv", os.path.join(out_dir, name + "_curvature.csv"), "--no-plot"] + option_args(params)
    return run_recorded(cmd, out_dir, name, optimizer, model, seed)


def read_rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def cmd_grid(args):
    os.makedirs(args.out, exist_ok=True)
    for optimizer in args.optimizers.split(","):
        for params in grid_points(optimizer, args.model):
            for seed in args.seeds.split(","):
                run_point(args.binary, args.out, args.model, optimizer, params, seed, args.threads, args.epochs)


def score(rows):
    """A run's (epoch at which test accuracy first reached 90 %, final accuracy): a run that
    never gets there counts one epoch past its end, a diverged one (epoch -1, run_recorded's
    marker) as never."""
    hit = first_reaching(rows, 0.90)
    last = int(rows[-1]["epoch"])
    return hit[0] if hit else last + 1 if last >= 0 else float("inf"), float(rows[-1]["test_accuracy"])


def cmd_best(args):
    """Best first: the fewest epochs to 90 % test accuracy on average (a seed that never gets
    there counts as one epoch past the run), then the highest final accuracy."""
    scores = defaultdict(list)
    for path in sorted(glob.glob(os.path.join(args.out, "*.csv"))):
        if path.endswith("_curvature.csv"):
            continue
        name = os.path.basename(path)[:-4]
        point = name.rsplit("_seed", 1)[0]
        scores[point].append(score(read_rows(path)))
    by_group = defaultdict(list)
    for point, runs in scores.items():
        model, optimizer = point.split("_")[:2]
        epochs = sum(r[0] for r in runs) / len(runs)
        final = sum(r[1] for r in runs) / len(runs)
        by_group[(model, optimizer)].append((epochs, -final, point, runs))
    for group, entries in sorted(by_group.items()):
        print(f"{group[0]} {group[1]}:")
        for epochs, final, point, runs in sorted(entries):
            print(f"  90 % at epoch {epochs:.1f}, final {-100 * final:6.2f}%  {point}  "
                  f"({', '.join(f'{r[0]}/{100 * r[1]:.2f}' for r in runs)})")


def cmd_runs(args):
    os.makedirs(args.out, exist_ok=True)
    params = {"reference": True} if args.reference else {}
    for seed in args.seeds.split(","):
        for optimizer in args.optimizers.split(","):
            method = {"method": "ekfac"} if optimizer == "ekfac" else {}
            run_point(args.binary, args.out, args.model, optimizer, dict(params, **method), seed, args.threads,
                      args.epochs)


def first_reaching(rows, target):
    for row in rows:
        if int(row["epoch"]) > 0 and float(row["test_accuracy"]) >= target:
            return int(row["epoch"]), float(row["seconds"])
    return None


def cmd_table(args):
    runs = defaultdict(dict)  # (model, optimizer) -> seed -> rows
    for out in args.out:  # DIR or DIR=LABEL: the label names the optimizer of DIR's K-FAC runs
        out, _, label = out.partition("=")
        for path in sorted(glob.glob(os.path.join(out, "*.csv"))):
            if path.endswith("_curvature.csv"):
                continue
            rows = read_rows(path)
            if rows:
                optimizer = label if label and rows[0]["optimizer"] != "sgd" else rows[0]["optimizer"]
                runs[(rows[0]["model"], optimizer)][rows[0]["seed"]] = rows
    print("| model | optimizer | seed | 88 %: epoch / s | 90 %: epoch / s | final accuracy | training s |")
    print("|---|---|---|---|---|---|---|")
    for (model, optimizer), seeds in sorted(runs.items(), key=lambda kv: (kv[0][0], kv[0][1] != "sgd")):
        finals, seconds = [], []
        reach = {0.88: [], 0.90: []}
        for seed, rows in sorted(seeds.items()):
            cells = []
            for target in (0.88, 0.90):
                hit = first_reaching(rows, target)
                reach[target].append(hit)
                cells.append(f"{hit[0]} / {hit[1]:.0f}" if hit else "not reached")
            finals.append(float(rows[-1]["test_accuracy"]))
            seconds.append(float(rows[-1]["seconds"]))
            print(f"| {model} | {optimizer} | {seed} | {cells[0]} | {cells[1]} | {100 * finals[-1]:.2f} % | "
                  f"{seconds[-1]:.0f} |")
        mean_cells = []
        for target in (0.88, 0.90):
            hits = [h for h in reach[target] if h]
            if len(hits) == len(reach[target]):
                mean_cells.append(f"{sum(h[0] for h in hits) / len(hits):.1f} / "
                                  f"{sum(h[1] for h in hits) / len(hits):.0f}")
            else:
                mean_cells.append(f"{len(hits)} of {len(reach[target])} seeds")
        print(f"| **{model}** | **{optimizer}** | mean | {mean_cells[0]} | {mean_cells[1]} | "
              f"{100 * sum(finals) / len(finals):.2f} % | {sum(seconds) / len(seconds):.0f} |")


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("grid", "runs"):
        p = sub.add_parser(name)
        p.add_argument("binary")
        p.add_argument("out")
        p.add_argument("--model", default="cnn")
        p.add_argument("--seeds", default="1,2" if name == "grid" else "3,4,5")
        p.add_argument("--threads", type=int, default=0)
        p.add_argument("--epochs", type=int, required=True)
        p.add_argument("--optimizers", default="sgd,kfac")
        if name == "runs":
            p.add_argument("--reference", action="store_true",
                           help="the program's --reference defaults (kfac-pytorch's K-FAC): runs named kfac_reference")
    sub.add_parser("best").add_argument("out")
    sub.add_parser("table").add_argument("out", nargs="+")
    args = parser.parse_args(argv[1:])
    {"grid": cmd_grid, "best": cmd_best, "runs": cmd_runs, "table": cmd_table}[args.command](args)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
