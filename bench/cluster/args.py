"""Benchmarks on an emulated cluster, side by side with MXNet's own dist_sync/dist_async.

    sudo .venv/bin/python -m bench.cluster            # everything, ~25 min
    sudo .venv/bin/python -m bench.cluster --quick    # a smaller version, ~8 min

Every role (scheduler, each server, each worker) runs on a host of its own: a network
namespace joined to a switch namespace by a veth pair, each link shaped with tc to the
configured rate both ways. The experiments (``--only``, one module each):

  matrix   for each workload and link rate, every row: samples/s, speedup over native
           dist_sync, time blocked per step, bytes per step, the bound and each row's
           fraction of it (matrix.py)
  scaling  N in --scaling-workers with emulated compute; efficiency against N times one
           worker's throughput without communication (scaling.py)
  tta      the digits demo (real compute, real data): time to --tta-target test accuracy
  tta-comm time to accuracy where the links bound the step: a wide MLP (64-H-H-10) on the
           digits at 1 Gbit/s, 4 workers (tta.py)
  hetero   the digits demo with a straggler (debug.slowdown): (a) one worker 2x slower,
           (b) eager-SGD's random delays; written to hetero.md/.json (hetero.py)

tta, tta-comm and hetero run every row once per seed of --seeds (0-4, 0,3,7) and report
each row's MLPerf aggregate: fastest and slowest run dropped, the mean of the rest, the
spread beside it (seeds.py).

A row is a name plus the settings it changes, spelled as in docs/training.md's settings
table: bench/cluster/rows.yaml defines them (ssd-k5-2bit: {sync.delay_steps: 5,
sync.compression: 2bit}) and each experiment's default rows, every one with a `defaults`
row that changes nothing; --row adds one (ssd-k7:sync.delay_steps=7). The targets the
checks judge are docs/benchmarks/targets.md's.

The hosts are separate machines, so the ssd_sync rows run as the multi-host launchers do
by default: aesgcm (AES-256-GCM on every frame), each process with its own key file; a
row's `security: curve` runs ZeroMQ CURVE; --insecure (or a row's `security: plain`)
runs them plain. MXNet's native rows cannot be secured. Every row's label names the
mode it ran in: [aesgcm], [curve], [plain] or [open].

Results go to --out (docs/benchmarks/: cluster.md, cluster.json, PNG plots); every job's
raw per-worker results and logs go to --raw. Needs root; without it, says so and exits 0.
"""
from __future__ import annotations

import argparse

from ssdsgd.settings import BY_NAME

from . import hetero, rows, seeds

