"""One worker of the emulated-cluster benchmark (started by ``python -m bench.cluster``).

    python bench/cluster_worker.py --kvstore dist_sync|dist_async|ssd_sync|none --out DIR
        --workload emulated --shapes FILE.json --compute-s 0.8 [--batch 32]
        --workload real --model cifar_resnet20_v1 [--image-size 32] [--batch 32]
        --workload digits [--epochs 20] [--batch 32] [--lr 0.1] [--eval-every 4]
            [--hidden 2048 --deferred-eval]
        [--steps 20] [--warmup 2] [--compression '{"type": "2bit", "threshold": 0.5}']
        [--slowdown delay:1=0.2|factor:1=2|random:D:R[:SEED]]

The same loop for every kvstore, so rows differ only in the kvstore:

    compute   emulated: time.sleep(compute_s) (stands in for a GPU's forward and backward:
              no CPU taken from the servers); real: forward + backward of a gluoncv model
              on a fixed synthetic batch, waited for (mx.nd.waitall)
    exchange  trainer.step(...) of a stock gluon.Trainer (sgd, momentum 0.9) on the
              kvstore, then waiting until every weight is readable (what the next forward
              would wait for); this is the time blocked on communication

With ``--compression`` ssd_sync gets it as the Trainer's ``compression_params``. MXNet
1.9.1's dist_sync refuses compression with pushpull ("Compression not supported with
PushPull"), which the Trainer calls, so a native worker with compression uses
``PushPullTrainer``: kv.set_gradient_compression, the optimizer on the servers
(kv.set_optimizer), and per step kv.push of every gradient then kv.pull of every weight.

``--slowdown`` is the training program's ``debug.slowdown`` (ssdsgd/slowdown.py): the
slowed ranks sleep after their compute, before their exchange, in every row alike.

``--warmup`` steps (kvstore init and broadcast; for ssd_sync the launcher's
SSDSGD_WARMUP_STEPS should equal it) run before a barrier; ``--steps`` timed steps follow.
For ssd_sync with algorithm ssd, the timed region ends with a pull of every weight as of
the last step, so pushes still in flight are paid for. Gradients are filled once (random,
small) and never recomputed in the emulated workload.

Writes DIR/result-rank{rank}.json: wall-clock start/end (time.time(), comparable across
processes on one machine), compute and blocked seconds, the host interface's byte
counters over the timed region (the one non-loopback device in the namespace), for
ssd_sync its own counters, and when its start-up reached each point (startup_marks).
"""
import time

#: when this worker's start-up reached Python running (this module), MXNet imported and
#: its store made (time.time(), as t_start): the heterogeneity rows' start-up parts
STARTUP_MARKS = {'python': time.time()}

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

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
    p.add_argument('--compression', help='JSON for kv.set_gradient_compression (ssd_sync: '
                   "the Trainer's compression_params; native: push/pull, see above)")
    p.add_argument('--hidden', type=int, default=0,
                   help='digits: a 64-H-H-10 ReLU MLP instead of the demo digits_mlp')
    p.add_argument('--deferred-eval', action='store_true',
                   help='digits: rank 0 copies its weights every --eval-every steps and '
                   'tests the copies after training, so testing takes no time from the run')
    p.add_argument('--slowdown', default='none',
                   help="straggler injection, debug.slowdown's forms (default none)")
    return p.parse_args(argv)


def make_slowdown(args, kv):
    """``--slowdown`` for this worker (the package's Slowdown; the checkout on sys.path)."""
    if REPO not in map(Path, sys.path):
        sys.path.insert(0, str(REPO))
    from ssdsgd.slowdown import Slowdown
    rank = kv.rank if kv is not None else int(os.environ.get('BENCH_WORKER_INDEX', '0'))
    return Slowdown(args.slowdown, rank, kv.num_workers if kv is not None else
                    int(os.environ.get('BENCH_NUM_WORKERS', '1')))


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
    """ssdsgd is imported before MXNet in every row, as the training program does: MXNet's
    import goes through ssdsgd's hook (operator-code cache, trimmed import) for native
    rows too, as their ps-lite nodes' does, so every row pays the same start-up."""
    try:
        import ssdsgd  # noqa: F401  registers 'ssd_sync'
    except ImportError:
        sys.path.insert(0, str(REPO))
        import ssdsgd  # noqa: F401
    import mxnet as mx
    STARTUP_MARKS['mxnet'] = time.time()
    kv = None if name == 'none' else mx.kv.create(name)
    STARTUP_MARKS['kvstore'] = time.time()
    return kv


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


