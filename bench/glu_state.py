#!/usr/bin/env python3
"""GLU state variants on digits, through the single-process simulator (the spec's oracle).

    nice -n 19 timeout 1200 python bench/glu_state.py --json /tmp/glu.json --plot docs/glu_state.png
    python bench/glu_state.py --quick          # smoke run: 1 lr, 2 k, 1 seed, short run
    python bench/glu_state.py --load /tmp/glu.json --plot docs/glu_state.png   # reprint

Trains a 64-H-10 MLP on scikit-learn's real 8x8 digits with ``ssdsgd.glu.simulate`` (the
distributed run is tested equal to it step for step), N workers, each worker a disjoint
shard of every step's batch. For every lr, k, glu_state and seed it records the test
accuracy and loss of the global model w_G along the run; SSGD (the same simulator with
``algorithm='ssgd'``) is the reference. It prints

1. final test accuracy after the short and the long horizon, mean +- std over seeds;
2. per glu_state: the gap to SSGD (points) averaged over every lr and k, the worst cell,
   the mean gap over the whole curve after the warm-up (per-step progress), and the bytes
   a pull carries (weights, plus the optimizer state for ``exact``);

and writes a PNG of the accuracy curves (rows k, columns lr; mean over seeds). The
gradients are computed in numpy (the model is small; the simulator does the rest with
MXNet's own optimizers), so a full run is a few minutes of CPU.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DEFAULTS = dict(lrs=[0.02, 0.05, 0.1, 0.2], ks=[2, 5, 10, 20], seeds=3, steps=504,
                short=252, warmup=40, states=['estimate', 'exact', 'corrected'])
QUICK = dict(lrs=[0.05], ks=[5, 10], seeds=1, steps=120, short=60, warmup=20)


# ----------------------------------------------------------------------------- model

def digits():
    """The fixed 75/25 stratified split (seed 0) of sklearn's digits, pixels in [0, 1]."""
    from ssdsgd.data.digits import load_digits, stratified_split
    x, y = load_digits()
    x = (x / 16.0).astype(np.float32)
    train, test = stratified_split(y, 0.25, 0)
    return x[train], x[test], y[train], y[test]


def shapes(hidden):
    return [(hidden, 64), (hidden,), (10, hidden), (10,)]


def init_weights(hidden, seed):
    """Gluon Dense layout ((out, in) weights), Xavier-uniform (MXNet's default magnitude
    3, 'avg'), zero biases; flattened into one vector (see unpack)."""
    rs = np.random.RandomState(seed)
    parts = []
    for shape in shapes(hidden):
        if len(shape) == 2:
            bound = np.sqrt(6.0 / sum(shape))
            parts.append(rs.uniform(-bound, bound, shape).astype(np.float32).ravel())
        else:
            parts.append(np.zeros(shape, np.float32))
    return np.concatenate(parts)


def unpack(flat, hidden):
    """The model's four arrays as views of one flat vector. The simulator gets a single
    key: sgd with momentum is element-wise, so one key or four give the same numbers, and
    one key costs a quarter of the MXNet calls."""
    out, at = {}, 0
    for i, shape in enumerate(shapes(hidden)):
        n = int(np.prod(shape))
        out[i], at = flat[at:at + n].reshape(shape), at + n
    return out


def forward(w, x, act):
    h = x @ w[0].T + w[1]
    a = np.tanh(h) if act == 'tanh' else np.maximum(h, 0)
    z = a @ w[2].T + w[3]
    z = z - z.max(axis=1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=1, keepdims=True)
    return h, a, p


def raw_grads(w, x, y, act):
    """Gradient of the summed softmax cross-entropy (what Gluon's backward gives: the
    optimizer's rescale_grad = 1/batch makes it a mean)."""
    h, a, p = forward(w, x, act)
    dz = p.copy()
    dz[np.arange(len(y)), y] -= 1.0
    da = dz @ w[2]
    dh = da * (1.0 - a * a) if act == 'tanh' else da * (h > 0)
    return {0: dh.T @ x, 1: dh.sum(0), 2: dz.T @ a, 3: dz.sum(0)}


def evaluate(w, x, y, act):
    _, _, p = forward(w, x, act)
    return (float((p.argmax(1) == y).mean()),
            float(-np.log(p[np.arange(len(y)), y] + 1e-12).mean()))


# ----------------------------------------------------------------------------- one run

