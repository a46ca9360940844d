"""Pinned host<->device bandwidth through the store: pebble_restore (host tier -> device buffer) and
pebble_save (device buffer -> host tier), with 256 MiB entries by default.

    python benchmarks/memory.py store [--backend cuda] [--mib 256] [--repeats 10] [--json FILE]

On the cuda backend the destination/source is a CuPy device array and copies run on a CuPy stream;
on host/stub both sides are host memory (a memcpy figure, labelled so). Prints the median of the
repeats; figures are measurements of this run, nothing is assumed.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from pyplugin.store import Backend, select_backend
from pyplugin.runtime.measure import median_seconds


def measure(backend: str | Backend | None, mib: int, repeats: int) -> dict:
    nbytes = mib << 20
    backend = select_backend(backend)
    store = backend.open_store(2 * nbytes, n_layers=2, strategy="minimal")
    with store:
        device_buf = backend.xp.asarray(np.random.default_rng(0).integers(0, 255, size=nbytes, dtype=np.uint8))
        stream = backend.copy_stream()
        if stream is not None:
            sync, where = stream.synchronize, "CuPy device array <-> pinned host tier"
        else:
            sync, where = store.synchronize, "host memory <-> host tier (no GPU: a memcpy figure, not PCIe)"

        store.save(0, 0, device_buf, tier="host", stream=stream)
        store.synchronize()
        save_s = median_seconds(lambda: store.save(0, 0, device_buf, tier="host", stream=stream), sync, repeats)
        restore_s = median_seconds(lambda: store.restore(0, 0, device_buf, stream=stream), sync, repeats)
        stats = store.stats()
    d2h = nbytes / save_s / 1e9
    h2d = nbytes / restore_s / 1e9
    return {"backend": store.backend, "entry_bytes": nbytes, "repeats": repeats, "path": where,
            "h2d_restore_GBps": round(h2d, 2), "d2h_save_GBps": round(d2h, 2),
            "bytes_h2d_counted": stats.bytes_h2d, "bytes_d2h_counted": stats.bytes_d2h}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=("cuda", "host", "stub"))
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    result = measure(args.backend, args.mib, args.repeats)
    print(f"store bandwidth, backend {result['backend']}, {args.mib} MiB entries, median of {args.repeats} "
          f"({result['path']})")
    print(f"  restore host->device: {result['h2d_restore_GBps']:8.2f} GB/s (measured)")
    print(f"  save    device->host: {result['d2h_save_GBps']:8.2f} GB/s (measured)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result
