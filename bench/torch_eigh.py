#!/usr/bin/env python3
"""torch.linalg.eigh for the sizes of the eigensolver sweeps: the reference implementation's
decomposition (kfac-pytorch calls torch.linalg.eigh), timed the same way (median of N after a
warm-up, synchronised on the GPU). On the GPU it sits beside bench_cuda's sweep; with
--device cpu beside bench_eigensolver's (plot_eigensolver.py draws it). JSON lines on stdout.

    python3 bench/torch_eigh.py [--sizes 64,128,...] [--iterations 5] [--double] [--device cpu]
"""
import argparse
import json
import time

import torch


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="64,128,256,577,1024,2048,4608")
    p.add_argument("--iterations", type=int, default=5)
    p.add_argument("--double", action="store_true")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    a = p.parse_args()
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
    dtype = torch.float64 if a.double else torch.float32
    torch.manual_seed(7)
    for n in (int(s) for s in a.sizes.split(",")):
        x = torch.randn(n, n, dtype=dtype, device=a.device)
        m = x @ x.T / n + 1e-3 * torch.eye(n, dtype=dtype, device=a.device)
        torch.linalg.eigh(m)
        times = []
        for _ in range(a.iterations):
            sync()
            t0 = time.perf_counter()
            torch.linalg.eigh(m)
            sync()
            times.append((time.perf_counter() - t0) * 1e3)
        times.sort()
        print(json.dumps({"bench": "torch_eigh", "dtype": str(dtype).replace("torch.", ""), "n": n,
                          "device": a.device, "threads": torch.get_num_threads(),
                          "eigh_ms": round(times[len(times) // 2], 4)}), flush=True)


if __name__ == "__main__":
    main()
