"""A worker for the dynamic data oracle test: tiny.py's network on ssd_sync with the stock
gluon.Trainer, its batches dealt by the scheduler (ssdsgd.data.dynamic.ChunkFeed: the
job's budget, each epoch's chunks to whichever worker asks next), each step delayed as
debug.slowdown (SSDSGD_SLOWDOWN) says for this rank. Writes the global chunks it trained
in order, its weights before its end and the final ones."""
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
from ssdsgd.data.dynamic import ChunkFeed, chunk_plan  # noqa: E402
from ssdsgd.slowdown import Slowdown  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--per-epoch", type=int, required=True, help="chunks per epoch")
p.add_argument("--epochs", type=int, required=True)
p.add_argument("--seed", type=int, default=0)
args = p.parse_args()

rank = int(os.environ["SSDSGD_RANK"])
net = tiny.make_net()
kv = mx.kv.create("ssd_sync")
n = kv.num_workers
slow = Slowdown(os.environ.get("SSDSGD_SLOWDOWN", "none"), rank, n)
trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1, "momentum": 0.9},
                        kvstore=kv)
trainer._optimizer.rescale_grad = 1.0 / 8
trainer._init_kvstore()
kv.barrier()
data = tiny.ChunkData(args.per_epoch * 8)
plan = chunk_plan(args.per_epoch, args.per_epoch * args.epochs // n, n, 0)
feed = ChunkFeed(kv, data, args.seed, 8, plan)
trained, t = [], 0
for epoch in range(args.epochs):
    for _, (x, y) in feed.epoch(epoch):
        trained.append(feed.position - 1)       # the global chunk this step trains
        tiny.forward_backward(net, x, y)
        slow.after_compute(t)
        trainer.step(x.shape[0])
        t += 1
    if feed.over:
        break
mx.nd.waitall()
np.savez(os.path.join(args.out, f"local-rank{rank}.npz"),
         **{f"p{i}": q.data().asnumpy() for i, q in enumerate(tiny.params(net))})
kv.close()
np.savez(os.path.join(args.out, f"final-rank{rank}.npz"),
         **{f"p{i}": q.data().asnumpy() for i, q in enumerate(tiny.params(net))})
with open(os.path.join(args.out, f"chunks-rank{rank}.json"), "w") as f:
    json.dump({"chunks": trained, "trained": {str(k): v for k, v in feed.trained.items()}}, f)
print(f"rank {rank} done: {len(trained)} chunks", flush=True)
