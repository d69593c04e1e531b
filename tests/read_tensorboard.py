"""Reads a directory's TensorBoard event files twice and prints JSON on stdout:
- "records": every TFRecord of every events.out.tfevents.* file, its two masked CRC-32C values
  checked here independently of the writer (a bad one exits 1);
- "scalars": {tag: [[step, value], ...]} as TensorBoard's own EventAccumulator reads them.
Used by tests/test_trainer.cpp."""
import json
import os
import struct
import sys

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def crc32c(data):
    crc = 0xFFFFFFFF
    for b in data:
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
    return crc ^ 0xFFFFFFFF


def masked(data):
    c = crc32c(data)
    return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def count_records(path):
    n = 0
    with open(path, "rb") as f:
        blob = f.read()
    pos = 0
    while pos < len(blob):
        header = blob[pos:pos + 8]
        (length,) = struct.unpack("<Q", header)
        (hcrc,) = struct.unpack("<I", blob[pos + 8:pos + 12])
        data = blob[pos + 12:pos + 12 + length]
        (dcrc,) = struct.unpack("<I", blob[pos + 12 + length:pos + 16 + length])
        if hcrc != masked(header) or dcrc != masked(data) or len(data) != length:
            sys.exit(f"{path}: record {n} at byte {pos}: bad length or CRC")
        pos += 16 + length
        n += 1
    return n


def main():
    d = sys.argv[1]
    files = sorted(f for f in os.listdir(d) if f.startswith("events.out.tfevents."))
    records = {f: count_records(os.path.join(d, f)) for f in files}
    ea = EventAccumulator(d, size_guidance={"scalars": 0})
    ea.Reload()
    scalars = {t: [[e.step, e.value] for e in ea.Scalars(t)] for t in ea.Tags()["scalars"]}
    print(json.dumps({"records": records, "scalars": scalars}))


if __name__ == "__main__":
    main()