def is_ssdsgd(kv):
    """An ssd_sync store (its kv.type is the native type its algorithm acts like, e.g.
    dist_sync_ssdsgd, so the class says it, not the type)."""
    return kv is not None and type(kv).__module__.split('.')[0] == 'ssdsgd'


def algorithm():
    """The job's sync.algorithm, as the settings table reads it."""
    from ssdsgd.settings import BY_NAME
    s = BY_NAME['algorithm']
    return os.environ.get(s.env) or s.default


def is_sync(kv):
    """Does the server sum N gradients per step (so Trainer.step gets N * batch)?"""
    if kv is None:
        return False
    if is_ssdsgd(kv):     # preduce: each worker's step is its own (docs/spec/preduce.md)
        return algorithm() not in ('asgd', 'preduce')
    return 'async' not in kv.type


def drains(kv):
    """ssd_sync in the steps-delay stage leaves pushes in flight after a step returns."""
    return is_ssdsgd(kv) and algorithm() == 'ssd'


class PushPullTrainer:
    """What gluon.Trainer does with update_on_kvstore, with kv.push and kv.pull instead of
    kv.pushpull (which MXNet's dist_sync refuses with compression): the optimizer runs on
    the servers; a step pushes every gradient, then pulls every weight."""

    def __init__(self, params, optimizer, optimizer_params, kv, compression, grad_batch):
        import mxnet as mx
        self.kv, self.params = kv, [p for p in params if p.grad_req != 'null']
        if compression:
            kv.set_gradient_compression(compression)
        kv.set_optimizer(mx.optimizer.create(optimizer, rescale_grad=1.0 / grad_batch,
                                             **optimizer_params))
        self.keys = list(range(len(self.params)))
        for i, p in zip(self.keys, self.params):
            kv.init(i, p.data())
        for i, p in zip(self.keys, self.params):
            kv.pull(i, out=p.data(), priority=-i)     # everyone starts from rank 0's

    def step(self, batch_size, ignore_stale_grad=False):
        for i, p in zip(self.keys, self.params):
            self.kv.push(i, p.grad(), priority=-i)
        for i, p in zip(self.keys, self.params):
            self.kv.pull(i, out=p.data(), priority=-i)


def make_trainer(params, optimizer_params, kv, compression, grad_batch):
    """A stock gluon.Trainer ('sgd'), or PushPullTrainer for a native kvstore with
    compression."""
    from mxnet import gluon
    if compression and kv is not None and not is_ssdsgd(kv):
        return PushPullTrainer(params, 'sgd', optimizer_params, kv, compression, grad_batch)
    extra = {'compression_params': compression} if compression else {}
    return gluon.Trainer(params, 'sgd', optimizer_params, kvstore=kv, **extra)


def compression_of(args):
    return json.loads(args.compression) if args.compression else None


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


