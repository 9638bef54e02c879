"""kv.pushpull called key by key by the script (no Trainer, no optimizer: the servers
return the sum of the workers' pushes), as a ps-lite user would: every key queued, then
one wait. Prints one line per check; exit code 0 only if every sum is right.

--hold DIR   rank 1 pushes round r only once rank 0 has written DIR/r: rank 0's
             pushpull calls must return before any reply can exist (else both wait
             until rank 1 gives up, exit 4).
--die DIR    rank 0 writes DIR/pending once its pushpulls are queued (the test then
             kills the server; rank 1 never pushes, it waits in a barrier), waits for
             its outputs and makes one more kvstore call, which must raise: prints
             'error: <type>: <message>'.
--vary       the arrays change between rounds, as a script may: every third key is
             pulled into its gradient (no out=), and from the second round on every
             third key gets fresh gradient and output arrays each round (the worker
             keeps each key's engine operation while the arrays stay the same)."""
import argparse
import os
import sys
import time

import mxnet as mx
import numpy as np
import ssdsgd  # noqa: F401
from cues import wait_for_file

p = argparse.ArgumentParser()
p.add_argument("--keys", type=int, default=200)
p.add_argument("--elems", type=int, default=64)
p.add_argument("--rounds", type=int, default=3)
p.add_argument("--hold")
p.add_argument("--die")
p.add_argument("--vary", action="store_true")
args = p.parse_args()


def wait_for(path, what, timeout=20):
    if not wait_for_file(path, timeout):
        print(f"rank 1: {what} never came", flush=True)
        sys.exit(4)


kv = mx.kv.create("ssd_sync")
keys = list(range(args.keys))
grads = [mx.nd.zeros(args.elems) for _ in keys]
outs = [mx.nd.zeros(args.elems) for _ in keys]
for key, out in zip(keys, outs):
    kv.init(key, out)
for rnd in range(args.rounds):
    for i, g in enumerate(grads):
        g[:] = (kv.rank + 1) * (i + 1) + rnd
    if args.die and kv.rank == 1:      # never pushes: rank 0's pushpulls stay pending
        try:
            kv.barrier()
        except Exception as e:
            print(f"rank 1 error: {type(e).__name__}: {e}", flush=True)
        sys.exit(0)
    if args.hold and kv.rank == 1:
        wait_for(os.path.join(args.hold, str(rnd)), f"rank 0's round {rnd}")
    results = outs
    if args.vary:
        if rnd:
            for i in range(1, len(keys), 3):
                grads[i] = mx.nd.array(grads[i].asnumpy())
                outs[i] = mx.nd.zeros(args.elems)
        results = [g if i % 3 == 0 else out for i, (g, out) in enumerate(zip(grads, outs))]
    for i, (key, g, out) in enumerate(zip(keys, grads, outs)):
        kv.pushpull(key, g, out=None if args.vary and i % 3 == 0 else out)
    if args.hold and kv.rank == 0:
        open(os.path.join(args.hold, str(rnd)), "w").close()
        print(f"round {rnd}: pushpull returned before any reply", flush=True)
    if args.die:
        open(os.path.join(args.die, "pending"), "w").close()
        t0 = time.monotonic()
        mx.nd.waitall()
        print(f"waitall returned after {time.monotonic() - t0:.1f} s", flush=True)
        try:
            kv.barrier()
        except Exception as e:
            print(f"rank 0 error: {type(e).__name__}: {e}", flush=True)
            sys.exit(3)
        print("no error", flush=True)
        sys.exit(0)
    got = np.stack([out.asnumpy() for out in results])
    # 2 workers: (1 + 2) (i + 1) + 2 rnd
    want = np.array([[3 * (i + 1) + 2 * rnd] * args.elems for i in range(len(keys))], np.float32)
    if not np.array_equal(got, want):
        bad = np.argwhere(got != want)[0]
        print(f"rank {kv.rank} round {rnd}: key {bad[0]} is {got[tuple(bad)]}, "
              f"expected {want[tuple(bad)]}", flush=True)
        sys.exit(1)
    print(f"rank {kv.rank} round {rnd}: {len(keys)} sums ok", flush=True)
steps = {str(k): v for k, v in kv.metrics().items()}["ssgd"]
print(f"rank {kv.rank}: {steps} ssgd steps", flush=True)
kv.close()
