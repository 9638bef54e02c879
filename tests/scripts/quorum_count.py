"""Every push counted: worker r's push of step t is 1 at element r*T + t and 0 elsewhere,
the servers' sgd has lr 1 and no momentum, so each element of the final weights is minus
the number of times that push was applied."""
import argparse
import os

import mxnet as mx
import numpy as np
import ssdsgd  # noqa: F401
from ssdsgd.slowdown import Slowdown

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--steps", type=int, default=8)
p.add_argument("--progress", action="store_true", help="print each step's end")
args = p.parse_args()

kv = mx.kv.create("ssd_sync")
size = kv.num_workers * args.steps
slow = Slowdown(os.environ.get("SSDSGD_SLOWDOWN", "none"), kv.rank, kv.num_workers)
kv.set_optimizer(mx.optimizer.SGD(learning_rate=1.0, rescale_grad=1.0))
kv.init(0, mx.nd.zeros(size))
kv.barrier()
weights = mx.nd.zeros(size)
for t in range(args.steps):
    slow.after_compute(t)
    grad = np.zeros(size, np.float32)
    grad[kv.rank * args.steps + t] = 1.0
    kv.pushpull(0, mx.nd.array(grad), out=weights)
    if args.progress:
        print(f"quorum_count: rank {kv.rank} step {t} done", flush=True)
kv.close()
np.save(os.path.join(args.out, f"final-rank{kv.rank}.npy"), weights.asnumpy())
