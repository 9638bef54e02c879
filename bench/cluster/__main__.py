"""Benchmarks on an emulated cluster, side by side with MXNet's own dist_sync/dist_async.

    sudo .venv/bin/python -m bench.cluster            # everything, ~25 min
    sudo .venv/bin/python -m bench.cluster --quick    # a smaller version, ~8 min

Every role (scheduler, each server, each worker) runs on a host of its own: a network
namespace joined to a switch namespace by a veth pair, each link shaped with tc to the
configured rate both ways. Three experiments (``--only``):

  matrix   for each workload and link rate: native dist_sync, native dist_async,
           ssd_sync ssgd, asgd and ssd at k in --ks; samples/s, speedup over native
           dist_sync, time blocked per step, bytes per step, the bound and each row's
           fraction of it
  scaling  N in --scaling-workers with emulated compute; efficiency against N times one
           worker's throughput without communication
  tta      the digits demo (real compute, real data): time to --tta-target test accuracy
  hetero   the digits demo with a straggler (debug.slowdown): (a) one worker 2x slower,
           (b) eager-SGD's random delays; throughput, time to accuracy, final accuracy of
           native dist_sync, ssgd, ssd k=5 and preduce P=2; written to hetero.md/.json
           (not cluster.md) so it can run alone
  tta-comm time to accuracy where the links bound the step: a wide MLP (64-H-H-10, about
           4 H^2 bytes of gradient) on the digits at 1 Gbit/s, 4 workers, with and
           without 2bit compression (native dist_sync + 2bit pushes and pulls itself)

Systems are named native-sync, native-async, ssgd, asgd, ssd-kK, each optionally with a
compression suffix: ssd-k5-2bit, ssgd-topk, native-sync-2bit (--threshold, --topk-ratio);
then a 2bit row's own threshold (-tT) and an ssd row's own warm-up steps (-wW), which
override --threshold and the experiment's warm-up for that row only: ssd-k5-2bit-t1-w4;
then, for ssd rows, a glu_state (-exact, -corrected, -estimate) and -staggered
(docs/spec/staggered_pulls.md), and for ssgd and ssd rows -relay (sync.pull_relay: chain,
docs/spec/pull_relay.md), in any order: ssd-k10-2bit-w4-relay, ssgd-relay.

Results go to --out (docs/benchmarks/: cluster.md, cluster.json, PNG plots); every job's
raw per-worker results and logs go to --raw. Needs root; without it, says so and exits 0.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import common  # noqa: E402
from bench.cluster import netns, pages, plan, report  # noqa: E402
from bench.cluster.plan import Workload  # noqa: E402


# ---- arguments -------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(prog='python -m bench.cluster',
                                description=__doc__.split('\n')[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split('\n', 2)[2])
    p.add_argument('--quick', action='store_true', help='a smaller, faster version')
    p.add_argument('--only', default='matrix,scaling,tta',
                   help='comma list of experiments: matrix, scaling, tta, hetero, tta-comm')
    p.add_argument('--name', default='cluster',
                   help='stem of the files written to --out (NAME.md, NAME.json, '
                   'NAME_*.png); use another one to keep the run of record')
    p.add_argument('--threshold', type=float, default=0.5,
                   help='2bit threshold of the -2bit systems (MXNet\'s default 0.5)')
    p.add_argument('--topk-ratio', type=float, default=0.1, help='ratio of the -topk systems')
    p.add_argument('--glu-state', choices=['estimate', 'exact', 'corrected'],
                   help='SSDSGD_GLU_STATE for ssd_sync jobs (default: the code\'s)')
    p.add_argument('--workloads', help='comma list, e.g. emulated:resnet50@1gbit+10gbit,'
                   'real:cifar_resnet20_v1 (default depends on --quick)')
    p.add_argument('--rates', help='default link rates for workloads without @ '
                   '(default 1gbit,10gbit)')
    p.add_argument('--workers', type=int, default=4)
    p.add_argument('--servers', type=int, default=1)
    p.add_argument('--ks', default='2,5,10', help='ssd delay steps k for the matrix')
    p.add_argument('--systems', help='comma list of row ids to run (default all): '
                   'native-sync, native-async, ssgd, asgd, ssd-kK')
    p.add_argument('--compute-ratio', type=float, default=1.0,
                   help='emulated compute per step = this x one push at --compute-ref')
    p.add_argument('--compute-ref', default='1gbit',
                   help='the link rate that defines the emulated compute time')
    p.add_argument('--real-batch', type=int, default=32)
    p.add_argument('--target-s', type=float, help='seconds of timed steps per row')
    p.add_argument('--steps', type=int, help='timed steps per row (overrides --target-s)')
    p.add_argument('--warmup', type=int, default=2, help='untimed steps per row')
    p.add_argument('--scaling-workers', default='1,2,4,8')
    p.add_argument('--scaling-workload', default='emulated:resnet20@1gbit')
    p.add_argument('--scaling-ratio', type=float, default=10.0,
                   help='scaling: compute = this x one push at the scaling link rate')
    p.add_argument('--scaling-systems', default='native-sync,native-async,ssgd,ssd-k5')
    p.add_argument('--tta-rate', default='100mbit')
    p.add_argument('--tta-workers', type=int, default=2)
    p.add_argument('--tta-target', type=float, default=0.95)
    p.add_argument('--tta-epochs', type=int, default=20)
    p.add_argument('--tta-systems', default='native-sync,ssgd,ssd-k5')
    p.add_argument('--tta-warmup', type=int, default=10,
                   help='ssd warm-up steps (digits; the demo config has 50, but 95%% is '
                   'reached at about step 40, inside it)')
    p.add_argument('--hetero-rate', default='100mbit')
    p.add_argument('--hetero-workers', type=int, default=4)
    p.add_argument('--hetero-target', type=_target, default='auto',
                   help="time-to-accuracy target: a fraction, or auto (the default): ssgd's "
                   "final accuracy in the same case minus 0.5 point, so the target is one "
                   "that ssgd needs a good part of the run for, not its first steps")
    p.add_argument('--hetero-epochs', type=int, default=20)
    p.add_argument('--hetero-systems', default=plan.HETERO_SYSTEMS)
    p.add_argument('--hetero-cases', default='slow,random', help='slow, random or both')
    p.add_argument('--hetero-slow', default='delay:0=0.05,1=0.05,2=0.05,3=0.1',
                   help="case (a)'s debug.slowdown: emulated compute of 50 ms per step, "
                   "worker 3 twice as slow")
    p.add_argument('--hetero-random', default='random:0.1:1:0',
                   help="case (b)'s debug.slowdown: eager-SGD's random delays (D s on R "
                   "ranks drawn each step, seeded)")
    p.add_argument('--tta-comm-rate', default='1gbit')
    p.add_argument('--tta-comm-workers', type=int, default=4)
    p.add_argument('--tta-comm-hidden', type=int, default=2048,
                   help='width H of the 64-H-H-10 MLP (2048: 17.4 MB of gradient)')
    p.add_argument('--tta-comm-target', type=float, default=0.95)
    p.add_argument('--tta-comm-epochs', type=int, default=8)
    p.add_argument('--tta-comm-lr', type=float, default=0.1)
    p.add_argument('--tta-comm-warmup', type=int, default=10)
    p.add_argument('--tta-comm-seed', type=int, default=0,
                   help="every row's --seed (initial weights and data order); rerun with "
                   "others to see how far steps to the target move between seeds")
    p.add_argument('--tta-comm-systems',
                   default='native-sync,native-sync-2bit,ssgd,ssgd-2bit,ssd-k5,ssd-k10,'
                   'ssd-k5-2bit,ssd-k10-2bit-w4,ssd-k10-2bit-w4-relay')
    p.add_argument('--latency-ms', type=float, default=0.0,
                   help='added round-trip latency per link (needs netem in the kernel)')
    p.add_argument('--mtu', type=int, default=1500)
    p.add_argument('--memory-fraction', type=float, default=0.6,
                   help='skip a row whose worst-case memory exceeds this x MemAvailable')
    p.add_argument('--out', default=str(REPO / 'docs' / 'benchmarks'),
                   help='where cluster.md, cluster.json and the plots go')
    p.add_argument('--raw', help='per-job results and logs (default: a new temp dir)')
    p.add_argument('--no-write', action='store_true', help='print only; write nothing to --out')
    args = p.parse_args(argv)
    q = args.quick
    if args.workloads is None:
        args.workloads = ('emulated:resnet20@1gbit,emulated:resnet50@1gbit,'
                          'real:cifar_resnet20_v1@1gbit' if q else
                          'emulated:resnet20,emulated:resnet50,real:cifar_resnet20_v1')
    if args.rates is None:
        args.rates = '1gbit,10gbit'
    if args.target_s is None:
        args.target_s = 8.0 if q else 15.0
    if q and args.scaling_workers == '1,2,4,8':
        args.scaling_workers = '1,2,4'
    if q and args.tta_epochs == 20:
        args.tta_epochs = 10
    return args


def _csv(text):
    return [t.strip() for t in str(text).split(',') if t.strip()]


# ---- workloads --------------------------------------------------------------------------
TINY_SHAPES = [[64, 32], [64], [128, 64], [128], [10, 128], [10]]


def model_shapes(model):
    """Trainable parameter shapes of an EMULATED_MODELS entry (or 'tiny')."""
    if model == 'tiny':
        return TINY_SHAPES
    import mxnet as mx
    from gluoncv import model_zoo
    name, shape, _ = plan.EMULATED_MODELS[model]
    net = model_zoo.get_model(name, pretrained=False)
    net.initialize(mx.init.Zero())
    net(mx.nd.zeros(shape))
    return [list(p.shape) for p in net.collect_params().values() if p.grad_req != 'null']


def real_model_bytes(name, image_size):
    import mxnet as mx
    from gluoncv import model_zoo
    net = model_zoo.get_model(name, classes=10, pretrained=False)
    net.initialize(mx.init.Zero())
    net(mx.nd.zeros((1, 3, image_size, image_size)))
    ps = [p for p in net.collect_params().values() if p.grad_req != 'null']
    return sum(p.data().size * 4 for p in ps), len(ps)


PRETTY = {'resnet20': 'ResNet-20', 'resnet50': 'ResNet-50', 'vgg16': 'VGG-16', 'tiny': 'tiny'}


def parse_workload(spec, default_rates, args, raw, ratio=None, ref_rate=None):
    """'emulated:resnet50@1gbit+10gbit' -> (Workload, [rates in bit/s])."""
    body, _, rates = spec.partition('@')
    kind, _, model = body.partition(':')
    rates = [netns.parse_rate(r) for r in (rates.split('+') if rates else default_rates)]
    if kind == 'emulated':
        if model not in plan.EMULATED_MODELS and model != 'tiny':
            raise SystemExit(f'unknown emulated model {model!r}: '
                             f'{", ".join(plan.EMULATED_MODELS)}, tiny')
        shapes = model_shapes(model)
        path = Path(raw) / f'shapes-{model}.json'
        path.write_text(json.dumps({'model': model, 'shapes': shapes}))
        nbytes = sum(4 * _prod(s) for s in shapes)
        batch = plan.EMULATED_MODELS.get(model, (None, None, 32))[2]
        ratio = args.compute_ratio if ratio is None else ratio
        ref = netns.parse_rate(args.compute_ref) if ref_rate is None else ref_rate
        w = Workload(f'emulated {PRETTY.get(model, model)}', 'emulated', model, batch,
                     compute_s=ratio * plan.push_time(nbytes, ref), param_bytes=nbytes,
                     num_keys=len(shapes))
        w.shapes_path = str(path)
        w.compute_rule = f'{ratio:g} x one push at {netns.rate_label(ref)}'
        return w, rates
    if kind == 'real':
        nbytes, nkeys = real_model_bytes(model, 32)
        w = Workload(f'real {model}', 'real', model, args.real_batch, image_size=32,
                     param_bytes=nbytes, num_keys=nkeys)
        return w, rates
    raise SystemExit(f'workload {spec!r}: expected emulated:MODEL or real:GLUONCV_NAME')


def _prod(shape):
    n = 1
    for s in shape:
        n *= int(s)
    return n


def worker_args(workload, steps, warmup):
    args = ['--workload', workload.kind, '--batch', workload.batch, '--steps', steps,
            '--warmup', warmup]
    if workload.kind == 'emulated':
        args += ['--shapes', workload.shapes_path, '--compute-s', f'{workload.compute_s:.6f}']
    else:
        args += ['--model', workload.model, '--image-size', workload.image_size]
    return args


# ---- running ---------------------------------------------------------------------------
class Bench:
    def __init__(self, args, cluster, raw, log):
        self.args, self.cluster, self.raw, self.log = args, cluster, Path(raw), log
        self.notes = []
        self.race_rows = []
        self.job = 0

    def all_notes(self):
        notes = list(self.notes)
        if self.race_rows:
            from bench.cluster import runner
            notes.append(f'{len(self.race_rows)} of {self.job} jobs: {runner.RACE_NOTE} '
                         f'({", ".join(self.race_rows)})')
        return notes

    def mem_available(self):
        try:
            with open('/proc/meminfo') as f:
                for line in f:
                    if line.startswith('MemAvailable'):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return None

    def run(self, system, workload, rate, n, s, steps, warmup, extra_args=None, timeout=None,
            bound_s=None):
        """One job, one row: skipped if it may not fit in memory, 'failed' with the
        error's tail, or the summary of its workers' results."""
        from bench.cluster import runner
        self.job += 1
        warmup = system.warmup_or(warmup)       # a row's own warm-up (-wW) wins
        tag = f'{self.job:03d}-{workload.model}-{int(rate)}-{system.key}-n{n}s{s}'
        out = self.raw / tag
        base = {'system': system.key, 'label': system.label, 'workload': workload.name,
                'rate_bits': rate, 'workers': n, 'servers': s, 'k': system.k, 'steps': steps,
                'warmup': warmup, 'compression': compression_params(system, self.args)}
        skipped = self.memory_skip(system, workload, n, s)
        if skipped:
            return dict(base, status=skipped)
        args = extra_args if extra_args is not None else worker_args(workload, steps, warmup)
        args = list(args) + compression_args(system, self.args)
        t0 = time.monotonic()
        try:
            job_notes = []
            results = runner.run_job_on(self.cluster, system, n, s, args, out, timeout, warmup,
                                        out.with_suffix('.log'), notes=job_notes,
                                        ssd_env=ssd_env(self.args))
            self.take_notes(tag, job_notes)
        except runner.Interrupted as e:
            raise KeyboardInterrupt(str(e)) from None
        except RuntimeError as e:
            return self.failed(base, e, system, workload, rate, out)
        if workload.kind == 'digits':
            return dict(base, status='ok', results=results, job_s=time.monotonic() - t0,
                        loadavg=os.getloadavg()[0])
        row = runner.summarize(results, system, workload, rate, n, s, bound_s)
        row.update(status='ok', job_s=time.monotonic() - t0, loadavg=os.getloadavg()[0])
        if row.get('leftover_pids'):
            self.notes.append(f'{tag}: {row["leftover_pids"]} processes were left in the '
                              'namespaces after the job and were killed')
        return row

    def memory_skip(self, system, workload, n, s):
        """The reason to skip a row whose worst case does not fit in memory, else None."""
        need = plan.memory_needed(system, workload, n, s)
        avail = self.mem_available()
        if avail and need > self.args.memory_fraction * avail:
            msg = (f'skipped: worst case {need / 2**30:.1f} GiB in flight > '
                   f'{self.args.memory_fraction:g} x {avail / 2**30:.1f} GiB available')
            self.log(f'{system.label}: {msg}')
            return msg
        return None

    def take_notes(self, tag, job_notes):
        from bench.cluster import runner
        for note in job_notes:
            if note == runner.RACE_NOTE:
                self.race_rows.append(tag)
            else:
                self.notes.append(f'{tag}: {note}')

    def failed(self, base, error, system, workload, rate, out):
        text = str(error).strip().splitlines()
        self.log(f'{system.label}: FAILED: {text[0] if text else error} '
                 f'(log: {out.with_suffix(".log")})')
        self.notes.append(f'{workload.name} @ {netns.rate_label(rate)}, {system.label}: '
                          f'failed: {" | ".join(text[-6:])[:600]}')
        return dict(base, status='failed', error='\n'.join(text[-30:]))


def compression_params(system, args):
    """kv.set_gradient_compression's dict for ``system`` (None: uncompressed)."""
    if system.compression == '2bit':
        return {'type': '2bit', 'threshold': system.threshold or args.threshold}
    if system.compression == 'topk':
        return {'type': 'topk', 'ratio': args.topk_ratio}
    return None


