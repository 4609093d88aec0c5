"""Store throughput: 151,936-wide logits rows encoded with the codec and committed through the
single writer thread, then read back and decoded.

    python benchmarks/store.py [--rows N] [--encoders K] [--quick]

`rows_per_s_write` is end to end: rows encoded on K caller threads (default 2, one per core of
this machine) and committed durably (fsync per group commit) by the writer thread.
`rows_per_s_commit` commits pre-encoded blobs (the store alone). `rows_per_s_read` reads every
row back in position order and decodes it. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._logits import SOURCE, synthetic_rows
from benchmarks._targets import finish
from tensorverse.store import Store
from tensorverse.store.codec import decode_row, encode_row

ROWS_PER_RECORD = 8  # a capture frame batch: rows of one run committed in one transaction


def _write(store: Store, rows: np.ndarray, n: int, encoders: int, run: str) -> float:
    """Encode on `encoders` threads and commit; returns seconds until the last commit."""
    def record(start: int):
        blobs = [(p, encode_row(rows[p % len(rows)])) for p in range(start, min(n, start + ROWS_PER_RECORD))]
        return store.write_rows(run, blobs)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(encoders) as pool:
        futs = list(pool.map(record, range(0, n, ROWS_PER_RECORD)))
    for f in futs:
        f.result()
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, default=3000)
    ap.add_argument("--encoders", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="600 rows")
    args = ap.parse_args()
    n = 600 if args.quick else args.rows

    ref, _ = synthetic_rows(32)
    tmp = Path(tempfile.mkdtemp(prefix="tv-bench-store-"))
    try:
        with Store.open(tmp / "store") as store:
            write_s = _write(store, ref, n, args.encoders, "end-to-end")
            blobs = [encode_row(r) for r in ref]
            t0 = time.perf_counter()
            futs = [
                store.write_rows("commit-only", [(p + k, blobs[(p + k) % len(blobs)]) for k in range(ROWS_PER_RECORD)])
                for p in range(0, n, ROWS_PER_RECORD)
            ]
            for f in futs:
                f.result()
            commit_s = time.perf_counter() - t0

            t0 = time.perf_counter()
            got = store.read_rows("end-to-end")
            read_only_s = time.perf_counter() - t0
            ok = True
            t0 = time.perf_counter()
            for pos, blob in got:
                row = decode_row(blob, record=f"end-to-end/{pos}")
                ok &= row.view(np.uint32)[:8].tobytes() == ref[pos % len(ref)].view(np.uint32)[:8].tobytes()
            decode_s = time.perf_counter() - t0
            stats = store.stats()
        result = {
            "benchmark": "store",
            "source": SOURCE,
            "rows": n,
            "vocab": int(ref.shape[1]),
            "encoders": args.encoders,
            "rows_per_s_write": round(n / write_s, 1),
            "rows_per_s_commit": round(n / commit_s, 1),
            "rows_per_s_read": round(n / (read_only_s + decode_s), 1),
            "rows_per_s_read_raw": round(n / read_only_s, 1),
            "bytes_per_row": round(stats["used_bytes"] / (2 * n)),
            "map_grows": stats["map_grows"],
            "intact": bool(ok and len(got) == n),
            "durable": True,
            "machine": f"{platform.machine()} {os.cpu_count()} cores",
        }
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"write (encode x{args.encoders} + commit): {result['rows_per_s_write']} rows/s; "
          f"commit only: {result['rows_per_s_commit']} rows/s; read+decode: {result['rows_per_s_read']} rows/s")
    return finish("store", result)


if __name__ == "__main__":
    sys.exit(main())