REPO_DOCS = 'docs/benchmarks'


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
    p.add_argument('--glu-state', choices=BY_NAME['glu_state'].choices,
                   help='sync.glu_state of the ssd_sync rows that set none (default: the '
                   'code\'s; not the defaults row)')
    p.add_argument('--workloads', help='comma list, e.g. emulated:resnet50@1gbit+10gbit,'
                   'real:cifar_resnet20_v1 (default depends on --quick)')
    p.add_argument('--rates', help='default link rates for workloads without @ '
                   '(default 1gbit,10gbit)')
    p.add_argument('--workers', type=int, default=4)
    p.add_argument('--servers', type=int, default=1)
    p.add_argument('--systems', help='comma list of the matrix\'s rows (default: its rows in '
                   'bench/cluster/rows.yaml)')
    p.add_argument('--row', action='append', default=[], metavar='NAME:KEY=VALUE[,...]',
                   help='one more row, e.g. ssd-k7:sync.delay_steps=7 (settings as in '
                   'docs/training.md; kvstore=dist_sync for a native row); repeatable')
    p.add_argument('--compute-ratio', type=float, default=1.0,
                   help='emulated compute per step = this x one push at --compute-ref')
    p.add_argument('--compute-ref', default='1gbit',
                   help='the link rate that defines the emulated compute time')
    p.add_argument('--real-batch', type=int, default=32)
    p.add_argument('--target-s', type=float, help='seconds of timed steps per row')
    p.add_argument('--steps', type=int, help='timed steps per row (overrides --target-s)')
    p.add_argument('--warmup', type=int, default=2, help='untimed steps per row (and '
                   'sync.warmup_steps of the ssd_sync rows that set none)')
    p.add_argument('--scaling-workers', default='1,2,4,8')
    p.add_argument('--scaling-workload', default='emulated:resnet20@1gbit')
    p.add_argument('--scaling-ratio', type=float, default=10.0,
                   help='scaling: compute = this x one push at the scaling link rate')
    p.add_argument('--scaling-systems', help='rows (default: rows.yaml\'s)')
    p.add_argument('--tta-rate', default='100mbit')
    p.add_argument('--tta-workers', type=int, default=2)
    p.add_argument('--tta-target', type=float, default=0.95)
    p.add_argument('--tta-epochs', type=int, default=20)
    p.add_argument('--tta-systems', help='rows (default: rows.yaml\'s)')
    p.add_argument('--tta-warmup', type=int, default=10,
                   help='ssd warm-up steps (digits; the demo config has 50, but 95%% is '
                   'reached at about step 40, inside it)')
    p.add_argument('--hetero-rate', default='100mbit')
    p.add_argument('--hetero-workers', type=int, default=4)
    p.add_argument('--hetero-target', type=hetero.parse_target, default='auto',
                   help="time-to-accuracy target: a fraction, or auto (the default): ssgd's "
                   "final accuracy in the same case minus 0.5 point, so the target is one "
                   "that ssgd needs a good part of the run for, not its first steps")
    p.add_argument('--hetero-epochs', type=int, default=20)
    p.add_argument('--hetero-systems', help='rows (default: rows.yaml\'s)')
    p.add_argument('--hetero-cases', default='slow,random',
                   help='comma list of slow, random and even (nobody slowed)')
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
    p.add_argument('--tta-comm-seed', type=int, default=None,
                   help="every tta-comm row's --seed (initial weights and data order), "
                   "default 0; --seeds runs several")
    p.add_argument('--seeds', type=seeds.parse_seeds, default=None, metavar='0-4|0,3,7',
                   help='run every row of tta, tta-comm and hetero once per seed (the rows '
                   'of a seed one after another) and report the MLPerf aggregate: with >= 3 '
                   'seeds the fastest and slowest dropped, the mean of the rest, the spread '
                   'beside it (default: the one seed each ran before: 0, or --tta-comm-seed)')
    p.add_argument('--tta-comm-systems', help='rows (default: rows.yaml\'s)')
    p.add_argument('--latency-ms', type=float, default=0.0,
                   help='added round-trip latency per link (needs netem in the kernel)')
    p.add_argument('--mtu', type=int, default=1500)
    p.add_argument('--memory-fraction', type=float, default=0.6,
                   help='skip a row whose worst-case memory exceeds this x MemAvailable')
    p.add_argument('--out', default=str(rows.ROWS_FILE.parents[2] / REPO_DOCS),
                   help='where cluster.md, cluster.json and the plots go')
    p.add_argument('--raw', help='per-job results and logs (default: a new temp dir)')
    p.add_argument('--insecure', action='store_true',
                   help='run the ssd_sync rows with PLAIN keys (authenticated, not encrypted) '
                   'instead of aesgcm, the multi-host launchers\' default; a row\'s own '
                   '`security` wins. The native rows are never secured')
    p.add_argument('--no-write', action='store_true', help='print only; write nothing to --out')
    p.add_argument('--timeline', action='store_true',
                   help='the ssd_sync rows record the per-process timeline (train.timeline) '
                   'into RAW/<job>/timeline, merged after the job into timeline.json there, '
                   'and the log gets the report\'s timeline lines: under dynamic data each '
                   'worker\'s wait for its data chunks (docs/training.md, "The timeline"); '
                   'the row gets it as data_wait')
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
    if args.seeds and args.tta_comm_seed is not None:
        p.error('--seeds and --tta-comm-seed: give one (--seeds applies to tta-comm too)')
    try:
        for spec in args.row:
            rows.catalog().add(spec)
    except rows.RowError as e:
        p.error(str(e))
    return args
