"""Codec cost: MB/s of packing (worker) and unpacking (server) per compression scheme.

    nice -n 19 python bench/compression.py [--sizes 16K,1M,25M] [--seconds 0.5] [--json FILE]

For each scheme of ssdsgd.kvstore.compression and each gradient size (float32 elements;
K = 2^10, M = 2^20) it times
  pack    Residuals.encode: residual += grad, quantize, pack, update the residual
  unpack  Compression.decode: packed bytes -> float32 values (what a server sums)
and prints MB/s of float32 gradient (4 bytes per element, MB = 1e6 bytes) for each, as
the median and the best repetition, and the bytes on the wire per element. "2bit (MXNet C++)" is MXNet 1.9.1's own kernel on the
same data (its GradientCompression, called through ssdsgd.testing.mxnet_compression),
for comparison. Each figure is the median of repetitions run for about --seconds; the
whole run is bounded by --budget seconds (remaining rows are skipped with a note).
"""
import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from ssdsgd.kvstore import compression as C  # noqa: E402

SCHEMES = {'2bit': {'type': '2bit', 'threshold': 0.5}, 'topk': {'type': 'topk', 'ratio': 0.1}}


def parse_size(text):
    text = text.strip().upper()
    scale = {'K': 1 << 10, 'M': 1 << 20}.get(text[-1:], 1)
    return int(float(text.rstrip('KM')) * scale)


def timed(fn, seconds, max_reps=1000):
    """(median, best) seconds of ``fn`` over repetitions run for about ``seconds``."""
    fn()                                   # warm-up (allocations, lookup tables)
    times, start = [], time.perf_counter()
    while len(times) < max_reps and (time.perf_counter() - start < seconds or len(times) < 3):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), min(times)


def gradient(n, seed=0):
    return (np.random.RandomState(seed).randn(n) * 0.5).astype(np.float32)


def measure_scheme(spec, n, seconds):
    res = spec.residuals()
    grad = gradient(n)
    (payload,) = res.encode(0, grad)
    for _ in range(3):             # a steady-state residual, not the first push's
        (payload,) = res.encode(0, grad)
    pack = timed(lambda: res.encode(0, grad), seconds)
    unpack = timed(lambda: spec.decode(payload, n), seconds)
    return pack, unpack, payload.nbytes / n


def measure_mxnet(threshold, n, seconds):
    import mxnet as mx
    from ssdsgd.testing import mxnet_compression as M
    if not M.available():
        return None
    q = M.MXNet2Bit(threshold)
    fn = q._fn
    g = mx.nd.array(gradient(n))
    r = mx.nd.zeros(n)
    out = mx.nd.zeros((-(-n // 16),))
    deq = mx.nd.zeros(n)

    def pack():
        fn['quantize'](q._this, g.handle, out.handle, r.handle, 0)
        out.wait_to_read()

    def unpack():
        fn['dequantize'](q._this, out.handle, deq.handle, 0)
        deq.wait_to_read()
    return timed(pack, seconds), timed(unpack, seconds), 4 * (-(-n // 16)) / n


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--sizes', default='16K,1M,25M', help='float32 elements per key')
    ap.add_argument('--seconds', type=float, default=0.5, help='per figure')
    ap.add_argument('--budget', type=float, default=300, help='seconds for the whole run')
    ap.add_argument('--no-mxnet', action='store_true', help="skip MXNet's own kernel")
    ap.add_argument('--json', help='also write the rows here')
    args = ap.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(',')]
    rows, start = [], time.perf_counter()
    print(f"codec cost, MB/s of float32 gradient (MB = 1e6 B); OMP_NUM_THREADS="
          f"{os.environ.get('OMP_NUM_THREADS', 'unset')}, {os.cpu_count()} cores")
    print("median (best) over the repetitions; on a shared machine the best is closer to "
          "the code's own cost")
    print(f"{'scheme':<18}{'elements':>10}{'pack MB/s':>18}{'unpack MB/s':>18}"
          f"{'wire B/elem':>13}")
    plan = [(name, n) for name in SCHEMES for n in sizes]
    if not args.no_mxnet:
        plan += [('2bit (MXNet C++)', n) for n in sizes]
    for name, n in plan:
        if time.perf_counter() - start > args.budget:
            print(f"(budget of {args.budget:g} s spent: {name} at {n} elements and later "
                  f"rows skipped)")
            break
        if name.endswith('(MXNet C++)'):
            got = measure_mxnet(SCHEMES['2bit']['threshold'], n, args.seconds)
            if got is None:
                print(f"{name:<18}{n:>10}  (this libmxnet does not export the symbols)")
                continue
        else:
            got = measure_scheme(C.Compression.from_params(SCHEMES[name]), n, args.seconds)
        (pack, pack_best), (unpack, unpack_best), wire = got
        mb = 4 * n / 1e6
        row = {'scheme': name, 'elements': n, 'pack_MBps': mb / pack,
               'pack_MBps_best': mb / pack_best, 'unpack_MBps': mb / unpack,
               'unpack_MBps_best': mb / unpack_best, 'wire_bytes_per_element': wire}
        rows.append(row)
        both = [f"{row[k]:.0f} ({row[k + '_best']:.0f})" for k in ('pack_MBps', 'unpack_MBps')]
        print(f"{name:<18}{n:>10}{both[0]:>18}{both[1]:>18}{wire:>13.4f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == '__main__':
    main()
