"""Reads a TensorBoard log directory back with TensorBoard's own reader; prints JSON.

Usage: read_tensorboard.py LOGDIR

Prints {"files": [names], "records": n, "file_version": str,
        "scalars": {tag: [[step, value, wall_time], ...]}}, floats as repr() strings so that
the caller can parse them exactly.

Every record's framing and both CRCs are checked first with TensorBoard's masked_crc32c:
EventAccumulator logs a corrupt record and carries on, which would hide a CRC bug.
"""

import json
import os
import struct
import sys

from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator
from tensorboard.compat.proto.event_pb2 import Event
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c


def records(path):
    data = open(path, "rb").read()
    pos = 0
    while pos < len(data):
        header = data[pos : pos + 8]
        if len(header) < 8:
            sys.exit(f"{path}: truncated length at byte {pos}")
        (length,) = struct.unpack("<Q", header)
        (length_crc,) = struct.unpack("<I", data[pos + 8 : pos + 12])
        if length_crc != masked_crc32c(header):
            sys.exit(f"{path}: bad length CRC at byte {pos}")
        body = data[pos + 12 : pos + 12 + length]
        (body_crc,) = struct.unpack("<I", data[pos + 12 + length : pos + 16 + length])
        if len(body) != length or body_crc != masked_crc32c(body):
            sys.exit(f"{path}: bad data CRC at byte {pos}")
        yield body
        pos += 16 + length


def main():
    logdir = sys.argv[1]
    files = sorted(f for f in os.listdir(logdir) if "tfevents" in f)
    count = 0
    file_version = None
    for name in files:
        for i, raw in enumerate(records(os.path.join(logdir, name))):
            event = Event.FromString(raw)
            if i == 0:
                file_version = event.file_version
            count += 1

    acc = EventAccumulator(logdir, size_guidance={SCALARS: 0})  # 0: keep every point
    acc.Reload()
    scalars = {
        tag: [[e.step, repr(e.value), repr(e.wall_time)] for e in acc.Scalars(tag)]
        for tag in acc.Tags()["scalars"]
    }
    print(json.dumps({"files": files, "records": count, "file_version": file_version,
                      "scalars": scalars}))


if __name__ == "__main__":
    main()
