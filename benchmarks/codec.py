"""Benchmark: the lossless logits codec (tensorverse.store.codec) against the alternatives.

    python benchmarks/codec.py            # ~30-60 s on 2 cores
    python benchmarks/codec.py --quick    # a few seconds (or TENSORVERSE_BENCH_QUICK=1)

Rows are SYNTHETIC until recorded ones exist (benchmarks/_logits.py: a random LM head, rounded
to bf16-exact float32 like vLLM's rows, plus a near-identical shadow row per position).

Figures (per entry = per vocabulary entry of one row):
* ref_bytes_per_entry: a reference row, standalone blob.
* delta_bytes_per_entry: the shadow row delta-encoded against the reference row.
* rows_per_s: round trips (encode + decode + bit check excluded) of reference rows per second
  of this thread's CPU time, i.e. on one core; rows_per_s_wall is the same by the wall clock
  (lower when other processes share the cores).
* baselines, measured in the same run: raw float32 (4 B), plain numpy byte-shuffle + zstd
  level 1 of the planes the codec compresses (two for bf16-exact rows; the four-plane figure
  of earlier runs as ``baseline_shuffle4_*``), llama.cpp's lossy uint16 log-prob format (perplexity --kl-divergence-base: per row
  scale + min, uint16 per entry over a window of 16 nats below the max logit), and vLLM's JSON
  full-vocabulary logprobs (OpenAI completions `top_logprobs` with `token_id:N` keys).
The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import zstandard

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._logits import QWEN3_VOCAB, SOURCE, synthetic_rows
from benchmarks._targets import finish
from tensorverse.store.codec import blob_info, decode_row, encode_row

try:
    import orjson

    def _dumps(obj) -> bytes:
        return orjson.dumps(obj)
except ImportError:  # pragma: no cover
    def _dumps(obj) -> bytes:
        return json.dumps(obj, separators=(",", ":")).encode()


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint32 if a.dtype.itemsize == 4 else np.uint16)


def _timed(fn, rows, seconds: float) -> tuple[float, float, int]:
    """Run fn(row) over rows repeatedly for ~seconds; (cpu s per row, wall s per row, count)."""
    count = 0
    c0, w0 = time.thread_time(), time.perf_counter()
    while True:
        for r in rows:
            fn(r)
        count += len(rows)
        if time.perf_counter() - w0 >= seconds:
            break
    return (time.thread_time() - c0) / count, (time.perf_counter() - w0) / count, count


# ---------------------------------------------------------------------------- baselines

_Z1 = zstandard.ZstdCompressor(level=1)
_D1 = zstandard.ZstdDecompressor()


def shuffle_zstd_encode(row: np.ndarray) -> bytes:
    """Plain numpy byte-shuffle + zstd level 1 of the planes the codec compresses: for a
    bf16-exact float32 row (vLLM's rows; the low 16 bits are zero) its two high bytes, two planes,
    as the codec packs it; otherwise all four planes. No delta, no per-plane choice, no tuning."""
    n = row.size
    if not row.view(np.uint16)[0::2].any():  # the low halves (little-endian): bf16-exact
        return b"\x02" + _Z1.compress(np.ascontiguousarray(row.view(np.uint8).reshape(n, 4)[:, 2:].T))
    return b"\x04" + shuffle4_zstd_encode(row)


def shuffle_zstd_decode(blob: bytes, n: int) -> np.ndarray:
    if blob[:1] == b"\x04":
        return shuffle4_zstd_decode(blob[1:], n)
    planes = np.frombuffer(_D1.decompress(blob[1:]), np.uint8).reshape(2, n)
    out = np.zeros((n, 4), np.uint8)
    out[:, 2:] = planes.T
    return out.view(np.float32).reshape(n)


def shuffle4_zstd_encode(row: np.ndarray) -> bytes:
    """The same over all four float32 planes (the baseline before 2026-12-02: the two zero
    planes of a bf16-exact row cost it time the codec does not spend)."""
    n = row.size
    return _Z1.compress(np.ascontiguousarray(row.view(np.uint8).reshape(n, 4).T))


def shuffle4_zstd_decode(blob: bytes, n: int) -> np.ndarray:
    planes = np.frombuffer(_D1.decompress(blob), np.uint8).reshape(4, n)
    return np.ascontiguousarray(planes.T).view(np.float32).reshape(n)


def llamacpp_uint16(row: np.ndarray) -> tuple[bytes, np.ndarray, np.ndarray]:
    """llama.cpp perplexity.cpp log_softmax() storage: 2 floats + uint16 per entry (lossy).

    Returns (blob, reconstructed log-probs, exact log-probs) for error measurement.
    """
    x = row.astype(np.float32)
    mx, mn = float(x.max()), float(x.min())
    mn = max(mn, mx - 16.0)
    lse = float(np.log(np.exp((x - mx).astype(np.float64)).sum()))
    min_log_prob = np.float32(mn - mx - lse)
    scale = np.float32((mx - mn) / 65535.0)
    q = np.where(x > mn, np.rint((x - np.float32(mn)) / scale), 0).astype(np.uint16)
    blob = np.array([scale, min_log_prob], np.float32).tobytes() + q.tobytes()
    approx = scale * q.astype(np.float32) + min_log_prob
    exact = (x.astype(np.float64) - mx - lse)
    return blob, approx, exact


def vllm_json_logprobs(row: np.ndarray, token_id: int) -> bytes:
    """One position of vLLM's completions response with logprobs=-1 and token ids as keys."""
    x = row.astype(np.float64)
    m = x.max()
    lp = (x - m - np.log(np.exp(x - m).sum())).astype(np.float32)  # vLLM reports float32
    top = {f"token_id:{i}": v for i, v in enumerate(lp.tolist())}
    obj = {"tokens": [f"token_id:{token_id}"], "token_logprobs": [float(lp[token_id])],
           "top_logprobs": [top], "text_offset": [0]}
    return _dumps(obj)


# ---------------------------------------------------------------------------- main

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    default=os.environ.get("TENSORVERSE_BENCH_QUICK") == "1")
    ap.add_argument("--rows", type=int, default=None, help="positions (default 16, quick 4)")
    ap.add_argument("--seconds", type=float, default=None,
                    help="timing window per measurement (default 4, quick 0.7)")
    ap.add_argument("--vocab", type=int, default=QWEN3_VOCAB)
    args = ap.parse_args(argv)
    nrows = args.rows or (4 if args.quick else 16)
    secs = args.seconds or (0.7 if args.quick else 4.0)
    vocab = args.vocab

    t0 = time.perf_counter()
    ref, shadow = synthetic_rows(nrows, vocab=vocab)
    ref_rows, sh_rows = list(ref), list(shadow)
    same = float((_bits(ref) == _bits(shadow)).mean())
    print(f"source: SYNTHETIC logits (random LM head, hidden 128, bf16-exact float32), "
          f"{nrows} positions x {vocab} vocab; shadow rows: {same:.1%} of entries "
          f"bit-identical to the reference (generated in {time.perf_counter() - t0:.1f} s)")

    # --- sizes and losslessness (every row, both modes)
    lossless = True
    ref_blobs = [encode_row(r) for r in ref_rows]
    delta_blobs = [encode_row(s, ref=r) for s, r in zip(sh_rows, ref_rows)]
    for r, s, b, d in zip(ref_rows, sh_rows, ref_blobs, delta_blobs):
        lossless &= bool(np.array_equal(_bits(decode_row(b)), _bits(r)))
        lossless &= bool(np.array_equal(_bits(decode_row(d, ref=r)), _bits(s)))
    # full float32 rows (not bf16-exact) must be exact too
    f32, _ = synthetic_rows(2, vocab=vocab, bf16=False, seed=7)
    f32_blobs = [encode_row(r) for r in f32]
    for r, b in zip(f32, f32_blobs):
        lossless &= bool(np.array_equal(_bits(decode_row(b)), _bits(r)))
    ident = encode_row(ref_rows[0].copy(), ref=ref_rows[0])
    lossless &= bool(np.array_equal(_bits(decode_row(ident, ref=ref_rows[0])), _bits(ref[0])))
    entries = nrows * vocab
    ref_bpe = sum(map(len, ref_blobs)) / entries
    delta_bpe = sum(map(len, delta_blobs)) / entries
    f32_bpe = sum(map(len, f32_blobs)) / (2 * vocab)
    info = blob_info(ref_blobs[0])
    dinfo = blob_info(delta_blobs[0])
    print(f"codec reference row : {ref_bpe:.3f} B/entry  (mode {info['mode']}, planes "
          f"{info['planes']})")
    print(f"codec delta row     : {delta_bpe:.3f} B/entry  (mode {dinfo['mode']}, planes "
          f"{dinfo['planes']})")
    print(f"codec identical row : {len(ident)} bytes in all")
    print(f"codec full float32  : {f32_bpe:.3f} B/entry  (not bf16-exact)")
    print(f"lossless (bit-exact on every row, verified): {lossless}")

    # --- speed: round trips of reference rows, one thread
    cpu_rt, wall_rt, count = _timed(lambda r: decode_row(encode_row(r)), ref_rows, secs)
    cpu_enc, _, _ = _timed(encode_row, ref_rows, secs / 3)
    cpu_dec, _, _ = _timed(decode_row, ref_blobs, secs / 3)
    pairs = list(zip(sh_rows, ref_rows))
    cpu_drt, _, _ = _timed(lambda p: decode_row(encode_row(p[0], ref=p[1]), ref=p[1]),
                           pairs, secs / 2)
    print(f"codec round trip    : {1 / cpu_rt:.0f} rows/s per core (CPU time; "
          f"{1 / wall_rt:.0f} by wall clock, {count} rows); encode {cpu_enc * 1e6:.0f} us, "
          f"decode {cpu_dec * 1e6:.0f} us; delta round trip {1 / cpu_drt:.0f} rows/s")

    # --- baselines
    sz_blobs = [shuffle_zstd_encode(r) for r in ref_rows]
    sz_bpe = sum(map(len, sz_blobs)) / entries
    for r, b in zip(ref_rows, sz_blobs):
        assert np.array_equal(_bits(shuffle_zstd_decode(b, vocab)), _bits(r))
    cpu_sz, wall_sz, _ = _timed(lambda r: shuffle_zstd_decode(shuffle_zstd_encode(r), vocab),
                                ref_rows, secs)
    s4_bpe = sum(len(shuffle4_zstd_encode(r)) for r in ref_rows) / entries
    cpu_s4, _, _ = _timed(lambda r: shuffle4_zstd_decode(shuffle4_zstd_encode(r), vocab), ref_rows, secs / 2)
    print("baseline raw float32: 4.000 B/entry")
    print(f"baseline numpy shuffle+zstd1 of the same 2 bf16 planes: {sz_bpe:.3f} B/entry, {1 / cpu_sz:.0f} "
          f"rows/s per core ({1 / wall_sz:.0f} wall) -> codec is {cpu_sz / cpu_rt:.2f}x its speed")
    print(f"(the same over all 4 float32 planes, the earlier baseline: {s4_bpe:.3f} B/entry, "
          f"{1 / cpu_s4:.0f} rows/s)")

    errs, clamped, lz_size = [], 0, 0
    for r in ref_rows:
        blob, approx, exact = llamacpp_uint16(r)
        lz_size += len(blob)
        window = exact > (exact.max() - 16.0)
        clamped += int((~window).sum())
        errs.append(float(np.abs(approx[window] - exact[window]).max()))
    lz_bpe = lz_size / entries
    lz_err = max(errs)
    print(f"baseline llama.cpp uint16 (LOSSY): {lz_bpe:.3f} B/entry, max |error| of log-prob "
          f"{lz_err:.2e} nats within its 16-nat window ({clamped} entries clamped)")

    njson = 1 if args.quick else 2
    js = [vllm_json_logprobs(r, int(np.argmax(r))) for r in ref_rows[:njson]]
    js_bpe = sum(map(len, js)) / (njson * vocab)
    print(f"baseline vLLM JSON logprobs=-1: {js_bpe:.1f} B/entry "
          f"({len(js[0]) / 1e6:.1f} MB per position)")

    result = {
        "benchmark": "codec",
        "source": SOURCE,
        "rows": nrows,
        "vocab": vocab,
        "shadow_identical_share": round(same, 4),
        "ref_bytes_per_entry": round(ref_bpe, 4),
        "delta_bytes_per_entry": round(delta_bpe, 4),
        "identical_delta_bytes": len(ident),
        "float32_full_bytes_per_entry": round(f32_bpe, 4),
        "rows_per_s": round(1 / cpu_rt, 1),
        "rows_per_s_wall": round(1 / wall_rt, 1),
        "encode_us": round(cpu_enc * 1e6, 1),
        "decode_us": round(cpu_dec * 1e6, 1),
        "delta_rows_per_s": round(1 / cpu_drt, 1),
        "lossless": lossless,
        "baseline_raw_float32_bytes_per_entry": 4.0,
        "baseline_shuffle_zstd1_bytes_per_entry": round(sz_bpe, 4),
        "baseline_shuffle_zstd1_rows_per_s": round(1 / cpu_sz, 1),
        "speedup_vs_shuffle_zstd1": round(cpu_sz / cpu_rt, 2),
        "baseline_shuffle_planes": 2,
        "baseline_shuffle4_zstd1_bytes_per_entry": round(s4_bpe, 4),
        "baseline_shuffle4_zstd1_rows_per_s": round(1 / cpu_s4, 1),
        "llamacpp_uint16_bytes_per_entry": round(lz_bpe, 4),
        "llamacpp_uint16_max_abs_error": lz_err,
        "llamacpp_uint16_lossless": False,
        "vllm_json_bytes_per_entry": round(js_bpe, 2),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    return finish("codec", result)


if __name__ == "__main__":
    sys.exit(main())
