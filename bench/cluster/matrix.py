"""Side by side (``--only matrix``): for each workload and link rate, every row's
throughput, time blocked and bytes per step, the bound and each row's fraction of it, the
speedup over native dist_sync, and the comm-bound point's targets."""
from __future__ import annotations

from . import netns, plan, rows
from .jobs import default_glu_state, fmt_row, steps_for, timeout_for
from .targets import check


def run_matrix(bench, args, workloads, log):
    """One group per workload and rate: every system's row, with bounds and speedups;
    yields the groups so far after every group."""
    groups = []
    systems = [s.resolved(default_glu_state(args))
               for s in rows.catalog().names('matrix', args.systems)]
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
    row = bench.run(rows.system('compute'), workload, rate, n, s, st, args.warmup, timeout=600)
    if row.get('status') == 'ok':
        workload.compute_s = row['compute_per_step_s']
        workload.notes.append(f"compute alone: {row['samples_per_s']:.1f} "
                              f"samples/s, {workload.compute_s:.3f} s/step")
    log(fmt_row(row))
    return row


def add_bounds_and_speedups(g, workload, rate, b):
    n, s = g['workers'], g['servers']
    for r in g['rows']:
        system = rows.system(r['system']).resolved(g.get('glu_state', 'exact'))
        rb = plan.bound(workload, rate, n, s, system=system)[0] \
            if system.compression or system.state_pulls or system.period else b
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


def comm_bound_checks(matrix, args):
    """The targets at the comm-bound point (docs/benchmarks/targets.md: ResNet-50 shapes,
    1 Gbit/s, compute = one push at 1 Gbit/s, 4 workers, 1 server)."""
    g = next((g for g in matrix if g['workload'] == 'emulated ResNet-50'
              and abs(g['rate_bits'] - 1e9) < 1 and g['workers'] == 4 and g['servers'] == 1
              and args.compute_ratio == 1.0
              and netns.parse_rate(args.compute_ref) == 1e9), None)
    if g is None:
        return []
    by_name = {r['system']: r for r in g['rows']}
    nat, k5, ssgd = by_name.get('native-sync'), by_name.get('ssd-k5'), by_name.get('ssgd')
    ok_k5 = _ok(k5)
    checks = [
        check('ssd k=5 throughput / native dist_sync', 'comm.ssd_k5_vs_native',
              _ratio(k5, nat)),
        check('ssd k=5 fraction of the bound (whole timed region, final drain included)',
              'comm.ssd_k5_of_bound', k5.get('fraction_of_bound') if ok_k5 else None),
        check('ssd k=5 fraction of the bound (steady state, whole pull periods)',
              'comm.ssd_k5_of_bound', k5.get('steady_fraction_of_bound') if ok_k5 else None),
        check('ssd_sync ssgd throughput / native dist_sync', 'comm.ssgd_vs_native',
              _ratio(ssgd, nat))]
    nat2 = by_name.get('native-sync-2bit')
    for key, c5 in by_name.items():     # every ssd k=5 + 2bit row, whatever else it sets
        system = rows.catalog().systems.get(key)
        if system is None or (system.kind, system.k, system.compression) != ('ssd', 5, '2bit'):
            continue
        state = f" ({c5['glu_state']})" if c5.get('glu_state') else ''
        if c5.get('pull_schedule') == 'staggered':
            state += ' (staggered pulls)'
        if c5.get('pull_relay') == 'chain':
            state += ' (relayed pulls)'
        for base, name, target in ((nat, 'native dist_sync', 'comm.ssd_k5_2bit_vs_native'),
                                   (nat2, 'native dist_sync + 2bit (push/pull)',
                                    'comm.ssd_k5_2bit_vs_native_2bit')):
            checks.append(check(f'ssd k=5 + 2bit{state} throughput / {name}', target,
                                _ratio(c5, base)))
            # the same over whole pull periods (no start, no final drain): what a long
            # job sees; printed beside the whole timed region, which the target is judged on
            s5, sb = c5.get('steady_samples_per_s'), (base or {}).get('steady_samples_per_s')
            if s5 and sb:
                checks.append(check(f'ssd k=5 + 2bit{state} steady-state throughput / '
                                    f'{name} steady state', target, s5 / sb))
    return [c for c in checks if c['measured'] != '-']


def _ok(r):
    return r is not None and r.get('samples_per_s')


def _ratio(row, base):
    return row['samples_per_s'] / base['samples_per_s'] if _ok(row) and _ok(base) else None