def compression_args(system, args):
    spec = compression_params(system, args)
    return ['--compression', json.dumps(spec)] if spec else []


def ssd_env(args):
    return {'SSDSGD_GLU_STATE': args.glu_state} if args.glu_state else {}


def timeout_for(pred, steps, warmup):
    return 180 + 4 * pred * (steps + warmup + 2)


def steps_for(args, system, pred):
    if args.steps:
        return max(args.steps, 2 * system.k) if system.k else args.steps
    return plan.choose_steps(system, pred, args.target_s,
                             min_periods=2 if args.quick else 3)


def fmt_row(r):
    if r.get('status') != 'ok':
        return f"{r['label']:<24} {r.get('status')}"
    return (f"{r['label']:<24} {r['samples_per_s']:9.1f} samples/s  {r['step_s']:.3f} s/step  "
            f"blocked {r['blocked_per_step_s']:.3f}  "
            f"{(r.get('wire_bytes_per_step') or 0) / 1e6:8.1f} MB/step  "
            f"of bound {r.get('fraction_of_bound') or 0:.2f}  ({r['steps']} steps, "
            f"job {r['job_s']:.0f} s)")


def run_matrix(bench, args, workloads, log):
    """One group per workload and rate: every system's row, with bounds and speedups;
    yields the groups so far after every group."""
    groups = []
    systems = plan.matrix_systems([int(k) for k in _csv(args.ks)])
    if args.systems:
        systems = [plan.system_by_key(key).resolved(default_glu_state(args))
                   for key in _csv(args.systems)]
    n, s = args.workers, args.servers
    for workload, rates in workloads:
        for rate in rates:
            bench.cluster.shape(rate, args.latency_ms)
            g = {'workload': workload.name, 'workload_desc': workload.describe(),
                 'rate_bits': rate, 'workers': n, 'servers': s, 'rows': [],
                 'glu_state': default_glu_state(args)}
            log(f'--- {workload.describe()} @ {netns.rate_label(rate)}, {n} workers, '
                f'{s} server(s)')
            if workload.kind == 'real':
                g['rows'].append(compute_only_row(bench, args, workload, rate, n, s, log))
            b, by = plan.bound(workload, rate, n, s)
            g.update(bound_samples_per_s=b, bound_by=by, compute_s=workload.compute_s,
                     link_s=plan.link_time(workload.param_bytes, rate, n, s),
                     workload_desc=workload.describe())
            for system in systems:
                pred = plan.predict_step(system, workload, rate, n, s)
                steps = steps_for(args, system, pred)
                row = bench.run(system, workload, rate, n, s, steps, args.warmup,
                                timeout=timeout_for(pred, steps, args.warmup),
                                bound_s=plan.bound(workload, rate, n, s, system=system)[0])
                log(fmt_row(row))
                g['rows'].append(row)
            add_bounds_and_speedups(g, workload, rate, b)
            groups.append(g)
            yield groups
    return groups


