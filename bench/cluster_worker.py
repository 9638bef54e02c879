"""One worker of the emulated-cluster benchmark (started by ``python -m bench.cluster``).

    python bench/cluster_worker.py --kvstore dist_sync|dist_async|ssd_sync|none --out DIR
        --workload emulated --shapes FILE.json --compute-s 0.8 [--batch 32]
        --workload real --model cifar_resnet20_v1 [--image-size 32] [--batch 32]
        --workload digits [--epochs 20] [--batch 32] [--lr 0.1] [--eval-every 4]
        [--steps 20] [--warmup 2]

The same loop for every kvstore, so rows differ only in the kvstore:

    compute   emulated: time.sleep(compute_s) (stands in for a GPU's forward and backward:
              no CPU taken from the servers); real: forward + backward of a gluoncv model
              on a fixed synthetic batch, waited for (mx.nd.waitall)
    exchange  trainer.step(...) of a stock gluon.Trainer (sgd, momentum 0.9) on the
              kvstore, then waiting until every weight is readable (what the next forward
              would wait for); this is the time blocked on communication

``--warmup`` steps (kvstore init and broadcast; for ssd_sync the launcher's
SSDSGD_WARMUP_STEPS should equal it) run before a barrier; ``--steps`` timed steps follow.
For ssd_sync with algorithm ssd, the timed region ends with a pull of every weight as of
the last step, so pushes still in flight are paid for. Gradients are filled once (random,
small) and never recomputed in the emulated workload.

Writes DIR/result-rank{rank}.json: wall-clock start/end (time.time(), comparable across
processes on one machine), compute and blocked seconds, the host interface's byte
counters over the timed region (the one non-loopback device in the namespace), and for
ssd_sync its own counters.
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]


def parse_args(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument('--kvstore', required=True)
    p.add_argument('--out', required=True)
    p.add_argument('--workload', choices=['emulated', 'real', 'digits'], required=True)
    p.add_argument('--shapes', help='emulated: JSON file with the parameter shapes')
    p.add_argument('--compute-s', type=float, default=0.0, help='emulated: seconds per step')
    p.add_argument('--model', default='cifar_resnet20_v1', help='real: a gluoncv model name')
    p.add_argument('--image-size', type=int, default=32)
    p.add_argument('--classes', type=int, default=10)
    p.add_argument('--batch', type=int, default=32, help='samples per worker per step')
    p.add_argument('--steps', type=int, default=20, help='timed steps')
    p.add_argument('--warmup', type=int, default=2, help='untimed steps before the barrier')
    p.add_argument('--epochs', type=int, default=20, help='digits: epochs')
    p.add_argument('--lr', type=float, default=0.1, help='digits: lr (global-batch mean)')
    p.add_argument('--eval-every', type=int, default=4, help='digits: steps between evals')
    p.add_argument('--seed', type=int, default=0)
    return p.parse_args(argv)


# ---- helpers ---------------------------------------------------------------------------
def net_device():
    """The namespace's one non-loopback interface (None outside an emulated host)."""
    try:
        devs = [d for d in os.listdir('/sys/class/net') if d != 'lo']
    except OSError:
        return None
    return devs[0] if len(devs) == 1 else None


def read_counters(dev):
    if dev is None:
        return None
    base = f'/sys/class/net/{dev}/statistics'
    try:
        with open(f'{base}/tx_bytes') as f:
            tx = int(f.read())
        with open(f'{base}/rx_bytes') as f:
            rx = int(f.read())
    except OSError:
        return None
    return tx, rx


def make_kvstore(name):
    import mxnet as mx
    if name == 'none':
        return None
    if name == 'ssd_sync':
        try:
            import ssdsgd  # noqa: F401  registers 'ssd_sync'
        except ImportError:
            sys.path.insert(0, str(REPO))
            import ssdsgd  # noqa: F401
    return mx.kv.create(name)


def barrier(kv):
    if kv is None:
        _file_barrier()
        return
    if hasattr(kv, 'barrier'):
        kv.barrier()          # ssd_sync
    else:
        kv._barrier()         # MXNet's dist kvstores


