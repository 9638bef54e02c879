"""A worker script that forgot ``import ssdsgd``: kvstore='ssd_sync' then names MXNet's own
local store (or none), so each worker trains alone and exits 0 (issue 24)."""
import mxnet as mx
from mxnet import autograd, gluon

net = gluon.nn.Dense(1)
net.initialize()
trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1},
                        kvstore="ssd_sync")
x = mx.nd.ones((4, 3))
with autograd.record():
    loss = net(x).sum()
loss.backward()
trainer.step(4)
print("trained alone:", trainer._kvstore)