def compute_only_row(bench, args, workload, rate, n, s, log):
    """Compute alone: every worker at once, no kvstore (the compute bound); sets the
    workload's compute time from it."""
    st = args.steps or 20
    row = bench.run(plan.COMPUTE_ONLY, workload, rate, n, s, st, args.warmup, timeout=600)
    if row.get('status') == 'ok':
        workload.compute_s = row['compute_per_step_s']
        workload.notes.append(f"compute alone: {row['samples_per_s']:.1f} "
                              f"samples/s, {workload.compute_s:.3f} s/step")
    log(fmt_row(row))
    return row


def default_glu_state(args):
    """The glu_state of ssd rows without one of their own: --glu-state, else the code's."""
    from ssdsgd.settings import BY_NAME
    return args.glu_state or BY_NAME['glu_state'].default


def add_bounds_and_speedups(g, workload, rate, b):
    n, s = g['workers'], g['servers']
    for r in g['rows']:
        system = plan.system_by_key(r['system']).resolved(g.get('glu_state', 'exact'))
        rb = plan.bound(workload, rate, n, s, system=system)[0] \
            if system.compression or system.state_pulls else b
        if workload.kind == 'real' and r.get('compute_per_step_s'):
            # compute alone, as fast as it ran in this very row (the load from
            # other processes changes between rows)
            rb, _ = plan.bound(workload, rate, n, s, compute_s=r['compute_per_step_s'],
                               system=system)
        if not rb:
            continue
        r['bound_samples_per_s'] = rb
        if r.get('samples_per_s'):
            r['fraction_of_bound'] = r['samples_per_s'] / rb
        if r.get('steady_samples_per_s'):
            r['steady_fraction_of_bound'] = r['steady_samples_per_s'] / rb
    base = next((r for r in g['rows'] if r['system'] == 'native-sync'
                 and r.get('samples_per_s')), None)
    for r in g['rows']:
        if base and r.get('samples_per_s'):
            r['speedup'] = r['samples_per_s'] / base['samples_per_s']