class Throughput:
    """The emulated or real workload's step on ``kv``: compute, then exchange (the
    Trainer's step and waiting for every weight)."""

    def __init__(self, args, kv):
        import mxnet as mx
        self.mx, self.args, self.kv = mx, args, kv
        if args.workload == 'emulated':
            self.params, self.model = emulated_params(args), None
        else:
            self.model = RealModel(args, mx.cpu())
            self.params = self.model.params()
        num_workers = kv.num_workers if kv is not None else 1
        self.grad_batch = args.batch * (num_workers if is_sync(kv) else 1)
        self.trainer = make_trainer(self.params, {'learning_rate': 1e-4, 'momentum': 0.9},
                                    kv, compression_of(args), self.grad_batch)
        self.trained = [i for i, p in enumerate(self.params) if p.grad_req != 'null']

    def compute(self):
        if self.model is None:
            time.sleep(self.args.compute_s)
        else:
            self.model.compute()

    def exchange(self):
        self.trainer.step(self.grad_batch, ignore_stale_grad=True)
        self.mx.nd.waitall()

    def drain(self):
        """ssd_sync (ssd): pull every weight as of the last step; the seconds it took."""
        if not drains(self.kv):
            return 0.0
        a = time.perf_counter()
        self.kv.pull(self.trained, out=[self.params[i].list_data() for i in self.trained])
        self.mx.nd.waitall()
        return time.perf_counter() - a

    def param_bytes(self):
        return int(sum(self.params[i].data().size * 4 for i in self.trained))


def run_throughput(args, kv):
    job = Throughput(args, kv)
    job.slow = make_slowdown(args, kv)
    dev = net_device()
    for step in range(args.warmup):
        a = time.perf_counter()
        job.compute()
        job.slow.after_compute(step, time.perf_counter() - a)
        job.exchange()
    barrier(kv)
    c0, m0 = read_counters(dev), kv_metrics(kv)
    t_start, cpu0 = time.time(), time.process_time()
    timed = timed_steps(job, args.steps, t_start, first_step=args.warmup)
    drain_s = job.drain()
    t_end, cpu1 = time.time(), time.process_time()
    c1, m1 = read_counters(dev), kv_metrics(kv)
    res = {'t_start': t_start, 't_end': t_end, 'steps': args.steps, 'batch': args.batch,
           **timed, 'drain_s': drain_s, 'net_dev': dev, 'cpu_s': cpu1 - cpu0,
           'warmup': args.warmup,
           'param_bytes': job.param_bytes(), 'num_keys': len(job.trained)}
    res.update(counter_deltas(c0, c1, m0, m1))
    return res


def timed_steps(job, steps, t_start, first_step=0):
    """compute_s and blocked_s (sums over the steps; an injected slowdown counts as
    compute), every step's end time and every step's blocked seconds (an ssd step that
    pulls, one that waits for the pull and one that does neither block for different
    things: bench/push_path.py tells them apart)."""
    compute_s = blocked_s = 0.0
    step_ends, step_blocked = [], []
    for i in range(steps):
        a = time.perf_counter()
        job.compute()
        job.slow.after_compute(first_step + i, time.perf_counter() - a)
        b = time.perf_counter()
        job.exchange()
        c = time.perf_counter()
        compute_s += b - a
        blocked_s += c - b
        step_ends.append(time.time() - t_start)
        step_blocked.append(c - b)
    return {'compute_s': compute_s, 'blocked_s': blocked_s, 'step_ends': step_ends,
            'step_blocked': step_blocked}


def counter_deltas(c0, c1, m0, m1):
    """The interface's bytes and the kvstore's figures over the timed region."""
    res = {}
    if c0 and c1:
        res['tx_bytes'], res['rx_bytes'] = c1[0] - c0[0], c1[1] - c0[1]
    if m0 and m1:
        res['kv_metrics'] = {k: m1[k] - m0[k] for k in m1
                             if isinstance(m1.get(k), (int, float)) and
                             isinstance(m0.get(k), (int, float))}
        res['kv_metrics_end'] = {k: v for k, v in m1.items() if isinstance(v, (int, float, str))}
    return res