def run_one(cfg: dict) -> dict:
    """One simulated job; cfg holds the settings and (algorithm, glu_state, lr, k, seed)."""
    import mxnet as mx
    from ssdsgd.glu.simulate import simulate
    from ssdsgd.kvstore.compression import parse_setting
    x_tr, x_te, y_tr, y_te = digits()
    n, b, act, h = cfg['workers'], cfg['batch'], cfg['act'], cfg['hidden']
    per_epoch = len(x_tr) // (b * n)
    orders = {}

    def grad_fn(worker, step, weights):
        epoch, j = divmod(step, per_epoch)
        if epoch not in orders:  # the data order depends on the seed, not on the variant
            orders[epoch] = np.random.RandomState(1000 * cfg['seed'] + epoch).permutation(
                len(x_tr))
        idx = orders[epoch][(j * n + worker) * b:(j * n + worker + 1) * b]
        g = raw_grads(unpack(weights[0].asnumpy(), h), x_tr[idx], y_tr[idx], act)
        return {0: mx.nd.array(np.concatenate([g[i].ravel() for i in range(4)]))}

    curve = []

    def on_step(t, weights):
        if (t + 1) % cfg['eval_every'] == 0 or t + 1 in (cfg['short'], cfg['steps']):
            acc, loss = evaluate(unpack(weights[0].asnumpy(), h), x_te, y_te, act)
            curve.append((t + 1, acc, loss))

    def make_optimizer():
        return optimizer(cfg, cfg['lr'], wd=cfg['wd'], rescale_grad=1.0 / b)

    init = {0: mx.nd.array(init_weights(h, cfg['seed']))}
    t0, cpu0 = time.time(), time.process_time()
    seeds = _record_seeds() if cfg.get('seed_error') else None
    try:
        simulate(init, grad_fn, make_optimizer, n, cfg['steps'], algorithm=cfg['algorithm'],
                 warmup_steps=cfg['warmup'], delay_steps=cfg['k'] or 1,
                 glu_state=cfg['state'] or 'estimate', on_step=on_step,
                 lr_local=cfg.get('lr_local'),
                 compression=parse_setting(cfg.get('compression', 'none')))
    finally:
        if seeds is not None:
            seeds = seeds.close()
    return {key: cfg[key] for key in ('algorithm', 'state', 'lr', 'k', 'seed')} | {
        'curve': curve, 'seconds': time.time() - t0, 'cpu': time.process_time() - cpu0,
        'seed_error': seeds}


def optimizer(cfg: dict, lr: float, **params):
    """--optimizer: sgd with --momentum, or Adam with its published betas and epsilon."""
    import mxnet as mx
    if cfg.get('optimizer', 'sgd') == 'adam':
        return mx.optimizer.Adam(learning_rate=lr, **params)
    return mx.optimizer.SGD(learning_rate=lr, momentum=cfg['momentum'], **params)


class _record_seeds:
    """--seed-error: every rule the simulator builds also gets the server's state with each
    pull (only `exact` uses it) and records, per reset, its seeded momentum and the server's.
    close() restores the simulator and returns the median relative error of worker 0's
    seed and of the workers' mean seed (resets after the first two)."""

    def __init__(self):
        from ssdsgd.glu import simulate as sim
        self.sim, self.orig, self.log = sim, sim.make_local_rule, []
        sim.make_local_rule = self.make

    def make(self, *args, **kwargs):
        rule, log = self.orig(*args, **kwargs), []
        self.log.append(log)
        rule.needs_state, reset = True, rule.reset

        def recording_reset(key, global_weight, **kw):
            reset(key, global_weight, **kw)
            log.append((rule.updater.states[key].asnumpy(), kw['state'][0].asnumpy()))
        rule.reset = recording_reset
        return rule

    def close(self):
        self.sim.make_local_rule = self.orig
        if not self.log or len(self.log[0]) < 3:
            return None
        rel = lambda a, b: float(np.linalg.norm(a - b) / (np.linalg.norm(b) + 1e-12))  # noqa
        per_reset = list(zip(*self.log))[2:]   # [(seed, true) per worker] per reset
        return {'worker': float(np.median([rel(*r[0]) for r in per_reset])),
                'mean': float(np.median([rel(np.mean([s for s, _ in r], axis=0), r[0][1])
                                         for r in per_reset]))}


