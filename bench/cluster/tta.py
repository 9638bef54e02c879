"""Time to accuracy: the digits demo (``--only tta``: real compute, real data) and the
wide MLP where the links bound the step (``--only tta-comm``), with the latter's targets;
rank 0's accuracy curve gives each row's time and steps to the target."""
from __future__ import annotations

from . import netns, plan, report, rows, seeds
from .plan import Workload
from .runner import moved_bytes_per_worker
from .targets import check


def run_tta(bench, args, log):
    rate = netns.parse_rate(args.tta_rate)
    tta = {'rate_bits': rate, 'workers': args.tta_workers, 'servers': 1,
           'target': args.tta_target,
           'desc': (f'digits_mlp on the 8x8 digits (1437 train / 360 test), batch 32/worker, '
                    f'sgd lr 0.1 momentum 0.9 wd 1e-4 cosine over {args.tta_epochs} epochs; '
                    f'ssd: warm-up {args.tta_warmup} steps'),
           'seeds': seeds.seeds_of(args, 'tta'), 'rows': []}
    wargs = ['--workload', 'digits', '--epochs', args.tta_epochs, '--batch', 32,
             '--lr', 0.1, '--eval-every', 2]
    yield from tta_rows(bench, args, tta, Workload('digits', 'digits', 'digits_mlp', 32),
                        rows.catalog().names('tta', args.tta_systems),
                        lambda seed: wargs + ['--seed', seed], args.tta_warmup, log)


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
                    f'{seeds_label(seeds.seeds_of(args, "tta-comm"))}'),
           'seeds': seeds.seeds_of(args, 'tta-comm'), 'rows': []}
    w = Workload(f'digits MLP {h}', 'digits', f'mlp{h}', 32, param_bytes=nbytes)
    yield from tta_rows(bench, args, tta, w,
                        rows.catalog().names('tta-comm', args.tta_comm_systems),
                        lambda seed: tta_comm_worker_args(args, seed), args.tta_comm_warmup,
                        log)


def seeds_label(values):
    return f"seed{'s' if len(values) > 1 else ''} {', '.join(map(str, values))}"


def tta_comm_worker_args(args, seed=None):
    """cluster_worker.py's arguments for every tta-comm row of one seed (default: the
    first of the experiment's seeds)."""
    if seed is None:
        seed = seeds.seeds_of(args, 'tta-comm')[0]
    return ['--workload', 'digits', '--epochs', args.tta_comm_epochs, '--batch', 32,
            '--lr', args.tta_comm_lr, '--eval-every', 2, '--hidden', args.tta_comm_hidden,
            '--deferred-eval', '--seed', seed]


def tta_rows(bench, args, tta, workload, systems, wargs, warmup, log):
    """One time-to-accuracy job per row in ``systems`` and seed of ``tta['seeds']``
    (``wargs(seed)``: the worker's arguments), the rows of one seed one after another, so
    a slow spell of the shared machine hits every row of a seed alike rather than every
    seed of one row; yields ``tta`` after each job, its aggregate brought up to date."""
    rate, n = tta['rate_bits'], tta['workers']
    bench.cluster.shape(rate, args.latency_ms)
    log(f"--- time to accuracy: {workload.name} @ {netns.rate_label(rate)}, {n} workers")
    target, order = tta['target'], tta['seeds']
    for i, seed in enumerate(order):
        if len(order) > 1:
            log(f'--- seed {seed} ({i + 1} of {len(order)})')
        for system in systems:
            row = bench.run(system, workload, rate, n, tta['servers'], 0, warmup,
                            extra_args=wargs(seed), timeout=900)
            row['seed'] = seed
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
            tta['aggregate'] = seeds.aggregate(tta['rows'], order)
            yield tta
    if len(order) > 1:
        log_aggregate(tta, log)


def log_aggregate(tta, log):
    """Each row's aggregate over the seeds, one line each."""
    log(f"--- over {seeds_label(tta['seeds'])} (MLPerf: fastest and slowest dropped)")
    for a in tta['aggregate']:
        log(f"{a['label']:<24} time to {tta['target']:.0%}: "
            f"{seeds.cell(a, 'time_to_target_s', '.2f', 'not reached')} s "
            f"({a.get('reached', 0)} of {a['runs']} reached), final "
            f"{seeds.cell(a, 'final_accuracy', '.4f')}")


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
    moved = moved_bytes_per_worker(res)       # over the job: first step to last exchange
    if moved is not None:
        row['moved_mb_per_worker'] = moved / 1e6
    row.update(curve=curve, steps=r0['steps'], wall_s=wall, step_s=wall / steps,
               final_accuracy=curve[-1][2] if curve else None,
               best_accuracy=max(e[2] for e in curve) if curve else None,
               time_to_target_s=hit[1] if hit else None,
               steps_to_target=hit[0] if hit else None)


def tta_comm_checks(tta):
    """The targets of the comm-bound time to accuracy (docs/benchmarks/targets.md) for the
    best ssd row: the one that meets the most of them, then the first to reach the target
    (as hetero_checks): the fastest row may be one whose final accuracy misses while
    another row meets all three. With several seeds every figure is the row's aggregate
    (seeds.py), so the ratios are of the aggregates. The defaults row is not a candidate (its steps are the
    synchronous warm-up of a user's defaults)."""
    done = {r['system']: r for r in seeds.judged(tta) if r.get('status') == 'ok'}
    ssd = [r for key, r in done.items() if _ssd_row(key) and r.get('time_to_target_s')]
    if not ssd:
        return []
    best = max(ssd, key=lambda r: (sum(bool(c['met']) for c in _tta_comm_row(r, done, tta)),
                                   -r['time_to_target_s']))
    return _tta_comm_row(best, done, tta)


def _in_how_many(agg):
    """' in n of N seeds' for an aggregate of several seeds, else ''."""
    runs = agg.get('runs', 1)
    return f" in {runs - agg.get('reached', 0)} of {runs} seeds" if runs > 1 else ''


def _ssd_row(name):
    system = rows.catalog().systems.get(name)
    return system is not None and system.mode == 'ssd' and not system.defaults


def _tta_comm_row(best, done, tta):
    """The three targets of one ssd row."""
    checks = []
    for key, name, target in (('native-sync', 'native dist_sync', 'tta_comm.vs_native'),
                              ('native-sync-2bit', 'native dist_sync + 2bit',
                               'tta_comm.vs_native_2bit')):
        base = done.get(key)
        if base is None:
            continue
        t = base.get('time_to_target_s')
        c = check(f"time to {tta['target']:.0%}: {name} / best ssd ({best['label']})", target,
                  None if t is None else t / best['time_to_target_s'],
                  none=f'not reached by {name}{_in_how_many(base)}')
        checks.append(dict(c, met=True) if t is None else c)
    sg = done.get('ssgd')
    if sg and sg.get('final_accuracy') is not None:
        checks.append(check(f"final accuracy: {best['label']} - ssgd", 'tta_comm.final_vs_ssgd',
                            best['final_accuracy'] - sg['final_accuracy'], fmt='+.4f'))
    return checks
