"""Slow workers (``--only hetero``) by the wall clock: the digits demo with a straggler
(debug.slowdown), (a) one worker 2x slower, (b) eager-SGD's random delays (and, on
request, ``even``: nobody slowed). Every job trains one budget of batches (epochs x
steps per epoch x N); the rows that need not wait for a slow worker (a quorum, preduce)
take their batches from dynamic data, so a fast worker keeps training while one lags.
Each row: the job's wall time from its launch, samples applied per second of it, and
when the global model (global_model.py: tested by the bench, off the workers' path)
first reached the target; issue 26's targets on the best tolerant row."""
from __future__ import annotations

import argparse
from pathlib import Path

from . import global_model, netns, report, rows, seeds
from .jobs import csv
from .plan import Workload
from .targets import check


HETERO_CASES = {'slow': ('(a) one worker 2x slower', 'hetero_slow'),
                'random': ("(b) eager-SGD's random delays", 'hetero_random'),
                'even': ('(c) no slow worker', None)}


def parse_target(text):
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
    (0.97 when ssgd's row failed); with several seeds ssgd's MLPerf aggregate of them."""
    if given != 'auto':
        return float(given), f'{given:.0%} (given)'
    finals = [r['final_accuracy'] for r in case['rows'] if r['system'] == 'ssgd'
              and r.get('status') == 'ok' and r.get('final_accuracy') is not None]
    if not finals:
        return 0.97, "97% (auto, no ssgd row to take it from)"
    final = seeds.olympic(finals)['mean']
    over = f' (MLPerf aggregate of {len(finals)} seeds)' if len(finals) > 1 else ''
    target = round(final - HETERO_AUTO_MARGIN, 6)
    return target, f"{target:.2%} = ssgd's final {final:.2%}{over} - 0.5 point (auto)"


def run_hetero(bench, args, log):
    """Each straggler case, each seed of --seeds, each system (a seed's rows one after
    another): the digits demo with --slowdown; yields the results so far after every
    row."""
    rate = netns.parse_rate(args.hetero_rate)
    bench.cluster.shape(rate, args.latency_ms)
    n = args.hetero_workers
    order = seeds.seeds_of(args, 'hetero')
    het = {'rate_bits': rate, 'workers': n, 'servers': 1, 'target': args.hetero_target,
           'desc': (f'digits_mlp on the 8x8 digits, batch 32/worker, sgd lr 0.1 momentum 0.9 '
                    f'wd 1e-4 cosine over {args.hetero_epochs} epochs, a budget of '
                    f'{args.hetero_epochs} epochs of batches (dynamic data in the tolerant '
                    f'rows); ssd: warm-up {args.tta_warmup} steps'),
           'seeds': order, 'cases': []}
    for name in csv(args.hetero_cases):
        title, attr = HETERO_CASES[name]
        case = {'name': name, 'title': title,
                'slowdown': getattr(args, attr) if attr else 'none',
                'seeds': order, 'rows': []}
        het['cases'].append(case)
        log(f'--- heterogeneity {title} (debug.slowdown {case["slowdown"]}): digits @ '
            f'{netns.rate_label(rate)}, {n} workers')
        for i, seed in enumerate(order):
            if len(order) > 1:
                log(f'--- seed {seed} ({i + 1} of {len(order)})')
            for system in rows.catalog().names('hetero', args.hetero_systems):
                case['rows'].append(run_row(bench, args, system, case, het, seed, log))
                yield het
        finish_case(case, args, log)
        yield het
    return het


SNAPSHOT_EVERY = 2      # the servers copy the global model every 2 updates


def run_row(bench, args, system, case, het, seed, log):
    """One row of a case on one seed: its wall clock, throughput and accuracy curve."""
    w = Workload('digits', 'digits', 'digits_mlp', 32)
    servers = global_model.from_servers(system)
    # the servers' snapshots need nothing of a worker; elsewhere rank 0 copies its
    # weights every 2 steps and tests the copies after its training
    evals = ['--eval-every', 0] if servers else ['--eval-every', 2, '--deferred-eval']
    wargs = ['--workload', 'digits', '--epochs', args.hetero_epochs, '--batch', 32,
             '--lr', 0.1, '--slowdown', case['slowdown'], '--seed', seed] + evals
    row = bench.run(system, w, het['rate_bits'], het['workers'], het['servers'], 0,
                    args.tta_warmup, extra_args=wargs, timeout=1200,
                    snapshot_every=SNAPSHOT_EVERY if servers else 0)
    row['seed'] = seed
    if row.get('status') == 'ok':
        try:
            add_wall_clock(row, servers, het)
        except (RuntimeError, ValueError, OSError) as e:
            log(f'{system.label}: FAILED: {e}')
            return dict(row, status='failed', error=str(e))
        log(f"{system.label:<24} {row['samples_per_s']:8.1f} samples/s applied, final "
            f"{row['final_accuracy']:.4f}, job {row['wall_s']:.1f} s (training "
            f"{row['train_s']:.1f} s), batches {row['worker_steps']}")
    else:
        log(f'{system.label:<24} {row.get("status")}')
    return row


def add_wall_clock(row, servers, het):
    """The row's figures on the job's clock (seconds from its launch): the global
    model's curve, the wall time, samples applied per second of it; the target comes
    once every seed ran (finish_case)."""
    res = row.pop('results')
    n, launched = het['workers'], row['launched']
    steps = [r['steps'] for r in res]
    batch = res[0]['batch']
    if servers:
        curve, final = global_model.server_curve(Path(row['out']) / 'snapshots',
                                                 het['servers'], n, launched)
        if final['pushes'] != sum(steps):
            raise RuntimeError(f"the servers applied {final['pushes']} pushes, the workers "
                               f"sent {sum(steps)}")
        row['snapshots_dropped'] = final['dropped']
    else:
        curve = global_model.rank0_curve(next(r for r in res if r['rank'] == 0), launched)
    applied = sum(steps) * batch     # every push is applied once (quorum.md rule 1)
    wall = row['ended'] - launched
    row.update(curve=curve, worker_steps=steps, samples_applied=applied, wall_s=wall,
               samples_per_s=applied / wall,
               startup_s=min(r['t_start'] for r in res) - launched,
               startup_parts=startup_parts(res, launched),
               train_s=max(r['t_end'] for r in res) - min(r['t_start'] for r in res),
               final_accuracy=curve[-1][2] if curve else None,
               best_accuracy=max(e[2] for e in curve) if curve else None)


def startup_parts(res, launched):
    """Seconds from the launch until the job's last worker had Python running (its module
    started), MXNet imported (numpy and ssdsgd before it) and its store made; the
    barrier after them ends the start-up."""
    names = ('python', 'mxnet', 'kvstore')
    return {name: max(r['startup_marks'][name] for r in res) - launched for name in names}


def finish_case(case, args, log):
    """Once every seed ran: the case's target, each run's time to it, the rows'
    aggregates over the seeds, and the checks (on the aggregates)."""
    case['target'], case['target_rule'] = hetero_target(case, args.hetero_target)
    for row in case['rows']:
        if row.get('status') == 'ok':
            mark_target(row, case['target'])
            log(f"{row['label']:<24} time to {case['target']:.2%}: "
                f"{report._f(row['time_to_target_s'], '.2f', 'not reached')} s from the "
                f"launch ({report._f(row['steps_to_target'], '.0f', '-')} global batches)")
    case['aggregate'] = seeds.aggregate(case['rows'], case['seeds'])
    for agg in case['aggregate']:
        steps = [r['worker_steps'] for r in case['rows'] if r['system'] == agg['system']
                 and r.get('status') == 'ok' and r.get('worker_steps')]
        if steps and len({len(s) for s in steps}) == 1:
            agg['worker_steps'] = [round(seeds.olympic(list(col))['mean'])
                                   for col in zip(*steps)]
    case['checks'] = hetero_checks(case)


#: the targets of each case (docs/benchmarks/targets.md): (baseline row, target id)
CASE_TARGETS = {'slow': (('native-sync', 'hetero.time_vs_native'),
                         ('ssgd', 'hetero.time_vs_ssgd')),
                'random': (('native-sync', 'hetero.random_time_vs_native'),)}


def hetero_checks(case):
    """Issue 26's targets: the best straggler-tolerant row (the one that meets the most
    of them, then the first at the target) against native dist_sync and ssgd; with
    several seeds, of the rows' aggregates."""
    done = {r['system']: r for r in seeds.judged(case) if r.get('status') == 'ok'}
    known = rows.catalog().systems
    tolerant = [r for key, r in done.items() if key in known and known[key].straggler_tolerant]
    if case['name'] not in CASE_TARGETS or not tolerant:
        return []
    best = max(tolerant, key=lambda r: (sum(bool(c['met']) for c in _checks(r, done, case)),
                                        -(r.get('time_to_target_s') or float('inf'))))
    return _checks(best, done, case)


def _checks(best, done, case):
    """The targets of one row against the case's baselines that ran."""
    out = []
    mine = best.get('time_to_target_s')
    for key, target in CASE_TARGETS[case['name']]:
        base = done.get(key)
        if base is None:
            continue
        theirs = base.get('time_to_target_s')
        c = check(f"{base['label']}'s time to target / {best['label']}'s", target,
                  theirs / mine if theirs and mine else None, fmt='.3f',
                  none='not reached by ' + (base['label'] if mine else best['label']))
        out.append(dict(c, met=True) if mine and not theirs else c)   # only it got there
    ssgd = done.get('ssgd')
    if case['name'] == 'slow' and ssgd and ssgd.get('final_accuracy') is not None:
        out.append(check(f"{best['label']} final accuracy - ssgd's", 'hetero.final_vs_ssgd',
                         best['final_accuracy'] - ssgd['final_accuracy'], fmt='+.4f'))
    return out


def mark_target(row, target):
    """The first point of the global model's curve at or above ``target``: its time
    from the job's launch and the global batches applied by then."""
    hit = next((e for e in row['curve'] if e[2] >= target - 1e-9), None)
    row.update(target=target, time_to_target_s=hit[1] if hit else None,
               steps_to_target=hit[0] if hit else None)
