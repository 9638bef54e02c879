"""Slow workers (``--only hetero``): the digits demo with a straggler (debug.slowdown),
(a) one worker 2x slower, (b) eager-SGD's random delays; throughput, time to accuracy
and final accuracy of each row, and issue 11's targets for case (a)."""
from __future__ import annotations

import argparse

from . import netns, report, rows, seeds
from .jobs import csv
from .plan import Workload
from .targets import check
from .tta import add_time_to_target


HETERO_CASES = {'slow': ('(a) one worker 2x slower', 'hetero_slow'),
                'random': ("(b) eager-SGD's random delays", 'hetero_random')}


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
                    f'wd 1e-4 cosine over {args.hetero_epochs} epochs; ssd: warm-up '
                    f'{args.tta_warmup} steps'), 'seeds': order, 'cases': []}
    for name in csv(args.hetero_cases):
        title, attr = HETERO_CASES[name]
        case = {'name': name, 'title': title, 'slowdown': getattr(args, attr),
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


def run_row(bench, args, system, case, het, seed, log):
    """One row of a case on one seed: its throughput and accuracy curve."""
    w = Workload('digits', 'digits', 'digits_mlp', 32)
    wargs = ['--workload', 'digits', '--epochs', args.hetero_epochs, '--batch', 32,
             '--lr', 0.1, '--eval-every', 2, '--slowdown', case['slowdown'],
             # rank 0 is a fast worker: evaluating on its clock would slow the
             # tolerant rows' rank 0 only, where a synchronous row hides it
             '--deferred-eval', '--seed', seed]
    row = bench.run(system, w, het['rate_bits'], het['workers'], het['servers'], 0,
                    args.tta_warmup, extra_args=wargs, timeout=1200)
    row['seed'] = seed
    if row.get('status') == 'ok':
        add_worker_throughput(row)
        add_time_to_target(row, 1.01)       # the curve; the target comes below
        log(f"{system.label:<24} {row['samples_per_s']:8.1f} samples/s, final "
            f"{row['final_accuracy']:.4f}, {row['wall_s']:.1f} s")
    else:
        log(f'{system.label:<24} {row.get("status")}')
    return row


def finish_case(case, args, log):
    """Once every seed ran: the case's target, each run's time to it, the rows'
    aggregates over the seeds, and the checks (on the aggregates)."""
    case['target'], case['target_rule'] = hetero_target(case, args.hetero_target)
    for row in case['rows']:
        if row.get('status') == 'ok':
            mark_target(row, case['target'])
            log(f"{row['label']:<24} time to {case['target']:.2%}: "
                f"{report._f(row['time_to_target_s'], '.2f', 'not reached')} s (step "
                f"{report._f(row['steps_to_target'], 'd', '-')})")
    case['aggregate'] = seeds.aggregate(case['rows'], case['seeds'])
    for agg in case['aggregate']:
        steps = [r['worker_steps'] for r in case['rows'] if r['system'] == agg['system']
                 and r.get('status') == 'ok' and r.get('worker_steps')]
        if steps and len({len(s) for s in steps}) == 1:
            agg['worker_steps'] = [round(seeds.olympic(list(col))['mean'])
                                   for col in zip(*steps)]
    case['checks'] = hetero_checks(case)


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
    one that meets the most targets, then the fastest); with several seeds, of the
    rows' aggregates."""
    done = {r['system']: r for r in seeds.judged(case) if r.get('status') == 'ok'}
    ssgd = done.get('ssgd')
    known = rows.catalog().systems
    tolerant = [r for key, r in done.items() if key in known and known[key].straggler_tolerant]
    if case['name'] != 'slow' or not ssgd or not tolerant:
        return []
    best = max(tolerant, key=lambda r: (sum(bool(c['met']) for c in _checks(r, ssgd)),
                                        r['samples_per_s']))
    return _checks(best, ssgd)


def _checks(best, ssgd):
    """The three targets of one row against ssgd's (docs/benchmarks/targets.md)."""
    hit = best.get('time_to_target_s') and ssgd.get('time_to_target_s')
    return [
        check(f"{best['label']} throughput / ssgd", 'hetero.vs_ssgd',
              best['samples_per_s'] / ssgd['samples_per_s'], fmt='.3f'),
        check(f"ssgd's time to target / {best['label']}'s" + ('' if hit else ' (not reached)'),
              'hetero.time_vs_ssgd',
              ssgd['time_to_target_s'] / best['time_to_target_s'] if hit else None, fmt='.3f'),
        check(f"{best['label']} final accuracy - ssgd's", 'hetero.final_vs_ssgd',
              best['final_accuracy'] - ssgd['final_accuracy'], fmt='.3f')]


def mark_target(row, target):
    """The first evaluation of rank 0's curve at or above ``target``: its time and step."""
    hit = next((e for e in row['curve'] if e[2] >= target - 1e-9), None)
    row.update(target=target, time_to_target_s=hit[1] if hit else None,
               steps_to_target=hit[0] if hit else None)
