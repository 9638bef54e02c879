"""The tiny network and data the cluster tests train: the same in every worker process and
in the test process that computes the reference (same seed -> same initial weights)."""
import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

IN, OUT = 12, 5


def make_net(kind="mlp", seed=7):
    mx.random.seed(seed)
    np.random.seed(seed)
    net = gluon.nn.Sequential()
    if kind == "bn":
        net.add(gluon.nn.Dense(16), gluon.nn.BatchNorm(), gluon.nn.Activation("relu"),
                gluon.nn.Dense(OUT))
    else:
        net.add(gluon.nn.Dense(16, activation="tanh"), gluon.nn.Dense(OUT))
    net.initialize(mx.init.Xavier(magnitude=2.0))
    net(mx.nd.zeros((1, IN)))   # materialize the shapes
    return net


def batch(worker, step, size=8):
    """Worker `worker`'s batch at step `step`: a fixed function of both (a learnable
    linear rule plus noise), so any process can recompute it."""
    rs = np.random.RandomState(10_000 * step + worker)
    x = rs.normal(size=(size, IN)).astype(np.float32)
    w = np.random.RandomState(123).normal(size=(IN, OUT))
    y = np.argmax(x @ w + 0.3 * rs.normal(size=(size, OUT)), axis=1).astype(np.float32)
    return mx.nd.array(x), mx.nd.array(y)


LOSS = gluon.loss.SoftmaxCrossEntropyLoss()


def forward_backward(net, x, y):
    with autograd.record():
        loss = LOSS(net(x), y)
    loss.backward()
    return float(loss.mean().asscalar())


def params(net):
    """The Trainer's keys are the parameters' positions in collect_params()."""
    return list(net.collect_params().values())


class ChunkData:
    """A data set for dynamic data (ssdsgd.data.dynamic.ChunkFeed): ``n_train`` samples,
    a batch a fixed function of its indices (so the test process can recompute the batch
    of any chunk a worker was dealt, from the epoch's permutation)."""

    def __init__(self, n_train, size=8):
        self.n_train, self.size = n_train, size

    def train_batch(self, idx, rng=None):
        return batch(int(idx[0]), int(np.asarray(idx, np.int64).sum()) % 997, len(idx))
