"""A worker that finishes its part of the job (one Trainer step on ssd_sync, then
``kv.close()``: the scheduler has its FINISH) and then, as rank 1, stays alive until it is
killed (at most 120 s): a process killed after it finished (issue 30, item 6)."""
import os
import sys
import time

import mxnet as mx
from mxnet import autograd, gluon

import ssdsgd  # noqa: F401

out, rank = sys.argv[1], int(os.environ["SSDSGD_RANK"])
net = gluon.nn.Dense(1)
net.initialize()
trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1},
                        kvstore="ssd_sync")
with autograd.record():
    loss = net(mx.nd.ones((4, 3))).sum()
loss.backward()
trainer.step(4)
trainer._kvstore.close()
if rank == 1:
    with open(os.path.join(out, "finished-rank1.tmp"), "w") as f:
        f.write(str(os.getpid()))
    os.replace(os.path.join(out, "finished-rank1.tmp"), os.path.join(out, "finished-rank1"))
    time.sleep(120)
