"""kv.push / kv.pull / kv.pushpull without an optimizer (update_on_kvstore=False style):
the servers keep the sum of the workers' values, as MXNet's dist_sync does."""
import sys

import mxnet as mx
import ssdsgd  # noqa: F401

kv = mx.kv.create("ssd_sync")
kv.init(3, mx.nd.zeros((2, 3)))
kv.init([4, 5], [mx.nd.zeros(4), mx.nd.zeros(7)])
pushed = mx.nd.ones((2, 3)) * (kv.rank + 1)
kv.push(3, pushed)
out = mx.nd.zeros((2, 3))
kv.pull(3, out=out)
vals = [mx.nd.ones(4) * 10, mx.nd.ones(7) * (kv.rank + 1)]
kv.pushpull([4, 5], vals)          # out=None: the result replaces the pushed values
assert pushed.asnumpy().min() == kv.rank + 1, "push must not modify what was pushed"
print(f"rank {kv.rank}: pull {out.asnumpy().ravel().tolist()} "
      f"pushpull {vals[0].asnumpy()[0]} {vals[1].asnumpy()[0]}", flush=True)
kv.close()
sys.exit(0)