def run_scaling(bench, args, log):
    workload, rates = parse_workload(args.scaling_workload, ['1gbit'], args, bench.raw,
                                     ratio=args.scaling_ratio,
                                     ref_rate=netns.parse_rate(
                                         args.scaling_workload.partition('@')[2] or '1gbit'))
    rate = rates[0]
    bench.cluster.shape(rate, args.latency_ms)
    single = workload.batch / workload.compute_s
    sc = {'workload': workload.name, 'workload_desc': workload.describe(), 'rate_bits': rate,
          'servers': args.servers, 'single_samples_per_s': single, 'rows': [],
          'compute_rule': workload.compute_rule}
    systems = [plan.system_by_key(k) for k in _csv(args.scaling_systems)]
    log(f'--- scaling: {workload.describe()} @ {netns.rate_label(rate)}, '
        f'{args.servers} server(s)')
    for n in [int(x) for x in _csv(args.scaling_workers)]:
        for system in systems:
            pred = plan.predict_step(system, workload, rate, n, args.servers)
            steps = steps_for(args, system, pred)
            b, _ = plan.bound(workload, rate, n, args.servers)
            row = bench.run(system, workload, rate, n, args.servers, steps, args.warmup,
                            timeout=timeout_for(pred, steps, args.warmup), bound_s=b)
            row['ideal_samples_per_s'] = n * single
            if row.get('samples_per_s'):
                row['efficiency'] = row['samples_per_s'] / (n * single)
            log(f'N={n} ' + fmt_row(row))
            sc['rows'].append(row)
            yield sc
    return sc


def run_tta(bench, args, log):
    rate = netns.parse_rate(args.tta_rate)
    tta = {'rate_bits': rate, 'workers': args.tta_workers, 'servers': 1,
           'target': args.tta_target,
           'desc': (f'digits_mlp on the 8x8 digits (1437 train / 360 test), batch 32/worker, '
                    f'sgd lr 0.1 momentum 0.9 wd 1e-4 cosine over {args.tta_epochs} epochs; '
                    f'ssd: warm-up {args.tta_warmup} steps'),
           'rows': []}
    wargs = ['--workload', 'digits', '--epochs', args.tta_epochs, '--batch', 32,
             '--lr', 0.1, '--eval-every', 2]
    yield from tta_rows(bench, args, tta, Workload('digits', 'digits', 'digits_mlp', 32),
                        _csv(args.tta_systems), wargs, args.tta_warmup, log)


