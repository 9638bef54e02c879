"""A worker for test_deferred_step: tiny.py's network, a stock gluon.Trainer on ssd_sync
(the algorithm the environment names), rank 1 sleeping SLOW s before each step; records
how long each Trainer.step held this worker's thread, the weights once every step is
done, the store's metrics, and after the close (which ends ssd on the global weights)
the weights again."""
import argparse
import json
import os
import sys
import time

import mxnet as mx
import numpy as np
from mxnet import gluon

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ssdsgd  # noqa: E402,F401  (registers ssd_sync)
import tiny  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--steps", type=int, default=3)
p.add_argument("--slow", type=float, default=1.0)
args = p.parse_args()
rank = int(os.environ["SSDSGD_RANK"])
net = tiny.make_net()
kv = mx.kv.create("ssd_sync")
trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1, "momentum": 0.9},
                        kvstore=kv)
trainer._optimizer.rescale_grad = 1.0 / 8
trainer._init_kvstore()
kv.barrier()
held = []
for t in range(args.steps):
    x, y = tiny.batch(rank, t)
    tiny.forward_backward(net, x, y)
    mx.nd.waitall()
    if rank == 1:
        time.sleep(args.slow)
    a = time.perf_counter()
    trainer.step(x.shape[0])
    held.append(time.perf_counter() - a)
mx.nd.waitall()
np.savez(os.path.join(args.out, f"weights-rank{rank}.npz"),
         **{f"p{i}": q.data().asnumpy() for i, q in enumerate(tiny.params(net))})
with open(os.path.join(args.out, f"held-rank{rank}.json"), "w") as f:
    json.dump(held, f)
with open(os.path.join(args.out, f"metrics-rank{rank}.json"), "w") as f:
    json.dump(kv.metrics(), f)
kv.close()
np.savez(os.path.join(args.out, f"final-rank{rank}.npz"),
         **{f"p{i}": q.data().asnumpy() for i, q in enumerate(tiny.params(net))})