class Digits:
    """The digits demo's model, data shard and Trainer on ``kv`` (rank 0 evaluates)."""

    def __init__(self, args, kv):
        import mxnet as mx
        from mxnet import gluon
        sys.path.insert(0, str(REPO))
        from ssdsgd.data.digits import DigitsDataset
        from ssdsgd.models import digits_mlp, initializer
        mx.random.seed(args.seed)
        np.random.seed(args.seed)
        self.mx, self.args = mx, args
        self.ds = DigitsDataset()
        self.rank = kv.rank if kv is not None else 0
        self.num_workers = kv.num_workers if kv is not None else 1
        self.spe = self.ds.n_train // (self.num_workers * args.batch)
        self.total = args.epochs * self.spe
        self.net = digits_mlp(10) if not args.hidden else wide_mlp(args.hidden)
        self.net.initialize(initializer('digits_mlp'))
        self.net.hybridize(static_alloc=True, static_shape=True)
        self.net(mx.nd.zeros((1, 64)))
        sched = mx.lr_scheduler.CosineScheduler(max_update=self.total, base_lr=args.lr,
                                                final_lr=0)
        self.grad_batch = args.batch * (self.num_workers if is_sync(kv) else 1)
        self.params = list(self.net.collect_params().values())
        self.trainer = make_trainer(self.params, {'learning_rate': args.lr, 'momentum': 0.9,
                                                  'wd': 1e-4, 'lr_scheduler': sched},
                                    kv, compression_of(args), self.grad_batch)
        self.loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()

    def param_bytes(self):
        return int(sum(p.data().size * 4 for p in self.params if p.grad_req != 'null'))

    def snapshot(self):
        return [p.data().asnumpy() for p in self.params]

    def evaluate_snapshot(self, arrays):
        for p, a in zip(self.params, arrays):
            p.data()[:] = a          # in place: set_data would reset the kvstore
        return self.evaluate()

    def evaluate(self):
        correct = 0
        for x, y in self.ds.val_batches(120):
            out = self.net(self.mx.nd.array(x)).asnumpy()
            correct += int((out.argmax(axis=1) == y).sum())
        return correct / self.ds.n_val

    def train_step(self, x, y, step, slow):
        from mxnet import autograd
        a = time.perf_counter()
        with autograd.record():
            loss = self.loss_fn(self.net(self.mx.nd.array(x)), self.mx.nd.array(y))
        loss.backward()
        if slow.kind != 'none':
            if slow.measures_compute:
                self.mx.nd.waitall()
            slow.after_compute(step, time.perf_counter() - a)
        self.trainer.step(self.grad_batch)
        # The step's loss is read, as ssdsgd's training program reads it for its metrics:
        # this thread is then at most a step ahead of MXNet's engine. Unread, it queued
        # steps as fast as Python runs, and under dynamic data took chunks as fast too,
        # not as fast as it trained them (4 equal workers: 161 to 257 batches each, and
        # the ones with the most trained the last of them while the others had finished).
        return float(loss.sum().asscalar())


def wide_mlp(hidden):
    """64-H-H-10 ReLU MLP: a gradient of about 4 H^2 bytes on the same digits, so links,
    not compute, bound its step."""
    from mxnet.gluon import nn
    net = nn.HybridSequential()
    net.add(nn.Flatten(), nn.Dense(hidden, activation='relu'),
            nn.Dense(hidden, activation='relu'), nn.Dense(10))
    return net


def dynamic(kv):
    """Does the job hand out its batches dynamically (docs/spec/dynamic_data.md)? As
    data.assignment auto decides: ssd_sync with quorum rounds or preduce."""
    if not is_ssdsgd(kv):
        return False
    from ssdsgd.settings import BY_NAME, dynamic_data
    quorum = os.environ.get(BY_NAME['quorum'].env) or BY_NAME['quorum'].default
    return dynamic_data('auto', algorithm(), quorum, kv.num_workers)


def digits_batches(job, args, kv):
    """Every (x, y) this worker trains: the job's budget is epochs x steps per epoch x N
    batches. Static: its own shard of each epoch, the same steps as every other worker;
    dynamic: each epoch's batches as the scheduler hands them out (ssdsgd.data.dynamic),
    until the budget is spent, so a fast worker keeps taking batches."""
    from ssdsgd.data import shard_indices
    if not dynamic(kv):
        for epoch in range(args.epochs):
            for idx in shard_indices(job.ds.n_train, epoch, args.seed, job.rank,
                                     job.num_workers, args.batch):
                yield job.ds.train_batch(idx, None)
        return
    from ssdsgd.data.dynamic import ChunkFeed, chunk_plan
    n = job.num_workers
    feed = ChunkFeed(kv, job.ds, args.seed, args.batch,
                     chunk_plan(job.spe * n, job.total, n, 0))
    for epoch in range(args.epochs):
        for _, batch in feed.epoch(epoch):
            yield batch
        if feed.over:
            return


