"""A worker for the quorum tests: tiny.py's network on kvstore='ssd_sync' with the stock
gluon.Trainer, each step delayed as debug.slowdown (SSDSGD_SLOWDOWN) says for this rank (a
straggler), started together with the others (a barrier), so the arrival order is the
one the delays make."""
import argparse
import json
import os
import sys

import mxnet as mx
import numpy as np
from mxnet import gluon

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ssdsgd  # noqa: E402,F401  (registers ssd_sync)
import tiny  # noqa: E402
from ssdsgd.slowdown import Slowdown  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--steps", type=int, default=8)
p.add_argument("--cosine", type=int, default=0,
               help="a cosine lr schedule over this many updates (0: a constant lr)")
args = p.parse_args()

rank = int(os.environ["SSDSGD_RANK"])
os.makedirs(args.out, exist_ok=True)
net = tiny.make_net()
kv = mx.kv.create("ssd_sync")
slow = Slowdown(os.environ.get("SSDSGD_SLOWDOWN", "none"), rank, kv.num_workers)
opt_params = {"learning_rate": 0.1, "momentum": 0.9}
if args.cosine:
    opt_params["lr_scheduler"] = mx.lr_scheduler.CosineScheduler(
        max_update=args.cosine, base_lr=0.1, final_lr=0.0)
trainer = gluon.Trainer(net.collect_params(), "sgd", opt_params, kvstore=kv)
# Keys and optimizer on the servers before the clock starts; step() would first set the
# optimizer's rescale_grad (1 / batch size) and then send it, so do that here too.
trainer._optimizer.rescale_grad = 1.0 / tiny.batch(rank, 0)[0].shape[0]
trainer._init_kvstore()
kv.barrier()
for t in range(args.steps):
    x, y = tiny.batch(rank, t)
    tiny.forward_backward(net, x, y)
    slow.after_compute(t)
    trainer.step(x.shape[0])
np.savez(os.path.join(args.out, f"local-rank{rank}.npz"),
         **{f"p{i}": q.data().asnumpy() for i, q in enumerate(tiny.params(net))})
metrics = kv.metrics()
kv.close()
np.savez(os.path.join(args.out, f"final-rank{rank}.npz"),
         **{f"p{i}": q.data().asnumpy() for i, q in enumerate(tiny.params(net))})
record = kv.metrics().get("quorum_auto")      # sync.quorum: auto: server 0's record
if record is not None:
    with open(os.path.join(args.out, f"auto-rank{rank}.json"), "w") as f:
        json.dump(record, f)
print(f"rank {rank} done: "
      f"{json.dumps({k: metrics[k] for k in ('pushes', 'pulls', 'steps_on_engine')})}",
      flush=True)