def _file_barrier(timeout=600):
    """Without a kvstore (the compute-only row): line up the workers through files, so
    they all compute at the same time, as in the rows with a kvstore."""
    where, n = os.environ.get('BENCH_BARRIER_DIR'), int(os.environ.get('BENCH_NUM_WORKERS', '1'))
    if not where or n <= 1:
        return
    me = os.environ.get('BENCH_WORKER_INDEX', '0')
    Path(where).mkdir(parents=True, exist_ok=True)
    (Path(where) / f'ready-{me}').touch()
    deadline = time.monotonic() + timeout
    while len(list(Path(where).glob('ready-*'))) < n:
        if time.monotonic() > deadline:
            raise RuntimeError(f'file barrier in {where}: not all {n} workers arrived')
        time.sleep(0.005)


def kv_metrics(kv):
    if kv is not None and hasattr(kv, 'metrics'):
        try:
            return dict(kv.metrics())
        except Exception:     # noqa: BLE001 - a metric is never worth failing a run
            return None
    return None


def is_sync(kv):
    """Does the server sum N gradients per step (so Trainer.step gets N * batch)?"""
    if kv is None:
        return False
    if kv.type == 'ssd_sync':
        return os.environ.get('SSDSGD_ALGORITHM', 'ssd') != 'asgd'
    return 'async' not in kv.type


def drains(kv):
    """ssd_sync in the steps-delay stage leaves pushes in flight after a step returns."""
    return (kv is not None and kv.type == 'ssd_sync'
            and os.environ.get('SSDSGD_ALGORITHM', 'ssd') == 'ssd')


# ---- workloads -------------------------------------------------------------------------
def emulated_params(args):
    import mxnet as mx
    from mxnet import gluon
    spec = json.loads(Path(args.shapes).read_text())
    params = []
    rng_seed = args.seed
    mx.random.seed(rng_seed)
    for i, shape in enumerate(spec['shapes']):
        p = gluon.Parameter(f'p{i:04d}', shape=tuple(shape))
        p.initialize(mx.init.Zero())
        # a fixed, small gradient: pre-allocated once, pushed every step
        p.grad()[:] = mx.nd.random.uniform(-1e-3, 1e-3, shape=tuple(shape))
        params.append(p)
    mx.nd.waitall()
    return params


class RealModel:
    def __init__(self, args, ctx):
        import mxnet as mx
        from mxnet import gluon
        from gluoncv import model_zoo
        self.mx, self.autograd = mx, __import__('mxnet').autograd
        self.net = model_zoo.get_model(args.model, classes=args.classes, pretrained=False)
        self.net.initialize(mx.init.Xavier(rnd_type='gaussian', factor_type='in', magnitude=2),
                            ctx=ctx)
        self.net.hybridize(static_alloc=True, static_shape=True)
        rng = np.random.RandomState(args.seed)
        self.x = mx.nd.array(rng.rand(args.batch, 3, args.image_size, args.image_size),
                             ctx=ctx)
        self.y = mx.nd.array(rng.randint(0, args.classes, args.batch), ctx=ctx)
        self.loss = gluon.loss.SoftmaxCrossEntropyLoss()
        self.net(self.x)       # materialize the shapes
        mx.nd.waitall()

    def params(self):
        return list(self.net.collect_params().values())

    def compute(self):
        with self.autograd.record():
            loss = self.loss(self.net(self.x), self.y)
        loss.backward()
        self.mx.nd.waitall()


def run_throughput(args, kv):
    import mxnet as mx
    from mxnet import gluon
    ctx = mx.cpu()
    if args.workload == 'emulated':
        params, model = emulated_params(args), None
    else:
        model = RealModel(args, ctx)
        params = model.params()
    trainer = gluon.Trainer(params, 'sgd', {'learning_rate': 1e-4, 'momentum': 0.9},
                            kvstore=kv)
    num_workers = kv.num_workers if kv is not None else 1
    grad_batch = args.batch * (num_workers if is_sync(kv) else 1)
    trained = [i for i, p in enumerate(params) if p.grad_req != 'null']
    dev = net_device()

    def compute():
        if model is None:
            time.sleep(args.compute_s)
        else:
            model.compute()

    def exchange():
        trainer.step(grad_batch, ignore_stale_grad=True)
        mx.nd.waitall()

    for _ in range(args.warmup):
        compute()
        exchange()
    barrier(kv)
    c0, m0 = read_counters(dev), kv_metrics(kv)
    t_start = time.time()
    compute_s = blocked_s = 0.0
    step_ends = []
    for _ in range(args.steps):
        a = time.perf_counter()
        compute()
        b = time.perf_counter()
        exchange()
        c = time.perf_counter()
        compute_s += b - a
        blocked_s += c - b
        step_ends.append(time.time() - t_start)
    drain_s = 0.0
    if drains(kv):
        a = time.perf_counter()
        kv.pull(trained, out=[params[i].list_data() for i in trained])
        mx.nd.waitall()
        drain_s = time.perf_counter() - a
    t_end = time.time()
    c1, m1 = read_counters(dev), kv_metrics(kv)
    res = {'t_start': t_start, 't_end': t_end, 'steps': args.steps, 'batch': args.batch,
           'compute_s': compute_s, 'blocked_s': blocked_s, 'drain_s': drain_s,
           'step_ends': step_ends, 'net_dev': dev,
           'param_bytes': int(sum(params[i].data().size * 4 for i in trained)),
           'num_keys': len(trained)}
    if c0 and c1:
        res['tx_bytes'], res['rx_bytes'] = c1[0] - c0[0], c1[1] - c0[1]
    if m0 and m1:
        res['kv_metrics'] = {k: m1[k] - m0[k] for k in m1
                             if isinstance(m1.get(k), (int, float)) and
                             isinstance(m0.get(k), (int, float))}
        res['kv_metrics_end'] = {k: v for k, v in m1.items() if isinstance(v, (int, float, str))}
    return res


