#!/usr/bin/env python3
"""compare_dumps.py W EXPECTED_DIR ACTUAL_DIR

Every *.npW.bin that kfac_mpi_tests left in EXPECTED_DIR (the preconditioned gradients of 4
steps and the factors rank 0 holds, raw doubles; tests/mpi/mpi_test.cpp, "every transport gives
the same numbers") must exist in ACTUAL_DIR, kfac_process_group_tests' dumps, and hold:

- at W <= 2, the same bytes: a sum of two terms is the same in either order, so the factor
  allreduce of MPI and of Gloo agree exactly and everything after it is the same local code;
- at W >= 3, the same numbers to 1e-10 relative (to the largest magnitude of the file's
  gradients, resp. factors): MPICH and Gloo add the W ranks' factors in different orders
  (recursive doubling against a ring), which MPI leaves to the implementation. Each entry of a
  reordered sum of W terms moves by at most (W - 1) u sum|terms| ~ 3.3e-16 relative (u = 2^-53),
  and the damped inverse amplifies it by at most (||F|| + g)/g ~ 1e2 to 1e3 over the 4 steps
  (g = 0.01 here): about 3e-13, so 1e-10 leaves a wide margin while an error of the
  transport (a wrong root, a missing rank's share) moves the numbers by O(1).
Prints the largest difference found per file.
"""
import array
import pathlib
import sys


def main():
    world, expected_dir, actual_dir = int(sys.argv[1]), pathlib.Path(sys.argv[2]), pathlib.Path(sys.argv[3])
    files = sorted(expected_dir.glob(f"*.np{world}.bin"))
    if not files:
        sys.exit(f"compare_dumps: no *.np{world}.bin in {expected_dir}")
    failed = False
    for expected_file in files:
        actual_file = actual_dir / expected_file.name
        if not actual_file.exists():
            print(f"{expected_file.name}: missing from {actual_dir}")
            failed = True
            continue
        expected, actual = expected_file.read_bytes(), actual_file.read_bytes()
        if world <= 2:
            same = expected == actual
            print(f"{expected_file.name}: {'the same bytes' if same else 'DIFFERENT bytes'}")
            failed |= not same
            continue
        e, a = array.array("d", expected), array.array("d", actual)
        if len(e) != len(a):
            print(f"{expected_file.name}: {len(e)} values against {len(a)}")
            failed = True
            continue
        scale = max(max(abs(v) for v in e), sys.float_info.min)
        worst = max(abs(x - y) for x, y in zip(e, a)) / scale
        ok = worst <= 1e-10
        print(f"{expected_file.name}: max relative difference {worst:.3e} {'<=' if ok else '>'} 1e-10"
              f"{' (the same bytes)' if expected == actual else ''}")
        failed |= not ok
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
