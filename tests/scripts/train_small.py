"""Train a tiny deterministic Gluon network through a kvstore and save the final weights.

    python tests/scripts/train_small.py --kvstore dist_sync --steps 20 --out DIR [--bn]

Each worker trains on its own shard of a fixed synthetic data set (chosen by ``kv.rank``)
with ``gluon.Trainer(..., 'sgd', lr 0.1, momentum 0.9, wd 1e-4, kvstore=kv)`` and writes

    DIR/init-rank{rank}.npz     parameters right after initialization (before any step)
    DIR/weights-rank{rank}.npz  parameters after the last step
    DIR/meta-rank{rank}.json    rank, num_workers, kvstore, per-step losses, and for each
                                npz key the parameter's name, shape and grad_req

npz keys are ``{index:03d}_{name}`` in ``net.collect_params()`` order, with the name
stripped of the network's auto-generated prefix, so they match between processes.
Parameters with grad_req 'null' (BatchNorm running statistics) are not synchronized by
a kvstore after the initial broadcast; each worker's values follow its own shard.

Everything is seeded, so two runs of the same kvstore and the same job shape give the
same weights; ``ssd_sync`` with SSDSGD_ALGORITHM=ssgd should match ``dist_sync``.
"""
import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np
import mxnet as mx
from mxnet import autograd, gluon

NUM_SAMPLES = 2048
NUM_FEATURES = 20
NUM_CLASSES = 10
HIDDEN = 16
DATA_SEED = 1234


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--kvstore', required=True, help="e.g. dist_sync, ssd_sync, local")
    p.add_argument('--steps', type=int, default=20)
    p.add_argument('--out', required=True, help='directory for the npz/json files')
    p.add_argument('--bn', action='store_true', help='add a BatchNorm after the first Dense')
    p.add_argument('--batch', type=int, default=16, help='per-worker batch size')
    p.add_argument('--seed', type=int, default=0, help='seed for mx.random and np.random')
    p.add_argument('--hidden', type=int, default=HIDDEN, help='units of the hidden layer')
    return p.parse_args(argv)


def make_kvstore(name):
    if name == 'ssd_sync':
        try:
            import ssdsgd  # noqa: F401  registers the 'ssd_sync' KVStore
        except ImportError:
            sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
            import ssdsgd  # noqa: F401
    return mx.kv.create(name)


def make_data():
    """A fixed, learnable 10-class problem: labels of a random linear teacher."""
    rng = np.random.RandomState(DATA_SEED)
    x = rng.randn(NUM_SAMPLES, NUM_FEATURES).astype(np.float32)
    teacher = rng.randn(NUM_FEATURES, NUM_CLASSES).astype(np.float32)
    y = np.argmax(x @ teacher, axis=1).astype(np.float32)
    return x, y


def shard(x, y, rank, num_workers):
    per = len(x) // num_workers
    return x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]


def batches(x, y, batch, steps):
    """``steps`` consecutive batches, wrapping around the shard."""
    for s in range(steps):
        idx = (np.arange(batch) + s * batch) % len(x)
        yield mx.nd.array(x[idx]), mx.nd.array(y[idx])


def make_net(bn, hidden=HIDDEN):
    net = gluon.nn.Sequential()
    with net.name_scope():
        if bn:
            net.add(gluon.nn.Dense(hidden, in_units=NUM_FEATURES, use_bias=False),
                    gluon.nn.BatchNorm(in_channels=hidden),
                    gluon.nn.Activation('relu'))
        else:
            net.add(gluon.nn.Dense(hidden, in_units=NUM_FEATURES, activation='relu'))
        net.add(gluon.nn.Dense(NUM_CLASSES, in_units=hidden))
    net.initialize(mx.init.Xavier(magnitude=2.0))
    return net


def snapshot(net):
    """{key: array} and [{key, name, shape, grad_req}] in collect_params() order."""
    prefix = net.prefix
    arrays, info = {}, []
    for i, (name, param) in enumerate(net.collect_params().items()):
        short = name[len(prefix):] if name.startswith(prefix) else name
        key = f'{i:03d}_{short}'
        arrays[key] = param.data().asnumpy()   # waits for pending pulls/updates
        info.append({'key': key, 'name': short, 'shape': list(arrays[key].shape),
                     'grad_req': param.grad_req})
    return arrays, info


def main(argv=None):
    args = parse_args(argv)
    mx.random.seed(args.seed)
    np.random.seed(args.seed)

    kv = make_kvstore(args.kvstore)
    rank, num_workers = kv.rank, kv.num_workers
    x, y = shard(*make_data(), rank, num_workers)

    net = make_net(args.bn, args.hidden)
    init_arrays, _ = snapshot(net)
    trainer = gluon.Trainer(net.collect_params(), 'sgd',
                            {'learning_rate': 0.1, 'momentum': 0.9, 'wd': 1e-4},
                            kvstore=kv)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()

    losses = []
    for data, label in batches(x, y, args.batch, args.steps):
        with autograd.record():
            loss = loss_fn(net(data), label)
        loss.backward()
        trainer.step(args.batch)
        losses.append(float(loss.mean().asscalar()))

    arrays, info = snapshot(net)   # .asnumpy(): the values after the last update
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    np.savez(out / f'init-rank{rank}.npz', **init_arrays)
    np.savez(out / f'weights-rank{rank}.npz', **arrays)
    meta = {'rank': rank, 'num_workers': num_workers, 'kvstore': args.kvstore,
            'kvstore_type': kv.type, 'steps': args.steps, 'batch': args.batch,
            'bn': args.bn, 'seed': args.seed, 'pid': os.getpid(),
            'update_on_kvstore': trainer._update_on_kvstore,
            'losses': losses, 'params': info,
            'kv_metrics': kv.metrics() if hasattr(kv, 'metrics') else None}
    (out / f'meta-rank{rank}.json').write_text(json.dumps(meta, indent=1))

    if hasattr(kv, 'close'):
        kv.close()
    print(f'train_small rank={rank} num_workers={num_workers} kvstore={args.kvstore} '
          f'steps={args.steps} first_loss={losses[0] if losses else float("nan"):.4f} '
          f'last_loss={losses[-1] if losses else float("nan"):.4f} out={out}', flush=True)


if __name__ == '__main__':
    main()
