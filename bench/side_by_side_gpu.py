#!/usr/bin/env python3
"""kfac-pytorch and our bench_cuda on the same GPU, the same layer shapes, in one run.

    python3 bench/side_by_side_gpu.py --bench-cuda BUILD/bench/bench_cuda \\
        --kfac-pytorch PATH_TO_KFAC_PYTORCH [--model bench/models/resnet50_imagenet.txt ...] \\
        [--iterations 10] [--json out.json]

For each model file (default: ResNet-50 at batch 32 and the BERT-base-like stack at batch 32 x
sequence 128) it builds a torch module holding the file's Linear and Conv2d layers (the kinds
kfac-pytorch preconditions), each fed its own random input of the file's shape and given a
random output gradient, and times on the GPU, float32, for both compute methods:

* plain:    forward + backward without K-FAC;
* update:   forward + backward with kfac-pytorch's hooks + KFACPreconditioner.step(), every
            step a factor and inverse update; its overhead is this minus plain (its hooks
            compute the factor statistics during forward and backward);
* non-update: the same with updates 10^6 steps apart (after the first), minus plain.

Ours is bench_cuda --linear-only on the same file: step() with device views, which computes the
statistics, the decompositions and the preconditioned gradients: the whole of K-FAC's work
beyond the plain step. Both sides use kfac-pytorch's defaults (damping 0.003, factor_decay
0.95, kl_clip 0.001, lr 0.1, eigenvalue outer product). Medians of --iterations after a warm-up,
with torch.cuda.synchronize() around each. Prints a Markdown table (ours / theirs and the
ratio) with the card, both sides' versions and the date; --json writes every figure.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import re
import statistics
import subprocess
import sys
import time


def parse_args() -> argparse.Namespace:
    here = os.path.dirname(os.path.abspath(__file__))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--bench-cuda', required=True, help='path of the bench_cuda executable')
    p.add_argument('--kfac-pytorch', required=True, help='a kfac-pytorch source tree (the folder holding kfac/)')
    p.add_argument('--model', action='append', default=None,
                   help='model file (repeatable); default: ResNet-50 and the BERT-base-like stack')
    p.add_argument('--iterations', type=int, default=10)
    p.add_argument('--json', default=None, help='write every figure to this file')
    p.add_argument('--device', default='cuda', choices=['cuda', 'cpu'],
                   help='cpu: a dry run of the kfac-pytorch side on the CPU (no bench_cuda), to check the script')
    a = p.parse_args()
    if not a.model:
        a.model = [os.path.join(here, 'models', 'resnet50_imagenet.txt'), os.path.join(here, 'models', 'bert_base_stack.txt')]
    return a


def read_model(path: str) -> tuple[int, list[dict]]:
    """The file's batch and its Linear and Conv2d layers (bench/model_file.hpp's format)."""
    batch, layers = 1, []
    for line in open(path):
        if line.startswith('# batch:'):
            batch = int(line.split(':')[1])
        fields = line.split('#')[0].split()
        if not fields:
            continue
        kind, name = fields[0], fields[1]
        if kind == 'linear':
            layers.append(dict(kind=kind, name=name, inp=int(fields[2]), out=int(fields[3]), bias=fields[4] == '1',
                               rows=int(fields[5])))
        elif kind == 'conv2d':
            c_in, c_out, bias, kh, kw, stride, pad, h, w = (int(x) for x in fields[2:11])
            groups = int(fields[11]) if len(fields) > 11 else 1
            layers.append(dict(kind=kind, name=name, inp=c_in, out=c_out, bias=bias == 1, kernel=(kh, kw),
                               stride=stride, padding=pad, h=h, w=w, groups=groups))
    return batch, layers


def import_kfac(path: str):
    """kfac-pytorch from a source tree: its import asks the package metadata for a version."""
    sys.path.insert(0, path)
    original = importlib.metadata.version

    def version(name: str) -> str:
        if name.replace('_', '-').lower() == 'kfac-pytorch':
            return 'source-tree'
        return original(name)

    importlib.metadata.version = version
    import kfac  # noqa: E402
    import kfac.preconditioner  # noqa: E402
    importlib.metadata.version = original
    return kfac


def kfac_pytorch_version(path: str) -> str:
    """The commit and tag a copy's README states ("<40 hex> (v0.4.2-153)"), else 'source tree'."""
    readme = os.path.join(path, 'README.md')
    if os.path.exists(readme):
        found = re.search(r'\b([0-9a-f]{40})\b\s*\(([^)]+)\)', open(readme).read())
        if found:
            return f'{found.group(2)} ({found.group(1)[:10]})'
    return 'source tree'