def pull_bytes(cfg: dict, state: str) -> int:
    """Payload of one steps-delay pull reply (weights, plus the server's optimizer state
    when the rule needs it), from the simulator's own reply; framing not included."""
    import mxnet as mx
    from ssdsgd.glu.rules import make_local_rule
    from ssdsgd.glu.simulate import Server

    def make():
        return optimizer(cfg, 0.1)
    init = {0: mx.nd.array(init_weights(cfg['hidden'], 0))}
    needs = make_local_rule('glu', make, cfg['workers'], state).needs_state
    reply = Server(init, make).pull(needs)
    arrays = list(reply.weights.values()) + [a for st in reply.state.values() for a in st]
    return sum(a.asnumpy().nbytes for a in arrays)


# ----------------------------------------------------------------------------- tables

def at(run: dict, step: int, col: int = 1):
    return next(c[col] for c in run['curve'] if c[0] == step)


def group(results):
    out = {}
    for r in results:
        out.setdefault((r['algorithm'], r['state'], r['lr'], r['k']), []).append(r)
    return out


def cell(runs, step):
    a = np.array([at(r, step) for r in runs])
    sd = a.std(ddof=1) if len(a) > 1 else 0.0
    return f"{a.mean():.3f}±{sd:.3f}"


def _table(head, rows):
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    fmt = lambda cs: "  ".join(c.ljust(w) if i < 2 else c.rjust(w)  # noqa: E731
                               for i, (c, w) in enumerate(zip(cs, widths)))
    return "\n".join([fmt(head), fmt(['-' * w for w in widths])] + [fmt(r) for r in rows])


def accuracy_table(data, step):
    s, g = data['settings'], group(data['results'])
    rows = []
    for lr in s['lrs']:
        rows.append([f"{lr:g}", 'ssgd', cell(g[('ssgd', None, lr, None)], step)] +
                    [''] * (len(s['ks']) - 1))
        for state in s['states']:
            rows.append([f"{lr:g}", state] + [cell(g[('ssd', state, lr, k)], step)
                                              for k in s['ks']])
    return _table(['lr', 'glu_state'] + [f"k={k}" for k in s['ks']], rows)


def gaps(data, state):
    """Per (lr, k): mean over seeds of (ssd - ssgd) accuracy at the short and long horizon
    and over the curve after the warm-up, in points; seeds are paired (same init, data)."""
    s, g = data['settings'], group(data['results'])
    out = []
    for lr in s['lrs']:
        ref = {r['seed']: r for r in g[('ssgd', None, lr, None)]}
        for k in s['ks']:
            runs = g[('ssd', state, lr, k)]
            short = [at(r, s['short']) - at(ref[r['seed']], s['short']) for r in runs]
            long_ = [at(r, s['steps']) - at(ref[r['seed']], s['steps']) for r in runs]
            curve = [np.mean([c[1] - c2[1] for c, c2 in zip(r['curve'], ref[r['seed']]['curve'])
                              if c[0] > s['warmup']]) for r in runs]
            out.append((lr, k, 100 * np.mean(short), 100 * np.mean(long_),
                        100 * np.mean(curve)))
    return out


def summary_table(data):
    s = data['settings']
    rows = []
    for state in s['states']:
        gp = gaps(data, state)
        per_lr = [f"{np.mean([x[4] for x in gp if x[0] == lr]):+.1f} / "
                  f"{np.mean([x[3] for x in gp if x[0] == lr]):+.1f}" for lr in s['lrs']]
        worst = min(gp, key=lambda x: x[3])
        nbytes = data['pull_bytes'][state]
        rows.append([state, ''] + per_lr + [
            f"{np.mean([x[4] for x in gp]):+.1f} / {np.mean([x[3] for x in gp]):+.1f}",
            f"{worst[3]:+.1f} (lr {worst[0]:g} k={worst[1]})",
            f"{nbytes:,}", f"{nbytes / data['pull_bytes']['estimate']:.1f}"
            if 'estimate' in data['pull_bytes'] else '-'])
    return _table(['glu_state', ''] + [f"lr {lr:g}" for lr in s['lrs']] +
                  ['all', f"worst @{s['steps']}", 'B/pull', 'x'], rows)


def seed_error_table(data):
    s, g = data['settings'], group(data['results'])
    rows = []
    for lr in s['lrs']:
        for state in s['states']:
            cells = []
            for k in s['ks']:
                errs = [r['seed_error'] for r in g[('ssd', state, lr, k)] if r['seed_error']]
                cells.append(f"{np.mean([e['worker'] for e in errs]):.2f} / "
                             f"{np.mean([e['mean'] for e in errs]):.2f}" if errs else '-')
            rows.append([f"{lr:g}", state] + cells)
    return _table(['lr', 'glu_state'] + [f"k={k}" for k in s['ks']], rows)