def run_tta_comm(bench, args, log):
    """Time to accuracy at a comm-bound point: the wide MLP, every row's test accuracy
    measured afterwards on rank 0's weight copies (testing takes no time from the run)."""
    h = args.tta_comm_hidden
    nbytes = 4 * (64 * h + h + h * h + h + h * 10 + 10)
    rate = netns.parse_rate(args.tta_comm_rate)
    n = args.tta_comm_workers
    tta = {'rate_bits': rate, 'workers': n, 'servers': 1, 'target': args.tta_comm_target,
           'param_bytes': nbytes, 'link_s': plan.link_time(nbytes, rate, n, 1),
           'desc': (f'64-{h}-{h}-10 ReLU MLP ({nbytes / 1e6:.1f} MB of gradient) on the 8x8 '
                    f'digits, batch 32/worker, sgd lr {args.tta_comm_lr:g} momentum 0.9 wd '
                    f'1e-4 cosine over {args.tta_comm_epochs} epochs; ssd: warm-up '
                    f'{args.tta_comm_warmup} steps, glu_state '
                    f'{args.glu_state or "(default)"}; 2bit threshold {args.threshold:g}; '
                    f'seed {args.tta_comm_seed}'),
           'rows': []}
    w = Workload(f'digits MLP {h}', 'digits', f'mlp{h}', 32, param_bytes=nbytes)
    yield from tta_rows(bench, args, tta, w, _csv(args.tta_comm_systems),
                        tta_comm_worker_args(args), args.tta_comm_warmup, log)


def tta_comm_worker_args(args):
    """cluster_worker.py's arguments for every tta-comm row (the same for all rows)."""
    return ['--workload', 'digits', '--epochs', args.tta_comm_epochs, '--batch', 32,
            '--lr', args.tta_comm_lr, '--eval-every', 2, '--hidden', args.tta_comm_hidden,
            '--deferred-eval', '--seed', args.tta_comm_seed]


def tta_rows(bench, args, tta, workload, keys, wargs, warmup, log):
    """One time-to-accuracy job per system in ``keys``; yields ``tta`` after each."""
    rate, n = tta['rate_bits'], tta['workers']
    bench.cluster.shape(rate, args.latency_ms)
    log(f"--- time to accuracy: {workload.name} @ {netns.rate_label(rate)}, {n} workers")
    target = tta['target']
    for key in keys:
        system = plan.system_by_key(key)
        row = bench.run(system, workload, rate, n, tta['servers'], 0, warmup,
                        extra_args=wargs, timeout=900)
        if row.get('status') == 'ok':
            add_time_to_target(row, target)
            hit = row['steps_to_target'] is not None
            log(f"{system.label:<24} time to {target:.0%}: "
                f"{report._f(row['time_to_target_s'], '.2f', 'not reached')} s "
                f"(step {row['steps_to_target'] if hit else '-'}), "
                f"final {row['final_accuracy']:.4f}, {row['wall_s']:.1f} s")
        else:
            log(f'{system.label:<24} {row.get("status")}')
        tta['rows'].append(row)
        yield tta


HETERO_CASES = {'slow': ('(a) one worker 2x slower', 'hetero_slow'),
                'random': ("(b) eager-SGD's random delays", 'hetero_random')}


def _target(text):
    """--hetero-target: 'auto' or an accuracy in (0, 1]."""
    if text == 'auto':
        return text
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f'a target accuracy in (0, 1] or auto, got {text}')
    return value


HETERO_AUTO_MARGIN = 0.005     # auto target: ssgd's final accuracy minus 0.5 point


def hetero_target(case, given):
    """The case's target: ``given``, or (auto) ssgd's final accuracy minus 0.5 point
    (0.97 when ssgd's row failed)."""
    if given != 'auto':
        return float(given), f'{given:.0%} (given)'
    ssgd = next((r for r in case['rows'] if r['system'] == 'ssgd' and r.get('status') == 'ok'),
                None)
    if ssgd is None:
        return 0.97, "97% (auto, no ssgd row to take it from)"
    target = round(ssgd['final_accuracy'] - HETERO_AUTO_MARGIN, 6)
    return target, f"{target:.2%} = ssgd's final {ssgd['final_accuracy']:.2%} - 0.5 point (auto)"


def run_hetero(bench, args, log):
    """Each straggler case, each system: the digits demo with --slowdown; yields the
    results so far after every row."""
    rate = netns.parse_rate(args.hetero_rate)
    bench.cluster.shape(rate, args.latency_ms)
    n, s = args.hetero_workers, 1
    w = Workload('digits', 'digits', 'digits_mlp', 32)
    het = {'rate_bits': rate, 'workers': n, 'servers': s, 'target': args.hetero_target,
           'desc': (f'digits_mlp on the 8x8 digits, batch 32/worker, sgd lr 0.1 momentum 0.9 '
                    f'wd 1e-4 cosine over {args.hetero_epochs} epochs; ssd: warm-up '
                    f'{args.tta_warmup} steps'), 'cases': []}
    for name in _csv(args.hetero_cases):
        title, attr = HETERO_CASES[name]
        case = {'name': name, 'title': title, 'slowdown': getattr(args, attr), 'rows': []}
        het['cases'].append(case)
        log(f'--- heterogeneity {title} (debug.slowdown {case["slowdown"]}): digits @ '
            f'{netns.rate_label(rate)}, {n} workers')
        for key in _csv(args.hetero_systems):
            system = plan.system_by_key(key)
            wargs = ['--workload', 'digits', '--epochs', args.hetero_epochs, '--batch', 32,
                     '--lr', 0.1, '--eval-every', 2, '--slowdown', case['slowdown'],
                     # rank 0 is a fast worker: evaluating on its clock would slow the
                     # tolerant rows' rank 0 only, where a synchronous row hides it
                     '--deferred-eval']
            row = bench.run(system, w, rate, n, s, 0, args.tta_warmup, extra_args=wargs,
                            timeout=1200)
            if row.get('status') == 'ok':
                add_worker_throughput(row)
                add_time_to_target(row, 1.01)       # the curve; the target comes below
                log(f"{system.label:<24} {row['samples_per_s']:8.1f} samples/s, final "
                    f"{row['final_accuracy']:.4f}, {row['wall_s']:.1f} s")
            else:
                log(f'{system.label:<24} {row.get("status")}')
            case['rows'].append(row)
            yield het
        case['target'], case['target_rule'] = hetero_target(case, args.hetero_target)
        for row in case['rows']:
            if row.get('status') == 'ok':
                mark_target(row, case['target'])
                log(f"{row['label']:<24} time to {case['target']:.2%}: "
                    f"{report._f(row['time_to_target_s'], '.2f', 'not reached')} s (step "
                    f"{report._f(row['steps_to_target'], 'd', '-')})")
        case['checks'] = hetero_checks(case)
        yield het
    return het