def run_digits(args, kv):
    import mxnet as mx
    from mxnet import autograd, gluon
    sys.path.insert(0, str(REPO))
    from ssdsgd.data import shard_indices
    from ssdsgd.data.digits import DigitsDataset
    from ssdsgd.models import digits_mlp, initializer
    mx.random.seed(args.seed)
    np.random.seed(args.seed)
    ds = DigitsDataset()
    rank = kv.rank if kv is not None else 0
    num_workers = kv.num_workers if kv is not None else 1
    spe = ds.n_train // (num_workers * args.batch)
    total = args.epochs * spe
    net = digits_mlp(10)
    net.initialize(initializer('digits_mlp'))
    net.hybridize(static_alloc=True, static_shape=True)
    sched = mx.lr_scheduler.CosineScheduler(max_update=total, base_lr=args.lr, final_lr=0)
    trainer = gluon.Trainer(net.collect_params(), 'sgd',
                            {'learning_rate': args.lr, 'momentum': 0.9, 'wd': 1e-4,
                             'lr_scheduler': sched}, kvstore=kv)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    grad_batch = args.batch * (num_workers if is_sync(kv) else 1)

    def evaluate():
        correct = 0
        for x, y in ds.val_batches(120):
            correct += int((net(mx.nd.array(x)).asnumpy().argmax(axis=1) == y).sum())
        return correct / ds.n_val

    barrier(kv)
    t_start = time.time()
    evals = []
    step = 0
    for epoch in range(args.epochs):
        shards = shard_indices(ds.n_train, epoch, args.seed, rank, num_workers, args.batch)
        for idx in shards:
            x, y = ds.train_batch(idx, None)
            with autograd.record():
                loss = loss_fn(net(mx.nd.array(x)), mx.nd.array(y))
            loss.backward()
            trainer.step(grad_batch)
            step += 1
            if rank == 0 and (step % args.eval_every == 0 or step == total):
                mx.nd.waitall()
                evals.append((step, time.time() - t_start, evaluate()))
    mx.nd.waitall()
    t_end = time.time()
    return {'t_start': t_start, 't_end': t_end, 'steps': step, 'steps_per_epoch': spe,
            'batch': args.batch, 'evals': evals}


def main(argv=None):
    args = parse_args(argv)
    kv = make_kvstore(args.kvstore)
    rank = kv.rank if kv is not None else int(os.environ.get('BENCH_WORKER_INDEX', '0'))
    if args.workload == 'digits':
        res = run_digits(args, kv)
    else:
        res = run_throughput(args, kv)
    res.update({'kvstore': args.kvstore, 'kvstore_type': kv.type if kv else 'none',
                'rank': rank, 'num_workers': kv.num_workers if kv else 1,
                'algorithm': os.environ.get('SSDSGD_ALGORITHM') if args.kvstore == 'ssd_sync'
                else None, 'pid': os.getpid()})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f'.result-rank{rank}.json.tmp'
    tmp.write_text(json.dumps(res))
    tmp.rename(out / f'result-rank{rank}.json')
    if kv is not None and hasattr(kv, 'close'):
        kv.close()
    print(f'cluster_worker rank={rank} kvstore={args.kvstore} done', flush=True)


if __name__ == '__main__':
    main()