def print_report(data):
    s = data['settings']
    print(f"digits {s['act']} MLP 64-{s['hidden']}-10, N={s['workers']}, batch "
          f"{s['batch']}/worker, "
          + (f"sgd momentum {s['momentum']}" if s.get('optimizer', 'sgd') == 'sgd' else 'adam')
          + f" wd {s['wd']}, constant lr, "
          f"warm-up {s['warmup']}, push compression {s.get('compression', 'none')}, "
          f"{s['seeds']} seeds (mean±std); test accuracy of w_G")
    for step in (s['short'], s['steps']):
        print(f"\nafter {step} steps\n" + accuracy_table(data, step))
    print(f"\nper glu_state, points vs ssgd (paired seeds), mean over k (and seeds): "
          f"'curve / final' = the gap\naveraged over every evaluation after the warm-up "
          f"(per-step progress) / the gap after {s['steps']}\nsteps; B/pull = payload of one "
          f"pull reply (framing excluded), x = relative to estimate\n" + summary_table(data))
    if s.get('seed_error'):
        print("\nmedian relative error of the seeded momentum against the server's, "
              "'worker 0 / mean over workers'\n" + seed_error_table(data))
    cpu = sum(r.get('cpu', 0) for r in data['results'])
    print(f"\n{len(data['results'])} runs: {cpu:.0f} s of CPU in the simulations, "
          f"{data.get('wall', 0) / 60:.1f} min wall")


def plot(data, path):
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    s, g = data['settings'], group(data['results'])
    fig, axes = plt.subplots(len(s['ks']), len(s['lrs']), figsize=(3.2 * len(s['lrs']),
                             2.4 * len(s['ks'])), sharex=True, sharey=True, squeeze=False,
                             dpi=90)
    styles = {'ssgd': ('k', '--'), 'estimate': ('tab:red', '-'), 'exact': ('tab:blue', '-'),
              'corrected': ('tab:green', '-')}
    for i, k in enumerate(s['ks']):
        for j, lr in enumerate(s['lrs']):
            ax = axes[i][j]
            for name, runs in [('ssgd', g[('ssgd', None, lr, None)])] + [
                    (st, g[('ssd', st, lr, k)]) for st in s['states']]:
                steps = [c[0] for c in runs[0]['curve']]
                acc = np.mean([[c[1] for c in r['curve']] for r in runs], axis=0)
                color, ls = styles.get(name, (None, '-'))
                ax.plot(steps, acc, color=color, linestyle=ls, linewidth=1.2, label=name)
            ax.axvline(s['warmup'], color='gray', linewidth=0.5)
            ax.set_ylim(0.5, 1.0)
            ax.grid(True, alpha=0.3)
            if i == 0:
                ax.set_title(f"lr {lr:g}", fontsize=9)
            if j == 0:
                ax.set_ylabel(f"k={k}\ntest acc", fontsize=9)
            if i == len(s['ks']) - 1:
                ax.set_xlabel('step', fontsize=9)
    axes[0][0].legend(fontsize=7, loc='lower right')
    fig.suptitle(f"digits {s['act']} MLP, N={s['workers']}, test accuracy of w_G, mean of "
                 f"{s['seeds']} seeds (below 0.5 cut off); grey line: end of warm-up",
                 fontsize=10)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


# ----------------------------------------------------------------------------- main