def add_worker_throughput(row):
    """Samples/s of the job while its workers train: each worker's samples over its own
    time in the training loop, summed (a fast worker that finished early counts at its
    own rate; the wall time of the whole job is ``wall_s``)."""
    res = row['results']
    row['samples_per_s'] = sum(r['steps'] * r['batch'] / (r['t_end'] - r['t_start'])
                               for r in res if r['t_end'] > r['t_start'])
    row['worker_steps'] = [r['steps'] for r in res]


def hetero_checks(case):
    """Issue 11's targets, case (a): the best straggler-tolerant row against ssgd (the
    one that meets the most targets, then the fastest)."""
    rows = {r['system']: r for r in case['rows'] if r.get('status') == 'ok'}
    ssgd = rows.get('ssgd')
    tolerant = [r for key, r in rows.items() if plan.system_by_key(key).straggler_tolerant]
    if case['name'] != 'slow' or not ssgd or not tolerant:
        return []
    best = max(tolerant, key=lambda r: (sum(bool(c['met']) for c in _checks(r, ssgd)),
                                        r['samples_per_s']))
    return _checks(best, ssgd)


def _checks(best, ssgd):
    """The three targets of one row against ssgd's."""
    checks = [{'what': f"{best['label']} throughput / ssgd", 'target': '>= 1.6',
               'measured': best['samples_per_s'] / ssgd['samples_per_s']}]
    if best.get('time_to_target_s') and ssgd.get('time_to_target_s'):
        checks.append({'what': f"ssgd's time to target / {best['label']}'s", 'target': '>= 1.4',
                       'measured': ssgd['time_to_target_s'] / best['time_to_target_s']})
    else:
        checks.append({'what': f"ssgd's time to target / {best['label']}'s (not reached)",
                       'target': '>= 1.4', 'measured': None})
    checks.append({'what': f"{best['label']} final accuracy - ssgd's", 'target': '>= -0.01',
                   'measured': best['final_accuracy'] - ssgd['final_accuracy']})
    for c, limit in zip(checks, (1.6, 1.4, -0.01)):
        c['met'] = None if c['measured'] is None else c['measured'] >= limit
        c['measured'] = report._f(c['measured'], '.3f')
    return checks


def mark_target(row, target):
    """The first evaluation of rank 0's curve at or above ``target``: its time and step."""
    hit = next((e for e in row['curve'] if e[2] >= target - 1e-9), None)
    row.update(target=target, time_to_target_s=hit[1] if hit else None,
               steps_to_target=hit[0] if hit else None)


def add_time_to_target(row, target):
    """From rank 0's accuracy curve: the first step and time at ``target``, the final and
    best accuracy, the job's wall time."""
    res = row.pop('results')
    r0 = next(r for r in res if r.get('evals'))
    curve = sorted(r0['evals'])
    hit = next((e for e in curve if e[2] >= target), None)
    wall = max(r['t_end'] for r in res) - min(r['t_start'] for r in res)
    steps = max(r0['steps'], 1)
    if all('cpu_s' in r for r in res):
        row['worker_cpu_per_step_s'] = sum(r['cpu_s'] for r in res) / len(res) / steps
    if res[0].get('server_cpu_s'):
        row['server_cpu_per_step_s'] = res[0]['server_cpu_s'] / steps
    row.update(curve=curve, steps=r0['steps'], wall_s=wall, step_s=wall / steps,
               final_accuracy=curve[-1][2] if curve else None,
               best_accuracy=max(e[2] for e in curve) if curve else None,
               time_to_target_s=hit[1] if hit else None,
               steps_to_target=hit[0] if hit else None)


def comm_bound_checks(matrix, args):
    """The issue's targets at the comm-bound point (ResNet-50 shapes, 1 Gbit/s, compute =
    one push at 1 Gbit/s, 4 workers, 1 server)."""
    g = next((g for g in matrix if g['workload'] == 'emulated ResNet-50'
              and abs(g['rate_bits'] - 1e9) < 1 and g['workers'] == 4 and g['servers'] == 1
              and args.compute_ratio == 1.0
              and netns.parse_rate(args.compute_ref) == 1e9), None)
    if g is None:
        return []
    rows = {r['system']: r for r in g['rows']}
    nat, k5, ssgd = rows.get('native-sync'), rows.get('ssd-k5'), rows.get('ssgd')
    checks = []

    def ok(r):
        return r is not None and r.get('samples_per_s')
    sp = k5['samples_per_s'] / nat['samples_per_s'] if ok(k5) and ok(nat) else None
    checks.append({'what': 'ssd k=5 throughput / native dist_sync', 'target': '>= 2.0',
                   'measured': report._f(sp, '.2f'), 'met': None if sp is None else sp >= 2.0})
    fr = k5.get('fraction_of_bound') if ok(k5) else None
    checks.append({'what': 'ssd k=5 fraction of the bound (whole timed region, final drain '
                   'included)', 'target': '>= 0.8',
                   'measured': report._f(fr, '.2f'), 'met': None if fr is None else fr >= 0.8})
    sf = k5.get('steady_fraction_of_bound') if ok(k5) else None
    checks.append({'what': 'ssd k=5 fraction of the bound (steady state, whole pull periods)',
                   'target': '>= 0.8', 'measured': report._f(sf, '.2f'),
                   'met': None if sf is None else sf >= 0.8})
    rs = ssgd['samples_per_s'] / nat['samples_per_s'] if ok(ssgd) and ok(nat) else None
    checks.append({'what': 'ssd_sync ssgd throughput / native dist_sync',
                   'target': 'within 0.90-1.10 (or better)', 'measured': report._f(rs, '.2f'),
                   'met': None if rs is None else rs >= 0.9})
    nat2 = rows.get('native-sync-2bit')
    for key, c5 in rows.items():    # ssd-k5-2bit, and with a glu_state of its own
        if key != 'ssd-k5-2bit' and not key.startswith('ssd-k5-2bit-'):
            continue
        state = f" ({c5['glu_state']})" if c5.get('glu_state') else ''
        if c5.get('pull_schedule') == 'staggered':
            state += ' (staggered pulls)'
        if c5.get('pull_relay') == 'chain':
            state += ' (relayed pulls)'
        for base, name, want in ((nat, 'native dist_sync', 3.0),
                                 (nat2, 'native dist_sync + 2bit (push/pull)', 1.5)):
            r = c5['samples_per_s'] / base['samples_per_s'] if ok(c5) and ok(base) else None
            checks.append({'what': f'ssd k=5 + 2bit{state} throughput / {name}',
                           'target': f'>= {want}', 'measured': report._f(r, '.2f'),
                           'met': None if r is None else r >= want})
            # the same over whole pull periods (no start, no final drain): what a long
            # job sees; printed beside the whole timed region, which the target is judged on
            s5, sb = c5.get('steady_samples_per_s'), (base or {}).get('steady_samples_per_s')
            if s5 and sb:
                checks.append({'what': f'ssd k=5 + 2bit{state} steady-state throughput / '
                               f'{name} steady state', 'target': f'>= {want}',
                               'measured': report._f(s5 / sb, '.2f'), 'met': s5 / sb >= want})
    return [c for c in checks if c['measured'] != '-']


