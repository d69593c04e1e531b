#!/usr/bin/env python3
"""Independent safetensors reader (numpy only) used by the checkpoint tests.

Usage: read_safetensors.py FILE [NAME ...]
Prints JSON {"metadata": {...}, "tensors": {name: {"dtype", "shape", "values": [flat float list]}}}
for the named tensors (all when none is named). Written from the format description, not from
the C++ reader, so a test comparing both catches a writer that only our reader understands.
"""
import json
import struct
import sys

import numpy as np

DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4", "I16": "<i2",
          "I8": "i1", "U8": "u1", "BOOL": "?", "BF16": "<u2"}


def main():
    path = sys.argv[1]
    wanted = set(sys.argv[2:])
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n].decode("utf-8"))
    data = memoryview(blob)[8 + n:]
    out = {"metadata": header.pop("__metadata__", {}), "tensors": {}}
    for name, info in header.items():
        if wanted and name not in wanted:
            continue
        begin, end = info["data_offsets"]
        assert 0 <= begin <= end <= len(data), (name, begin, end, len(data))
        arr = np.frombuffer(data[begin:end], dtype=np.dtype(DTYPES[info["dtype"]]))
        if info["dtype"] == "BF16":
            arr = (arr.astype(np.uint32) << 16).view(np.float32)
        arr = arr.reshape(info["shape"])
        out["tensors"][name] = {"dtype": info["dtype"], "shape": list(arr.shape),
                                "values": [float(v) for v in arr.reshape(-1)]}
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