def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split('\n\n', 1)[1])
    lst = lambda kind: lambda t: [kind(x) for x in t.split(',') if x]  # noqa: E731
    p.add_argument('--quick', action='store_true', help=f"smoke run: {QUICK}")
    p.add_argument('--lrs', type=lst(float))
    p.add_argument('--ks', type=lst(int))
    p.add_argument('--states', type=lst(str), help=f"default {DEFAULTS['states']}")
    p.add_argument('--seeds', type=int, help='seeds 0..n-1 (init and data order)')
    p.add_argument('--steps', type=int, help='the long horizon (run length)')
    p.add_argument('--short', type=int, help='the short horizon (an evaluation point)')
    p.add_argument('--warmup', type=int)
    p.add_argument('--workers', type=int, default=4)
    p.add_argument('--batch', type=int, default=16, help='per worker')
    p.add_argument('--hidden', type=int, default=64)
    p.add_argument('--act', choices=['tanh', 'relu'], default='tanh')
    p.add_argument('--optimizer', choices=['sgd', 'adam'], default='sgd',
                   help="sgd with --momentum, or adam (MXNet's defaults but lr and wd)")
    p.add_argument('--lr-local', type=float, default=None,
                   help="sync.lr_local: the local rule's lr (unset: the servers' lr)")
    p.add_argument('--momentum', type=float, default=0.9)
    p.add_argument('--wd', type=float, default=1e-4)
    p.add_argument('--eval-every', type=int, default=12, help='steps between evaluations')
    p.add_argument('--compression', default='none',
                   help="push compression, as sync.compression: none, 2bit[:t], topk[:r]")
    p.add_argument('--seed-error', action='store_true',
                   help="also measure how far the seeded momenta are from the server's "
                   "(pulls then carry the state for every variant; accuracy is unchanged)")
    p.add_argument('--jobs', type=int, default=2, help='worker processes')
    p.add_argument('--json', type=Path, help='write settings and every run here')
    p.add_argument('--plot', type=Path, help='write the accuracy curves (PNG) here')
    p.add_argument('--load', type=Path, help='reprint a --json file; run nothing')
    args = p.parse_args(argv)
    if args.load:
        data = json.loads(args.load.read_text())
        for r in data['results']:
            r['curve'] = [tuple(c) for c in r['curve']]
    else:
        data = measure(args)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(data) + '\n')
    print_report(data)
    if args.plot:
        plot(data, args.plot)
        print(f"plot: {args.plot}")
    return 0


def measure(args) -> dict:
    base = QUICK if args.quick else {}
    def pick(name):     # 0 is a value (--warmup 0), only None is "not given"
        given = getattr(args, name)
        return given if given is not None else base.get(name, DEFAULTS[name])
    s = {name: pick(name) for name in ('lrs', 'ks', 'states', 'seeds', 'steps', 'short',
                                       'warmup')}
    from ssdsgd.glu.rules import GLU_STATES
    bad = [st for st in s['states'] if st not in GLU_STATES]
    if bad or not 0 < s['short'] <= s['steps'] or s['warmup'] >= s['short']:
        raise SystemExit(f"bad settings: states {bad} not in {GLU_STATES}, or not "
                         f"warmup < short <= steps ({s['warmup']}, {s['short']}, {s['steps']})")
    s |= {key: getattr(args, key) for key in ('workers', 'batch', 'hidden', 'act',
                                              'optimizer', 'lr_local', 'momentum', 'wd',
                                              'eval_every',
                                              'seed_error', 'compression')}
    from ssdsgd.kvstore.compression import CompressionError, parse_setting
    try:                                # a bad value fails here, not in every run
        parse_setting(s['compression'])
    except CompressionError as e:
        raise SystemExit(f"--compression: {e}") from None
    plan = [dict(s, algorithm='ssgd', state=None, lr=lr, k=None, seed=seed)
            for lr in s['lrs'] for seed in range(s['seeds'])]
    plan += [dict(s, algorithm='ssd', state=st, lr=lr, k=k, seed=seed)
             for lr in s['lrs'] for k in s['ks'] for st in s['states']
             for seed in range(s['seeds'])]
    plan.sort(key=lambda c: -(c['k'] or 0))   # uneven run times: long ones first
    print(f"{len(plan)} runs of {s['steps']} steps on {args.jobs} processes", file=sys.stderr,
          flush=True)
    # Tiny arrays: MXNet's threaded engine costs more than the ops (2-4x wall on busy
    # cores); the naive engine runs the same kernels in the calling thread.
    os.environ.setdefault('OMP_NUM_THREADS', '1')
    os.environ.setdefault('MXNET_ENGINE_TYPE', 'NaiveEngine')
    t0 = time.time()
    results = []
    with mp.get_context('spawn').Pool(args.jobs) as pool:
        for i, r in enumerate(pool.imap_unordered(run_one, plan), 1):
            results.append(r)
            if i % 10 == 0 or i == len(plan):
                print(f"  {i}/{len(plan)} ({time.time() - t0:.0f} s)", file=sys.stderr,
                      flush=True)
    results.sort(key=lambda r: (r['lr'], r['algorithm'], r['state'] or '', r['k'] or 0,
                                r['seed']))
    return {'settings': s, 'results': results, 'wall': time.time() - t0,
            'pull_bytes': {st: pull_bytes(s, st) for st in s['states']}}


if __name__ == '__main__':
    sys.exit(main())
