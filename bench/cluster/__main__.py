"""The command: ``python -m bench.cluster`` (its options and experiments: args.py, or
``--help``). Builds the cluster, runs the experiments of ``--only`` (one module each:
matrix, scaling, tta, hetero), writes the tables and plots and tears the cluster down.
"""
from __future__ import annotations

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

from ssdsgd.settings import PREFIX  # noqa: E402

from bench import common  # noqa: E402
from bench.cluster import (hetero, matrix, netns, pages, report, scaling,  # noqa: E402
                           tta)
from bench.cluster.args import parse_args  # noqa: E402
from bench.cluster.jobs import Bench, csv  # noqa: E402
from bench.cluster.workloads import parse_workload  # noqa: E402


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
    clear_shell_settings(log)
    only = set(csv(args.only))
    raw = Path(args.raw) if args.raw else Path(tempfile.mkdtemp(prefix='bench-cluster-'))
    raw.mkdir(parents=True, exist_ok=True)
    log(f'raw results and logs: {raw}')
    # workloads first (shapes need MXNet and gluoncv, not the cluster)
    workloads = []
    if 'matrix' in only:
        workloads = [parse_workload(spec, csv(args.rates), args, raw)
                     for spec in csv(args.workloads)]
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


def clear_shell_settings(log):
    """The launcher passes this process's environment on to every job, so an SSDSGD_*
    variable of the shell would change every ssd_sync row, the defaults row too: a row's
    settings are its own and its experiment's only."""
    for key in sorted(k for k in os.environ if k.startswith(PREFIX)):
        log(f'ignoring {key}={os.environ.pop(key)} from the shell: a row sets its own '
            'settings (bench/cluster/rows.yaml)')


def hosts_needed(args, only):
    max_n = max([args.workers]
                + ([int(x) for x in csv(args.scaling_workers)] if 'scaling' in only else [])
                + ([args.tta_workers] if 'tta' in only else [])
                + ([args.hetero_workers] if 'hetero' in only else [])
                + ([args.tta_comm_workers] if 'tta-comm' in only else []))
    return 1 + args.servers + max_n


def new_results(args, argv, workloads):
    command = 'python -m bench.cluster ' + ' '.join(
        shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    return {'meta': {'command': command, 'machine': common.machine_info(),
                     'settings': settings_text(args, workloads)},
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


#: --only's names: (the results' key, the experiment's generator of partial results,
#: what to add once it is done)
EXPERIMENTS = {
    'matrix': ('matrix', lambda b, a, w: matrix.run_matrix(b, a, w, log),
               lambda res, a: res.update(checks=matrix.comm_bound_checks(res['matrix'], a))),
    'scaling': ('scaling', lambda b, a, w: scaling.run_scaling(b, a, log), None),
    'tta': ('tta', lambda b, a, w: tta.run_tta(b, a, log), None),
    'hetero': ('hetero', lambda b, a, w: hetero.run_hetero(b, a, log), None),
    'tta-comm': ('tta_comm', lambda b, a, w: tta.run_tta_comm(b, a, log),
                 lambda res, a: res['tta_comm'].update(checks=tta.tta_comm_checks(
                     res['tta_comm']))),
}


def run_parts(bench, args, only, raw, workloads, results):
    """Each experiment of ``only`` in EXPERIMENTS' order, saving after every row."""
    for name, (key, run, finish) in EXPERIMENTS.items():
        if name not in only:
            continue
        for partial in run(bench, args, workloads):
            results[key] = partial
            save_raw(raw, results)
        if finish is not None and results[key]:
            finish(results, args)
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


def has_main_tables(results):
    """Rows of the experiments NAME.md holds (the hetero one has its own page)."""
    return bool(results.get('matrix') or results.get('scaling', {}).get('rows')
                or results.get('tta', {}).get('rows') or results.get('tta_comm', {}).get('rows'))


def hetero_stem(name, results):
    """The hetero page's stem: hetero (the run of record) under the default --name, else
    NAME, or NAME_hetero beside NAME.md's own tables."""
    if name == 'cluster':
        return 'hetero'
    return f'{name}_hetero' if has_main_tables(results) else name


def write_outputs(results, out, name='cluster'):
    out.mkdir(parents=True, exist_ok=True)
    if results.get('hetero', {}).get('cases'):
        stem = hetero_stem(name, results)
        (out / f'{stem}.json').write_text(json.dumps(strip_for_json(
            {'meta': results['meta'], 'hetero': results['hetero']}), indent=1))
        (out / f'{stem}.md').write_text(pages.hetero_markdown(results, stem))
        record(results, out, stem)
        log(f'wrote {out / (stem + ".md")} and {out / (stem + ".json")}')
    if not has_main_tables(results):
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


def settings_text(args, workloads):
    s = {'workers x servers (matrix)': f'{args.workers} x {args.servers}',
         'untimed steps per row': f'{args.warmup} (ssd_sync rows but defaults: '
                                  f'sync.warmup_steps {args.warmup}, so every timed step is '
                                  'in the steps-delay stage)',
         'timed steps per row': (f'{args.steps}' if args.steps else
                                 f'about {args.target_s:g} s worth (predicted), at least '
                                 '5, at least 3k for ssd'),
         'emulated compute': f'{args.compute_ratio:g} x one push at {args.compute_ref} '
                             '(time.sleep)',
         'optimizer': 'sgd, momentum 0.9, on the servers (update_on_kvstore)',
         'OMP_NUM_THREADS / MXNET_CPU_WORKER_NTHREADS': '1 / 1 in every process',
         'MTU': args.mtu,
         'connections': ('ssd_sync rows: ' + ('plain (--insecure: authenticated by the '
                         "job's keys, not encrypted)" if args.insecure else 'aesgcm '
                         '(authenticated and encrypted), as ssh, mpi and slurm run across '
                         'hosts by default') + ", unless a row sets its own; native rows: "
                         "open (MXNet's ps-lite cannot be secured); each row's label "
                         'names its mode [aesgcm], [curve], [plain] or [open]')}
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