def run_digits(args, kv):
    job = Digits(args, kv)              # puts the checkout on sys.path
    slow = make_slowdown(args, kv)
    dev = net_device()
    barrier(kv)
    c0 = read_counters(dev)
    t_start, cpu0 = time.time(), time.process_time()
    evals, snaps = [], []
    step = 0
    for x, y in digits_batches(job, args, kv):
        job.train_step(x, y, step, slow)
        step += 1
        if args.eval_every and job.rank == 0 and (step % args.eval_every == 0
                                                  or step == job.total):
            job.mx.nd.waitall()
            if args.deferred_eval:
                snaps.append((step, time.time() - t_start, job.snapshot()))
            else:
                evals.append((step, time.time() - t_start, job.evaluate()))
    job.mx.nd.waitall()
    t_end, cpu_s = time.time(), time.process_time() - cpu0
    metrics = kv_metrics(kv)
    closed = False
    final = bool(args.eval_every) and job.rank == 0
    if kv is not None and hasattr(kv, 'average_all') and kv.algorithm == 'preduce':
        # the final model is the average of every worker's (docs/spec/preduce.md); rank
        # 0's curve so far was of its own model
        kv.average_all()
    elif args.kvstore == 'ssd_sync' and kv is not None:
        # the job's model is the one the close leaves: ssd's global weights (rank 0's
        # curve was of its local model), with a quorum after every late push is applied
        kv.close()
        closed = True
    else:
        final = False
    # the bytes this worker's host sent and received from the first step to its last
    # exchange (the close's final pulls included): what the method moved (issue 27)
    moved = counter_deltas(c0, read_counters(dev), None, None)
    if final:
        evals.append((step, time.time() - t_start, job.evaluate()))
    # rank 0's copies are tested once its exchanges are over: a quorum's rounds and
    # preduce's last group count on it until then
    evals += [(s, t, job.evaluate_snapshot(w)) for s, t, w in snaps]
    return {'t_start': t_start, 't_end': t_end, 'cpu_s': cpu_s, 'steps': step,
            'steps_per_epoch': job.spe, 'closed': closed,
            'batch': args.batch, 'evals': evals, 'param_bytes': job.param_bytes(),
            'net_dev': dev, **moved,
            'kv_metrics_end': {k: v for k, v in (metrics or {}).items()
                               if isinstance(v, (int, float, str))}}


def main(argv=None):
    args = parse_args(argv)
    if args.workload != 'digits':
        # the run's length, as ssdsgd's training program states it (an auto warm-up is a
        # share of it); the digits job states it by its cosine schedule's max_update
        os.environ.setdefault('SSDSGD_TOTAL_STEPS', str(args.warmup + args.steps))
    kv = make_kvstore(args.kvstore)
    rank = kv.rank if kv is not None else int(os.environ.get('BENCH_WORKER_INDEX', '0'))
    if args.workload == 'digits':
        res = run_digits(args, kv)
    else:
        res = run_throughput(args, kv)
    res.update({'kvstore': args.kvstore, 'kvstore_type': kv.type if kv else 'none',
                'rank': rank, 'num_workers': kv.num_workers if kv else 1,
                'algorithm': algorithm() if args.kvstore == 'ssd_sync' else None,
                'pid': os.getpid(), 'slowdown': args.slowdown, 'startup_marks': STARTUP_MARKS})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f'.result-rank{rank}.json.tmp'
    tmp.write_text(json.dumps(res))
    tmp.rename(out / f'result-rank{rank}.json')
    if kv is not None and hasattr(kv, 'close') and not res.pop('closed', False):
        kv.close()
    print(f'cluster_worker rank={rank} kvstore={args.kvstore} done', flush=True)


if __name__ == '__main__':
    main()