def main() -> int:
    args = parse_args()
    try:
        import torch
    except ImportError:
        print('SKIPPED: this python3 has no torch; the side-by-side needs PyTorch with CUDA')
        return 77
    on_gpu = args.device == 'cuda'
    if on_gpu and not torch.cuda.is_available():
        print('SKIPPED: torch sees no CUDA device; the side-by-side needs a GPU')
        return 77
    kfac = import_kfac(args.kfac_pytorch)
    device = torch.device(args.device)
    synchronize = torch.cuda.synchronize if on_gpu else (lambda: None)
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 products, as cuBLAS runs ours
    torch.backends.cudnn.allow_tf32 = False

    class shape_stack(torch.nn.Module):
        """The file's layers side by side, each on its own input."""

        def __init__(self, layers: list[dict]):
            super().__init__()
            self.mods = torch.nn.ModuleList()
            for l in layers:
                if l['kind'] == 'linear':
                    self.mods.append(torch.nn.Linear(l['inp'], l['out'], bias=l['bias']))
                else:
                    self.mods.append(torch.nn.Conv2d(l['inp'], l['out'], l['kernel'], stride=l['stride'],
                                                     padding=l['padding'], groups=l['groups'], bias=l['bias']))

        def forward(self, inputs, output_grads):
            return sum((m(x) * r).sum() for m, x, r in zip(self.mods, inputs, output_grads))

    def timed(fn, iterations: int) -> float:
        fn()
        times = []
        for _ in range(iterations):
            synchronize()
            t0 = time.perf_counter()
            fn()
            synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    git = subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], capture_output=True, text=True,
                         cwd=os.path.dirname(os.path.abspath(__file__)))
    context = dict(date=datetime.date.today().isoformat(), card=torch.cuda.get_device_name(0) if on_gpu else 'CPU',
                   torch=torch.__version__, cuda=torch.version.cuda, kfac_pytorch=kfac_pytorch_version(args.kfac_pytorch),
                   kfac=git.stdout.strip() or 'unknown')
    print(f"Side by side on {context['card']}, {context['date']}: torch {context['torch']} (CUDA {context['cuda']}), "
          f"kfac-pytorch {context['kfac_pytorch']}, kfac {context['kfac']}; float32, K-FAC time per step beyond "
          f"forward + backward (ms, medians of {args.iterations})\n")
    print('| workload | method | step | plain fwd+bwd | kfac-pytorch | kfac | kfac / kfac-pytorch | host syncs (kfac) |')
    print('|---|---|---|---:|---:|---:|---:|---:|', flush=True)
    rows = []
    for path in args.model:
        batch, layers = read_model(path)
        name = os.path.basename(path)
        def make_model():  # the same weights every time; a fresh one has no hooks
            torch.manual_seed(0)
            return shape_stack(layers).to(device)

        model = make_model()
        inputs, grads = [], []
        for l, m in zip(layers, model.mods):
            if l['kind'] == 'linear':
                x = torch.randn(batch * l['rows'], l['inp'], device=device)
            else:
                x = torch.randn(batch, l['inp'], l['h'], l['w'], device=device)
            with torch.no_grad():
                shape = m(x).shape
            inputs.append(x)
            grads.append(torch.randn(shape, device=device) / batch)

        def fwd_bwd(net):
            net.zero_grad(set_to_none=False)
            net(inputs, grads).backward()

        base = timed(lambda: fwd_bwd(model), args.iterations)
        for method in ('eigen', 'inverse'):
            for update in (True, False):
                k = 1 if update else 10**6
                net = make_model()
                precond = kfac.preconditioner.KFACPreconditioner(
                    net, factor_update_steps=k, inv_update_steps=k, damping=0.003, factor_decay=0.95, kl_clip=0.001,
                    lr=0.1, compute_method=method, compute_eigenvalue_outer_product=True)

                def with_kfac():
                    fwd_bwd(net)
                    precond.step()

                theirs = max(timed(with_kfac, args.iterations) - base, 0.0)
                del precond, net
                rows.append(dict(model=name, layers=len(layers), method=method, step='update' if update else 'non_update',
                                 plain_ms=base, kfac_pytorch_ms=theirs))
        if on_gpu:
            torch.cuda.empty_cache()
            add_ours(rows, name, path, args)
        # Each model's rows as soon as they are measured: a run cut short keeps the finished ones.
        for r in rows:
            if r['model'] != name:
                continue
            ours = r.get('ours_ms', float('nan'))
            ratio = ours / r['kfac_pytorch_ms'] if r['kfac_pytorch_ms'] > 0 else float('nan')
            print(f"| {r['model']} ({r['layers']} layers) | {r['method']} | {r['step']} | {r['plain_ms']:.2f} | "
                  f"{r['kfac_pytorch_ms']:.2f} | {ours:.2f} | {ratio:.2f} | {r.get('synchronizations', '')} |", flush=True)
        if args.json:
            with open(args.json, 'w') as f:
                json.dump(dict(context=context, rows=rows), f, indent=1)
    return 0


def add_ours(rows: list[dict], name: str, path: str, args: argparse.Namespace) -> None:
    """bench_cuda's figures for one model file, into that model's rows."""
    out = subprocess.run([args.bench_cuda, '--model', path, '--linear-only', '--eigen-sizes', '',
                          '--iterations', str(args.iterations)], capture_output=True, text=True, check=True)
    for line in out.stdout.splitlines():
        if not line.startswith('{'):
            continue
        r = json.loads(line)
        if r.get('bench') != 'kfac_step' or not r.get('batched', True):
            continue
        for row in rows:
            if row['model'] == name and row['method'] == r['method'] and row['step'] == r['step']:
                row.update(ours_ms=r['ms'], synchronizations=r['synchronizations'])


if __name__ == '__main__':
    sys.exit(main())
