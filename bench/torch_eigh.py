#!/usr/bin/env python3
"""torch.linalg.eigh on the GPU for the sizes of bench_cuda's eigensolver sweep: the
reference implementation's decomposition (kfac-pytorch calls torch.linalg.eigh), timed the
same way (median of N after a warm-up, synchronised on both sides). JSON lines on stdout.

    python3 bench/torch_eigh.py [--sizes 64,128,...] [--iterations 5] [--double]
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
    a = p.parse_args()
    dtype = torch.float64 if a.double else torch.float32
    torch.manual_seed(7)
    for n in (int(s) for s in a.sizes.split(",")):
        x = torch.randn(n, n, dtype=dtype, device="cuda")
        m = x @ x.T / n + 1e-3 * torch.eye(n, dtype=dtype, device="cuda")
        torch.linalg.eigh(m)
        times = []
        for _ in range(a.iterations):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            torch.linalg.eigh(m)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
        times.sort()
        print(json.dumps({"bench": "torch_eigh", "dtype": str(dtype).replace("torch.", ""), "n": n,
                          "eigh_ms": round(times[len(times) // 2], 4)}), flush=True)


if __name__ == "__main__":
    main()
