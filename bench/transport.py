"""Transport benchmark: ssd_sync (SSDSGD_ALGORITHM=ssgd) against MXNet's native dist_sync.

    python bench/transport.py [--reps 5] [--big-mb 100] [--small-keys 160]
                              [--small-steps 50] [--workers 2] [--servers 1]
                              [--only native|ssd|secure] [--no-secure]
                              [--ciphers curve,aesgcm] [--json FILE]

Runs bench/transport_worker.py as every worker of two local jobs, one after the other:
native dist_sync (ps-lite, started by ssdsgd.testing.run_native) and ssd_sync (started
by launch/dist.py), and prints one table:

  big    GB/s per worker for kv.pushpull of one --big-mb MB float32 array
         ((bytes pushed + bytes pulled) / s; higher is better)
  keys   ms per round of kv.pushpull called key by key by the script itself (no
         Trainer, no optimizer) over --small-keys keys of 16 KB (lower is better)
  small  ms per trainer.step of a stock gluon.Trainer with --small-keys parameters of
         4096 float32 (16 KB) each; the Trainer calls pushpull once per parameter
         (lower is better)

Figures are medians over the timed repetitions, then averaged over the workers.
The ratio column is ssd_sync / native; it reads "better" above 1 for GB/s and below 1
for ms/step. The "secure" columns run ssd_sync once more per cipher with ``launch/dist.py
--secure --cipher C`` (every connection authenticated and encrypted: ``curve``, ZeroMQ
CURVE in libzmq's I/O thread; ``aesgcm``, AES-256-GCM on every frame on the sending
thread) and give secure / ssd_sync, the cost of encryption.  If launch/dist.py does not
exist yet, the ssd_sync part is skipped.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.common import load_results  # noqa: E402
from ssdsgd.testing import NativePSError, run_dist, run_native  # noqa: E402
from ssdsgd.testing.procs import DIST  # noqa: E402

WORKER = REPO / 'bench' / 'transport_worker.py'
# Same for both jobs: one OpenMP thread per process, so 2 workers + servers +
# scheduler do not oversubscribe a small machine.
JOB_ENV = {'OMP_NUM_THREADS': '1', 'PYTHONPATH': str(REPO)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--reps', type=int, default=5, help='timed big pushpulls (after 1 warm-up)')
    p.add_argument('--big-mb', type=float, default=100.0, help='big array size, MB (1e6 B)')
    p.add_argument('--small-keys', type=int, default=160, help='parameters of 16 KB each')
    p.add_argument('--small-steps', type=int, default=50, help='timed trainer.step calls')
    p.add_argument('--workers', type=int, default=2)
    p.add_argument('--servers', type=int, default=1)
    p.add_argument('--only', choices=['native', 'ssd', 'secure'], help='run one side only')
    p.add_argument('--no-secure', action='store_true', help='skip the --secure runs')
    p.add_argument('--ciphers', default='curve,aesgcm',
                   help='the --cipher of each secure run, comma-separated')
    p.add_argument('--timeout', type=float, default=900, help='seconds per job')
    p.add_argument('--json', help='also write the raw per-worker results here')
    p.add_argument('--cipher-time', metavar='FILE',
                   help="each process of the ssd_sync jobs appends to FILE the time it "
                        "spent sealing and opening (aesgcm) at its exit "
                        "(bench/cipher_time/sitecustomize.py)")
    args = p.parse_args(argv)
    if args.cipher_time:
        JOB_ENV['PYTHONPATH'] = os.pathsep.join([str(REPO), str(REPO / 'bench' / 'cipher_time')])
        JOB_ENV['BENCH_CIPHER_TIME_LOG'] = os.path.abspath(args.cipher_time)
    return args


def worker_cmd(kvstore, out, args):
    return [sys.executable, str(WORKER), '--kvstore', kvstore, '--out', str(out),
            '--reps', str(args.reps), '--big-mb', str(args.big_mb),
            '--small-keys', str(args.small_keys), '--small-steps', str(args.small_steps)]


def run_native_side(args, out):
    run_native(worker_cmd('dist_sync', out, args), args.workers, num_servers=args.servers,
               mode='dist_sync', env=JOB_ENV, timeout=args.timeout, cwd=REPO)
    return load_results(out, args.workers)


def run_ssd_side(args, out, cipher=None):
    dist_args = ['-n', args.workers, '-s', args.servers, '--env', 'SSDSGD_ALGORITHM=ssgd']
    dist_args += ['--secure', '--cipher', cipher] if cipher else []
    for k, v in JOB_ENV.items():
        dist_args += ['--env', f'{k}={v}']
    dist_args += ['--', *worker_cmd('ssd_sync', out, args)]
    try:
        proc = run_dist(dist_args, env=JOB_ENV, timeout=args.timeout, merge_output=True)
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f'launch/dist.py timed out after {args.timeout:g} s:\n'
                           f'{e.output[-4000:]}') from None
    if proc.returncode != 0:
        raise RuntimeError(f'launch/dist.py exited {proc.returncode}:\n{proc.stdout[-4000:]}')
    return load_results(out, args.workers)


def summarize(results):
    """Medians per worker, averaged over workers."""
    big = [statistics.median(r['big']['gbps']) for r in results]
    small = [statistics.median(r['small']['ms_per_step']) for r in results]
    keys = [statistics.median(r['keys']['ms_per_step']) for r in results
            if 'keys' in r]
    return {'big_gbps': statistics.mean(big), 'small_ms': statistics.mean(small),
            'big_gbps_workers': big, 'small_ms_workers': small,
            'keys_ms': statistics.mean(keys) if keys else None, 'keys_ms_workers': keys,
            'big_ok': all(r['big']['check_ok'] for r in results)
            and all(r['keys']['check_ok'] for r in results if 'keys' in r),
            'update_on_kvstore': results[0]['small']['update_on_kvstore']}


def fmt(x, spec):
    return '-' if x is None else format(x, spec)


def print_table(args, native, ssd, notes, secure=None):
    """``secure``: cipher -> that run's figures."""
    secure = secure or {}
    size = f'{args.big_mb:g} MB'
    rows = [
        (f'big: pushpull {size}, GB/s/worker (higher better)', 'big_gbps', '.3f'),
        (f'keys: {args.small_keys} x 16 KB pushpull key by key, ms (lower better)', 'keys_ms',
         '.2f'),
        (f'small: {args.small_keys} x 16 KB Trainer.step, ms (lower better)', 'small_ms', '.2f'),
    ]
    head = (f'{args.workers} workers, {args.servers} server(s), big reps {args.reps}, '
            f'small steps {args.small_steps}; medians, mean over workers')
    print(head)
    w0 = max(len(r[0]) for r in rows)
    print(f'{"":{w0}}  {"native":>10}  {"ssd_sync":>10}  {"ssd/native":>10}'
          + ''.join(f'  {c:>10}  {c + "/ssd":>10}' for c in secure))
    for label, key, spec in rows:
        a = native.get(key) if native else None
        b = ssd.get(key) if ssd else None
        ratio = b / a if a and b is not None else None
        line = f'{label:{w0}}  {fmt(a, spec):>10}  {fmt(b, spec):>10}  {fmt(ratio, ".2f"):>10}'
        for figures in secure.values():
            c = figures.get(key)
            cost = c / b if b and c is not None else None
            line += f'  {fmt(c, spec):>10}  {fmt(cost, ".2f"):>10}'
        print(line)
    for side, s in (('native', native), ('ssd_sync', ssd), *secure.items()):
        if s:
            per = ', '.join(f'{g:.3f}' for g in s['big_gbps_workers'])
            per_ms = ', '.join(f'{m:.2f}' for m in s['small_ms_workers'])
            per_keys = ', '.join(f'{m:.2f}' for m in s['keys_ms_workers'])
            print(f'  {side}: per worker GB/s [{per}], keys ms/round [{per_keys}], '
                  f'ms/step [{per_ms}], '
                  f'update_on_kvstore={s["update_on_kvstore"]}'
                  + ('' if s['big_ok'] else ', BIG OR KEYS RESULT WRONG (!= sum of pushes)'))
    for n in notes:
        print(f'  note: {n}')


