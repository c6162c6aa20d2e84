#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Tunes and measures kfac_fashion_mnist the way README.md describes: a small grid per
optimizer on the tuning seeds, then the winners on other seeds.

  study.py grid  BINARY OUT_DIR --model cnn --epochs 5 --seeds 1,2 [--threads N]
      runs every grid point (SGD: lr; K-FAC: lr x damping) for each seed, one CSV each in
      OUT_DIR; points already there are skipped, so an interrupted grid continues.
  study.py best  OUT_DIR
      the mean final test accuracy of every grid point, best first, per model and optimizer.
  study.py runs  BINARY OUT_DIR --model cnn --epochs 5 --seeds 3,4,5 [--threads N]
      both optimizers with the program's defaults (the grids' winners) on each seed.
  study.py table OUT_DIR [OUT_DIR ...]
      the README's table: per model, optimizer and seed, the first epoch and training seconds
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
    # Damping up to 0.03 diverged or lagged in a first sweep (README.md): with kl_clip 0.001 the
    # clipped step's size is about sqrt(kl_clip / damping), whatever the learning rate.
    "kfac": [{"kfac-lr": lr, "damping": d} for lr in (0.05, 0.1, 0.2) for d in (0.1, 0.3, 1.0)],
}


def point_name(model, optimizer, params, seed):
    text = "_".join(f"{k}{v}" for k, v in params.items())
    return f"{model}_{optimizer}_{text}_seed{seed}" if text else f"{model}_{optimizer}_seed{seed}"


def run_point(binary, out_dir, model, optimizer, params, seed, threads, epochs):
    name = point_name(model, optimizer, params, seed)
    path = os.path.join(out_dir, name + ".csv")
    if os.path.exists(path):
        return path
    cmd = [binary, "--model", model, "--optimizer", optimizer, "--seed", str(seed), "--threads", str(threads),
           "--epochs", str(epochs), "--csv", path + ".part", "--no-plot"]
    for key, value in params.items():
        cmd += [f"--{key}", str(value)]
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


def read_rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def cmd_grid(args):
    os.makedirs(args.out, exist_ok=True)
    for optimizer in args.optimizers.split(","):
        for params in GRID[optimizer]:
            for seed in args.seeds.split(","):
                run_point(args.binary, args.out, args.model, optimizer, params, seed, args.threads, args.epochs)


def cmd_best(args):
    scores = defaultdict(list)
    for path in sorted(glob.glob(os.path.join(args.out, "*.csv"))):
        name = os.path.basename(path)[:-4]
        point = name.rsplit("_seed", 1)[0]
        rows = read_rows(path)
        scores[point].append(float(rows[-1]["test_accuracy"]))
    by_group = defaultdict(list)
    for point, accs in scores.items():
        model, optimizer = point.split("_")[:2]
        by_group[(model, optimizer)].append((sum(accs) / len(accs), point, accs))
    for group, entries in sorted(by_group.items()):
        print(f"{group[0]} {group[1]}:")
        for mean, point, accs in sorted(entries, reverse=True):
            print(f"  {100 * mean:6.2f}%  {point}  ({', '.join(f'{100 * a:.2f}' for a in accs)})")


def cmd_runs(args):
    os.makedirs(args.out, exist_ok=True)
    for seed in args.seeds.split(","):
        for optimizer in ("sgd", "kfac"):
            run_point(args.binary, args.out, args.model, optimizer, {}, seed, args.threads, args.epochs)


def first_reaching(rows, target):
    for row in rows:
        if int(row["epoch"]) > 0 and float(row["test_accuracy"]) >= target:
            return int(row["epoch"]), float(row["seconds"])
    return None


def cmd_table(args):
    runs = defaultdict(dict)  # (model, optimizer) -> seed -> rows
    for out in args.out:
        for path in sorted(glob.glob(os.path.join(out, "*.csv"))):
            rows = read_rows(path)
            if rows:
                runs[(rows[0]["model"], rows[0]["optimizer"])][rows[0]["seed"]] = rows
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
        if name == "grid":
            p.add_argument("--optimizers", default="sgd,kfac")
    sub.add_parser("best").add_argument("out")
    sub.add_parser("table").add_argument("out", nargs="+")
    args = parser.parse_args(argv[1:])
    {"grid": cmd_grid, "best": cmd_best, "runs": cmd_runs, "table": cmd_table}[args.command](args)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
