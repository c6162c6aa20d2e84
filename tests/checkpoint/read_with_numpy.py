#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Reads a kfac checkpoint with a few lines of NumPy (no safetensors package needed) and
checks each <layer>.A / <layer>.G against the preconditioner's a_factor() / g_factor() that
kfac_checkpoint_writer wrote beside it. Exits 77 (skipped) when NumPy is missing.

    read_with_numpy.py FOLDER
"""
import json
import struct
import sys
from pathlib import Path

try:
    import numpy as np
except ImportError:
    print("SKIPPED: NumPy is not installed (apt-get install python3-numpy)")
    sys.exit(77)


def read_safetensors(path):
    """{name: array} and the metadata, straight from the bytes."""
    data = Path(path).read_bytes()
    (header_size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + header_size])
    body = data[8 + header_size:]
    metadata = header.pop("__metadata__", {})
    dtypes = {"F32": "<f4", "F64": "<f8", "I64": "<i8"}
    tensors = {}
    for name, entry in header.items():
        begin, end = entry["data_offsets"]
        tensors[name] = np.frombuffer(body[begin:end], dtype=dtypes[entry["dtype"]]).reshape(entry["shape"])
    return tensors, metadata


def main():
    folder = Path(sys.argv[1])
    tensors, metadata = read_safetensors(folder / "run.safetensors")
    failures = []
    if metadata.get("format") != "kfac.preconditioner" or metadata.get("step") != "3":
        failures.append(f"unexpected metadata {metadata.get('format')!r} step {metadata.get('step')!r}")
    compared = 0
    for reference in sorted(folder.glob("*.txt")):
        name = reference.stem  # "<layer>.A"
        expected = np.loadtxt(reference, ndmin=2)
        if name not in tensors:
            failures.append(f"{name} missing from the file")
            continue
        got = tensors[name]
        if got.dtype != np.float64 or got.shape != expected.shape or not np.array_equal(got, expected):
            failures.append(f"{name}: {got.dtype} {got.shape} differs from a_factor()/g_factor() {expected.shape}")
        compared += 1
    try:  # Python's safetensors package reads it too, where it is installed
        from safetensors.numpy import load_file
        for name, array in load_file(str(folder / "run.safetensors")).items():
            if not np.array_equal(array, tensors[name]):
                failures.append(f"safetensors reads {name} differently")
        print("safetensors package: read the same tensors")
    except ImportError:
        print("safetensors package not installed; NumPy alone read the file")
    if compared != 4:
        failures.append(f"compared {compared} factors, expected 4")
    for f in failures:
        print("FAIL:", f)
    print(f"compared {compared} factors with NumPy: {'FAIL' if failures else 'PASS'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