def main(argv=None):
    args = parse_args(argv)
    notes, raw, figures = [], {}, {}
    with tempfile.TemporaryDirectory(prefix='transport-bench-') as tmp:
        if args.only in (None, 'native'):
            run_side('native', run_native_side, args, Path(tmp), raw, figures, notes)
        if args.only in (None, 'ssd'):
            if not DIST.exists():
                notes.append('ssd_sync part skipped: launch/dist.py does not exist yet')
            else:
                run_side('ssd', run_ssd_side, args, Path(tmp), raw, figures, notes)
        ciphers = [c for c in args.ciphers.split(',') if c]
        if args.only in (None, 'secure') and not args.no_secure and DIST.exists():
            for cipher in ciphers:
                run_side(cipher, lambda a, out, c=cipher: run_ssd_side(a, out, c), args,
                         Path(tmp), raw, figures, notes)
    print_table(args, figures.get('native'), figures.get('ssd'), notes,
                {c: figures[c] for c in ciphers if c in figures})
    if args.json:
        Path(args.json).write_text(json.dumps(raw, indent=1))
    failed = any(' part failed' in n for n in notes)
    return 1 if failed else 0


def run_side(side, run, args, tmp, raw, figures, notes):
    """Run one job; its per-worker results go to ``raw``, its summary to ``figures``,
    a failure to ``notes``."""
    try:
        raw[side] = run(args, tmp / side)
        figures[side] = summarize(raw[side])
    except (NativePSError, RuntimeError) as e:
        notes.append(f'{ {"ssd": "ssd_sync"}.get(side, side)} part failed: {e}')


if __name__ == '__main__':
    sys.exit(main())
