"""Raw storage bandwidth through resilient's I/O engines: the ceiling for checkpoint write/restore.

Writes a file of --size bytes from host pool slabs (O_DIRECT where the file system allows it),
fsyncs it, drops it from the page cache, and reads it back, for each engine and queue depth.

    python benchmarks/raw_io.py --dir /tmp --size 1GiB --request 16MiB --depths 1,4,16
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from resilient import _C


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default=tempfile.gettempdir(), help="directory on the disk to test")
    p.add_argument("--size", default="1GiB", help="bytes per file, e.g. 1GiB")
    p.add_argument("--request", default="16MiB", help="bytes per I/O request")
    p.add_argument("--depths", default="1,4,16", help="queue depths, comma separated")
    p.add_argument("--engines", default="io_uring,threads", help="io_uring and/or threads")
    p.add_argument("--direct", default="auto", choices=["auto", "on", "off"], help="O_DIRECT")
    p.add_argument("--repeat", type=int, default=1, help="runs per configuration (best is kept)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p.parse_args(argv)


def run(argv: list[str] | None = None) -> int:
    """Runs the benchmark; returns the exit status."""
    args = _parse_args(argv)
    size = _C.parse_bytes(args.size)
    request = _C.parse_bytes(args.request)
    path = os.path.join(args.dir, f"resilient-raw-io-{os.getpid()}.bin")
    rows = []
    try:
        for engine in args.engines.split(","):
            uring = "on" if engine == "io_uring" else "off"
            for depth in (int(d) for d in args.depths.split(",")):
                best_w = best_r = None
                cache_dropped = True
                for _ in range(args.repeat):
                    w = _C.raw_write(path, size, request_bytes=request, queue_depth=depth,
                                     uring=uring, direct=args.direct)
                    cache_dropped = _C.drop_file_cache(path) and cache_dropped
                    r = _C.raw_read(path, request_bytes=request, queue_depth=depth, uring=uring,
                                    direct=args.direct)
                    best_w = w if best_w is None or w["seconds"] < best_w["seconds"] else best_w
                    best_r = r if best_r is None or r["seconds"] < best_r["seconds"] else best_r
                rows.append({
                    "engine": best_w["engine"], "queue_depth": depth, "request_bytes": request,
                    "bytes": size, "direct": best_w["direct"], "registered": best_w["registered"],
                    "write_s": best_w["seconds"], "read_s": best_r["seconds"],
                    "write_gbps": size / best_w["seconds"] / 1e9,
                    "read_gbps": size / best_r["seconds"] / 1e9,
                    "cache_dropped": cache_dropped,
                })
    finally:
        if os.path.exists(path):
            os.remove(path)
    if args.json:
        print(json.dumps({"rows": rows}))
        return 0
    print(f"{'engine':9} {'QD':>3} {'direct':>6} {'fixed':>5} {'write GB/s':>10} "
          f"{'read GB/s':>9} {'cache dropped':>13}")
    for r in rows:
        print(f"{r['engine']:9} {r['queue_depth']:>3} {str(r['direct']):>6} "
              f"{str(r['registered']):>5} {r['write_gbps']:>10.2f} {r['read_gbps']:>9.2f} "
              f"{str(r['cache_dropped']):>13}")
    return 0


if __name__ == "__main__":
    sys.exit(run())