def tta_comm_checks(tta):
    """Issue 10's targets for the comm-bound time to accuracy: the best ssd row >= 2x
    sooner to the target than native dist_sync, >= 1.3x sooner than native + 2bit, and its
    final accuracy within 1 point of ssgd's. The best row is the one that meets the most
    of them, then the first to reach the target (as hetero_checks): the fastest row may be
    one whose final accuracy misses while another row meets all three."""
    rows = {r['system']: r for r in tta.get('rows', []) if r.get('status') == 'ok'}
    ssd = [r for k, r in rows.items() if k.startswith('ssd-') and r.get('time_to_target_s')]
    if not ssd:
        return []
    best = max(ssd, key=lambda r: (sum(bool(c['met']) for c in _tta_comm_row(r, rows, tta)),
                                   -r['time_to_target_s']))
    return _tta_comm_row(best, rows, tta)


def _tta_comm_row(best, rows, tta):
    """The three targets of one ssd row."""
    checks = []
    for key, name, want in (('native-sync', 'native dist_sync', 2.0),
                            ('native-sync-2bit', 'native dist_sync + 2bit', 1.3)):
        base = rows.get(key)
        if base is None:
            continue
        t = base.get('time_to_target_s')
        r = None if t is None else t / best['time_to_target_s']
        checks.append({'what': f"time to {tta['target']:.0%}: {name} / best ssd "
                       f"({best['label']})", 'target': f'>= {want}',
                       'measured': report._f(r, '.2f', 'not reached by ' + name),
                       'met': True if t is None else r >= want})
    sg = rows.get('ssgd')
    if sg and sg.get('final_accuracy') is not None:
        d = best['final_accuracy'] - sg['final_accuracy']
        checks.append({'what': f"final accuracy: {best['label']} - ssgd", 'target': '>= -0.01',
                       'measured': f'{d:+.4f}', 'met': d >= -0.01})
    return checks


# ---- main ------------------------------------------------------------------------------
def log(text):
    print(f'[bench.cluster] {text}', flush=True)


def main(argv=None):
    args = parse_args(argv)
    started = time.monotonic()
    code = preflight(args)
    if code is not None:
        return code
    old_term = signal.signal(signal.SIGTERM, _term_as_interrupt)
    netns.clean_stale(log)
    only = set(_csv(args.only))
    raw = Path(args.raw) if args.raw else Path(tempfile.mkdtemp(prefix='bench-cluster-'))
    raw.mkdir(parents=True, exist_ok=True)
    log(f'raw results and logs: {raw}')
    # workloads first (shapes need MXNet and gluoncv, not the cluster)
    workloads = []
    if 'matrix' in only:
        workloads = [parse_workload(spec, _csv(args.rates), args, raw)
                     for spec in _csv(args.workloads)]
    src_start = report.source_hash()
    results = new_results(args, argv, workloads)
    bench, interrupted = run_experiments(args, only, raw, workloads, results, old_term)
    finish_results(results, bench, interrupted, started, src_start)
    save_raw(raw, results)
    print_summary(results)
    if not args.no_write:
        write_outputs(results, Path(args.out), args.name)
    if interrupted:
        return 130
    return 1 if any_failed(results) else 0


def preflight(args):
    """None when the cluster can be built here, else the exit code (0: no root, said so)."""
    try:
        netns.check_available()
    except netns.NetnsUnavailable as e:
        print(f'bench.cluster: cannot build the emulated cluster: {e}. Nothing was run.',
              flush=True)
        return 0
    if args.latency_ms > 0 and not netns.netem_available():
        print('bench.cluster: --latency-ms needs the netem qdisc, which this kernel does not '
              'have (CONFIG_NET_SCH_NETEM); run without it.', file=sys.stderr)
        return 2
    return None


def hosts_needed(args, only):
    max_n = max([args.workers]
                + ([int(x) for x in _csv(args.scaling_workers)] if 'scaling' in only else [])
                + ([args.tta_workers] if 'tta' in only else [])
                + ([args.hetero_workers] if 'hetero' in only else [])
                + ([args.tta_comm_workers] if 'tta-comm' in only else []))
    return 1 + args.servers + max_n


