"""One worker of bench/transport.py (run it through that script, not by hand).

    python bench/transport_worker.py --kvstore dist_sync|ssd_sync --out DIR
        [--reps 5] [--big-mb 100] [--small-keys 160] [--small-elems 4096] [--small-steps 50]

Measures, on this worker:
  big    kv.pushpull of one float32 array of --big-mb MB (decimal, 100 MB = 25M elements)
         to a key of its own, --reps timed repetitions after one warm-up; GB/s is
         (bytes pushed + bytes pulled) / seconds, i.e. 2 * size / time per repetition.
  keys   ms per round of kv.pushpull called key by key by the script (no Trainer, no
         optimizer) over --small-keys keys of --small-elems float32, then waiting for
         every output; --small-steps timed rounds after one warm-up round.
  small  ms per trainer.step of a stock gluon.Trainer (sgd, momentum 0.9) over
         --small-keys parameters of --small-elems float32 each, kvstore=kv: the Trainer
         calls pushpull once per parameter.  The backward pass that refreshes the
         gradients runs outside the timed region; the time is trainer.step plus waiting
         for every parameter to be readable.  The first step (init + broadcast) is a
         warm-up and not timed.
and writes DIR/result-rank{kv.rank}.json.
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import mxnet as mx
from mxnet import autograd, gluon

# Keys of the raw pushpull part; the Trainer uses 0 .. small_keys-1.
BIG_KEY = 1_000_000
SYNC_KEY = 1_000_001
KEYS_BASE = 2_000_000    # the key-by-key pushpull part


def parse_args(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument('--kvstore', required=True)
    p.add_argument('--out', required=True)
    p.add_argument('--reps', type=int, default=5)
    p.add_argument('--big-mb', type=float, default=100.0)
    p.add_argument('--small-keys', type=int, default=160)
    p.add_argument('--small-elems', type=int, default=4096)
    p.add_argument('--small-steps', type=int, default=50)
    return p.parse_args(argv)


def make_kvstore(name):
    if name == 'ssd_sync':
        try:
            import ssdsgd  # noqa: F401  registers the 'ssd_sync' KVStore
        except ImportError:
            sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
            import ssdsgd  # noqa: F401
    return mx.kv.create(name)


def sync(kv, buf):
    """Wait until every worker got here: a synchronous pushpull of a tiny key."""
    kv.pushpull(SYNC_KEY, buf, out=buf)
    buf.wait_to_read()


def bench_big(kv, args, sync_buf):
    n = int(args.big_mb * 1e6) // 4
    grad = mx.nd.ones((n,), dtype='float32')
    out = mx.nd.zeros((n,), dtype='float32')
    kv.init(BIG_KEY, out)
    times = []
    for rep in range(args.reps + 1):       # rep 0 is the warm-up
        # Native dist kvstores with one device pull the result into the pushed array
        # itself, so refill it (untimed) to push the same values every time.
        grad[:] = 1
        sync(kv, sync_buf)
        t0 = time.perf_counter()
        kv.pushpull(BIG_KEY, grad, out=out)
        out.wait_to_read()
        if rep:
            times.append(time.perf_counter() - t0)
    # With no optimizer set the servers store the sum of the workers' pushes.
    expected = float(kv.num_workers)
    got = float(out[0].asscalar())
    nbytes = 4 * n
    return {'elements': n, 'bytes': nbytes, 'times_s': times,
            'gbps': [2 * nbytes / t / 1e9 for t in times],
            'check_value': got, 'check_ok': abs(got - expected) < 1e-6}


def bench_keys(kv, args, sync_buf):
    """kv.pushpull called key by key by the script itself (no Trainer, no optimizer: the
    servers return the sum), --small-keys keys of --small-elems float32, then waiting for
    every output; --small-steps timed rounds after one warm-up round."""
    keys = [KEYS_BASE + i for i in range(args.small_keys)]
    grads = [mx.nd.ones((args.small_elems,)) for _ in keys]
    outs = [mx.nd.zeros((args.small_elems,)) for _ in keys]
    for key, out in zip(keys, outs):
        kv.init(key, out)
    times = []
    for rnd in range(args.small_steps + 1):      # round 0 is the warm-up
        for grad in grads:      # native pulls into the pushed array itself (see bench_big)
            grad[:] = 1
        sync(kv, sync_buf)
        t0 = time.perf_counter()
        for key, grad, out in zip(keys, grads, outs):
            kv.pushpull(key, grad, out=out)
        for out in outs:
            out.wait_to_read()
        if rnd:
            times.append(time.perf_counter() - t0)
    got = float(outs[-1][0].asscalar())
    return {'keys': args.small_keys, 'elements_per_key': args.small_elems,
            'times_s': times, 'ms_per_step': [1e3 * t for t in times],
            'check_ok': abs(got - kv.num_workers) < 1e-6}


def bench_small(kv, args):
    params = []
    for i in range(args.small_keys):
        p = gluon.Parameter(f'p{i:04d}', shape=(args.small_elems,))
        p.initialize(mx.init.Zero())
        params.append(p)
    trainer = gluon.Trainer(params, 'sgd', {'learning_rate': 0.01, 'momentum': 0.9},
                            kvstore=kv)
    scale = mx.nd.full((args.small_elems,), 1e-3)
    times = []
    for step in range(args.small_steps + 1):    # step 0 is the warm-up (init, broadcast)
        with autograd.record():
            loss = mx.nd.add_n(*[(p.data() * scale).sum() for p in params])
        loss.backward()
        mx.nd.waitall()
        t0 = time.perf_counter()
        trainer.step(1)
        for p in params:
            p.data().wait_to_read()
        if step:
            times.append(time.perf_counter() - t0)
    return {'keys': args.small_keys, 'elements_per_key': args.small_elems,
            'times_s': times, 'ms_per_step': [1e3 * t for t in times],
            'update_on_kvstore': trainer._update_on_kvstore}


def main(argv=None):
    args = parse_args(argv)
    kv = make_kvstore(args.kvstore)
    sync_buf = mx.nd.zeros((1,))
    kv.init(SYNC_KEY, sync_buf)
    # The raw pushpull first: in native dist_sync the Trainer's set_optimizer would make
    # the servers apply SGD to every key afterwards, including the big one.
    result = {'kvstore': args.kvstore, 'kvstore_type': kv.type, 'rank': kv.rank,
              'num_workers': kv.num_workers, 'pid': os.getpid(),
              'big': bench_big(kv, args, sync_buf),
              'keys': bench_keys(kv, args, sync_buf),
              'small': bench_small(kv, args)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f'result-rank{kv.rank}.json').write_text(json.dumps(result, indent=1))
    if hasattr(kv, 'close'):
        kv.close()
    big, small = result['big'], result['small']
    print(f'transport_worker rank={kv.rank} kvstore={args.kvstore} '
          f'big={np.median(big["gbps"]):.3f}GB/s '
          f'keys={np.median(result["keys"]["ms_per_step"]):.2f}ms/round '
          f'small={np.median(small["ms_per_step"]):.2f}ms/step', flush=True)


if __name__ == '__main__':
    main()
