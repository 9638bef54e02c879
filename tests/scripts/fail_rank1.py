"""Rank 1 raises after joining; rank 0 waits in a pull that can never complete."""
import mxnet as mx
import ssdsgd  # noqa: F401

kv = mx.kv.create("ssd_sync")
kv.init(0, mx.nd.zeros(3))
if kv.rank == 1:
    raise ValueError("bad batch shape in my data")
kv.push(0, mx.nd.ones(3))
kv.pull(0, out=mx.nd.zeros(3))   # needs rank 1's push: only the abort ends this wait