def new_results(args, argv, workloads):
    command = 'python -m bench.cluster ' + ' '.join(
        shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    return {'meta': {'command': command, 'machine': common.machine_info(),
                     'settings': settings(args, workloads)},
            'matrix': [], 'scaling': {}, 'tta': {}, 'hetero': {}, 'tta_comm': {}, 'checks': []}


def _term_as_interrupt(signum, _frame):
    raise KeyboardInterrupt(signal.Signals(signum).name)


def run_experiments(args, only, raw, workloads, results, old_term):
    """Build the cluster, run the experiments in ``only`` (saving raw results after every
    row), tear it down and put ``old_term`` back as the SIGTERM handler; returns (Bench
    or None, whether it was interrupted)."""
    bench = cluster = None
    interrupted = False
    try:
        cluster = netns.Cluster(hosts_needed(args, only), log=log, mtu=args.mtu)
        bench = Bench(args, cluster, raw, log)
        cluster.shape(1e9)
        results['meta']['shaping'] = shaping_text(cluster, args)
        run_parts(bench, args, only, raw, workloads, results)
    except KeyboardInterrupt as e:
        interrupted = True
        log(f'interrupted ({e or "Ctrl-C"}): tearing the cluster down; partial results kept')
    finally:
        if cluster is not None:
            cluster.close()
            left = [ns for ns in netns.list_namespaces() if ns.startswith(
                f'{netns.PREFIX}{os.getpid()}-')]
            log('cluster removed' if not left else f'namespaces left: {left}')
        signal.signal(signal.SIGTERM, old_term)
    return bench, interrupted


def run_parts(bench, args, only, raw, workloads, results):
    if 'matrix' in only:
        for groups in run_matrix(bench, args, workloads, log):
            results['matrix'] = groups
            save_raw(raw, results)
        results['checks'] = comm_bound_checks(results['matrix'], args)
    if 'scaling' in only:
        for sc in run_scaling(bench, args, log):
            results['scaling'] = sc
            save_raw(raw, results)
    if 'tta' in only:
        for tta in run_tta(bench, args, log):
            results['tta'] = tta
            save_raw(raw, results)
    if 'hetero' in only:
        for het in run_hetero(bench, args, log):
            results['hetero'] = het
            save_raw(raw, results)
    if 'tta-comm' in only:
        for tta in run_tta_comm(bench, args, log):
            results['tta_comm'] = tta
            tta['checks'] = tta_comm_checks(tta)
            save_raw(raw, results)


def finish_results(results, bench, interrupted, started, src_start):
    """Elapsed time, the source hash, and the notes (a source change mid-run included)."""
    results['meta']['elapsed_s'] = time.monotonic() - started
    src_end = report.source_hash()
    results['meta']['machine']['ssdsgd_sources'] = src_start
    if src_end != src_start and bench is not None:
        bench.notes.append(f'ssdsgd/ changed during this run (sources {src_start} at the start, '
                           f'{src_end} at the end): rows started after the change ran the new '
                           'code; rerun for a consistent table')
    results['meta']['notes'] = (bench.all_notes() if bench else []) + \
        (['the run was interrupted; the tables are partial'] if interrupted else [])


def write_outputs(results, out, name='cluster'):
    out.mkdir(parents=True, exist_ok=True)
    if results.get('hetero', {}).get('cases'):
        (out / 'hetero.json').write_text(json.dumps(strip_for_json(
            {'meta': results['meta'], 'hetero': results['hetero']}), indent=1))
        (out / 'hetero.md').write_text(pages.hetero_markdown(results))
        record(results, out, 'hetero')
        log(f'wrote {out / "hetero.md"} and {out / "hetero.json"}')
    if not (results.get('matrix') or results.get('scaling', {}).get('rows')
            or results.get('tta', {}).get('rows') or results.get('tta_comm', {}).get('rows')):
        return      # NAME.md keeps the last full run's tables
    images = report.plots(results, out, name)
    (out / f'{name}.json').write_text(json.dumps(strip_for_json(results), indent=1))
    (out / f'{name}.md').write_text(pages.markdown(results, images, name))
    record(results, out, name)
    log(f'wrote {out / (name + ".md")}, {out / (name + ".json")} and '
        f'{", ".join(p.name for p in images)}')


def record(results, out, stem):
    """The run's date and commit go to docs/history.md when its page is one of the docs."""
    if out.resolve() == (REPO / 'docs' / 'benchmarks').resolve():
        pages.record_run(results, stem)


def any_failed(results):
    rows = [r for g in results['matrix'] for r in g['rows']]
    rows += results.get('scaling', {}).get('rows', [])
    rows += results.get('tta', {}).get('rows', [])
    rows += [r for c in results.get('hetero', {}).get('cases', []) for r in c['rows']]
    rows += results.get('tta_comm', {}).get('rows', [])
    return any(r.get('status') == 'failed' for r in rows)


def settings(args, workloads):
    s = {'workers x servers (matrix)': f'{args.workers} x {args.servers}',
         'ssd delay steps k (matrix)': args.ks,
         'untimed steps per row': f'{args.warmup} (ssd_sync: SSDSGD_WARMUP_STEPS={args.warmup}, '
                                  'so every timed step is in the steps-delay stage)',
         'timed steps per row': (f'{args.steps}' if args.steps else
                                 f'about {args.target_s:g} s worth (predicted), at least '
                                 '5, at least 3k for ssd'),
         'emulated compute': f'{args.compute_ratio:g} x one push at {args.compute_ref} '
                             '(time.sleep)',
         'optimizer': 'sgd, momentum 0.9, on the servers (update_on_kvstore)',
         'OMP_NUM_THREADS / MXNET_CPU_WORKER_NTHREADS': '1 / 1 in every process',
         'MTU': args.mtu}
    for w, rates in workloads:
        s[f'workload {w.name}'] = w.describe() + ' @ ' + ', '.join(
            netns.rate_label(r) for r in rates)
    return s


def shaping_text(cluster, args):
    lat = f', plus {args.latency_ms:g} ms round trip (netem)' if args.latency_ms else ''
    return ('tbf on both ends of every host veth (host uplink: the host end; downlink: the '
            'switch end), rate as in each table, burst = 2 ms of traffic (>= 32 KB), queue '
            f'20 ms{lat}; e.g. {cluster.qdisc_summary(0)[0]}')


def strip_for_json(results):
    return json.loads(json.dumps(results, default=str))


def save_raw(raw, results):
    (Path(raw) / 'results.json').write_text(json.dumps(strip_for_json(results), indent=1))


def print_summary(results):
    print()
    if results.get('matrix'):
        print(report.matrix_tables(results['matrix']))
    if results.get('scaling', {}).get('rows'):
        print(report.scaling_table(results['scaling']))
    if results.get('tta', {}).get('rows'):
        print(report.tta_table(results['tta']))
    if results.get('hetero', {}).get('cases'):
        print(report.hetero_tables(results['hetero']))
    if results.get('tta_comm', {}).get('rows'):
        print(report.tta_table(results['tta_comm']))
        print(report.checks_text(results['tta_comm'].get('checks', [])))
    if results.get('checks'):
        print('Comm-bound point (ResNet-50 shapes, 1 Gbit/s, compute = one push, 4 workers, '
              '1 server):')
        print(report.checks_text(results['checks']))
    for n in results['meta'].get('notes', []):
        print(f'note: {n}')


if __name__ == '__main__':
    sys.exit(main())
