"""Train train_small.py's network with kv.push / kv.pull (no gluon.Trainer), optionally with
gradient compression, and save the final weights like train_small.py does.

    python tests/scripts/push_pull_train.py --kvstore dist_sync --steps 20 --out DIR \
        [--compression '{"type": "2bit", "threshold": 0.5}'] [--hidden 64]

MXNet 1.9.1's dist_sync refuses compression with pushpull ("Compression not supported
with PushPull"), which the stock Trainer calls, so a compressed native job has to push and
pull itself; this is that job. The optimizer runs on the servers (kv.set_optimizer), each
worker pushes its raw gradient per key and pulls the new weights, as the Trainer would
with update_on_kvstore. Keys are the parameters' positions in collect_params(). With
--hidden 64 the first weight has 1280 elements: set MXNET_KVSTORE_BIGARRAY_BOUND (native)
or SSDSGD_BIGARRAY_BOUND (ssd_sync) below that to split it over the servers.
"""
import argparse
import json
import os
import sys
from pathlib import Path

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_small as T  # noqa: E402

LR, MOMENTUM, WD = 0.1, 0.9, 1e-4


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--kvstore', required=True)
    p.add_argument('--steps', type=int, default=20)
    p.add_argument('--out', required=True)
    p.add_argument('--compression', default=None, help='JSON for kv.set_gradient_compression')
    p.add_argument('--hidden', type=int, default=T.HIDDEN)
    p.add_argument('--batch', type=int, default=16)
    p.add_argument('--seed', type=int, default=0)
    return p.parse_args(argv)


def make_net(hidden):
    net = gluon.nn.Sequential()
    with net.name_scope():
        net.add(gluon.nn.Dense(hidden, in_units=T.NUM_FEATURES, activation='relu'),
                gluon.nn.Dense(T.NUM_CLASSES, in_units=hidden))
    net.initialize(mx.init.Xavier(magnitude=2.0))
    return net


def make_optimizer(batch):
    return mx.optimizer.create('sgd', learning_rate=LR, momentum=MOMENTUM, wd=WD,
                               rescale_grad=1.0 / batch)


def main(argv=None):
    args = parse_args(argv)
    mx.random.seed(args.seed)
    np.random.seed(args.seed)
    kv = T.make_kvstore(args.kvstore)
    if args.compression:
        kv.set_gradient_compression(json.loads(args.compression))
    kv.set_optimizer(make_optimizer(args.batch))
    rank, num_workers = kv.rank, kv.num_workers
    x, y = T.shard(*T.make_data(), rank, num_workers)
    net = make_net(args.hidden)
    params = list(net.collect_params().values())
    init_arrays, _ = T.snapshot(net)
    for i, p in enumerate(params):
        kv.init(i, p.data())
    for i, p in enumerate(params):
        kv.pull(i, out=p.data())       # everyone starts from rank 0's values
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    losses = []
    for data, label in T.batches(x, y, args.batch, args.steps):
        with autograd.record():
            loss = loss_fn(net(data), label)
        loss.backward()
        for i, p in enumerate(params):
            kv.push(i, p.grad(), priority=-i)
        for i, p in enumerate(params):
            kv.pull(i, out=p.data(), priority=-i)
        losses.append(float(loss.mean().asscalar()))

    arrays, info = T.snapshot(net)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    np.savez(out / f'init-rank{rank}.npz', **init_arrays)
    np.savez(out / f'weights-rank{rank}.npz', **arrays)
    meta = {'rank': rank, 'num_workers': num_workers, 'kvstore': args.kvstore,
            'steps': args.steps, 'batch': args.batch, 'hidden': args.hidden,
            'compression': args.compression, 'losses': losses, 'params': info}
    (out / f'meta-rank{rank}.json').write_text(json.dumps(meta, indent=1))
    if hasattr(kv, 'close'):
        kv.close()
    print(f'push_pull_train rank={rank} kvstore={args.kvstore} compression={args.compression} '
          f'loss {losses[0]:.4f} -> {losses[-1]:.4f}', flush=True)


if __name__ == '__main__':
    main()
