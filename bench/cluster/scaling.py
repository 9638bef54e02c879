"""Scaling (``--only scaling``): N workers with emulated compute; efficiency against N
times one worker's throughput without communication."""
from __future__ import annotations

from . import netns, plan, rows
from .jobs import csv, fmt_row, steps_for, timeout_for
from .workloads import parse_workload


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
    systems = rows.catalog().names('scaling', args.scaling_systems)
    log(f'--- scaling: {workload.describe()} @ {netns.rate_label(rate)}, '
        f'{args.servers} server(s)')
    for n in [int(x) for x in csv(args.scaling_workers)]:
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
