"""One row, one job: what an ssd_sync row's job is given, its step count and timeout,
and the Bench that runs it on the cluster and keeps the run's notes."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

from ssdsgd.settings import BY_NAME

from . import netns, plan
from .rows import spelled
from .workloads import worker_args

class Bench:
    """Runs the rows of one invocation on one cluster and keeps its notes."""

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
            bound_s=None, snapshot_every=0):
        """One job, one row: skipped if it may not fit in memory, 'failed' with the
        error's tail, or the summary of its workers' results. ``snapshot_every``: an
        ssd_sync row's servers copy the global model every that many updates into
        OUT/snapshots (ssdsgd/kvstore/snapshots.py; the measurement, not a setting of
        the row: the defaults row gets it too)."""
        from bench.cluster import runner
        self.job += 1
        values = job_settings(system, warmup, self.args.glu_state)
        warmup = system.warmup_or(warmup)       # untimed steps: a row's own warm-up wins
        tag = f'{self.job:03d}-{workload.model}-{int(rate)}-{system.key}-n{n}s{s}'
        out = self.raw / tag
        security = security_mode(system, self.args.insecure)
        base = {'system': system.key, 'label': labelled(system, security),
                'security': security, 'workload': workload.name,
                'rate_bits': rate, 'workers': n, 'servers': s, 'k': system.k, 'steps': steps,
                'warmup': warmup, 'compression': compression_params(system, self.args),
                'settings': {spelled(BY_NAME[name]): v for name, v in values.items()}}
        skipped = self.memory_skip(system, workload, n, s)
        if skipped:
            return dict(base, status=skipped)
        args = extra_args if extra_args is not None else worker_args(workload, steps, warmup)
        args = list(args) + compression_args(system, self.args)
        job_values = dict(values)
        if snapshot_every and system.kind == 'ssd':
            job_values.update(snapshot_every=snapshot_every,
                              snapshot_dir=str(out / 'snapshots'))
        timeline = getattr(self.args, 'timeline', False) and system.kind == 'ssd'
        if timeline:            # --timeline: a measurement too, not a setting of the row
            job_values.update(timeline=True, timeline_dir=str(out / 'timeline'))
        t0, launched = time.monotonic(), time.time()
        try:
            job_notes = []
            results = runner.run_job_on(self.cluster, system, n, s, args, out, timeout,
                                        job_values, out.with_suffix('.log'), notes=job_notes,
                                        security=security)
            self.take_notes(tag, job_notes)
        except runner.Interrupted as e:
            raise KeyboardInterrupt(str(e)) from None
        except RuntimeError as e:
            return self.failed(base, e, system, workload, rate, out)
        ended, job_s = time.time(), time.monotonic() - t0     # before a merge
        if timeline:
            base['data_wait'] = self.merge_timeline(system, out)
        if workload.kind == 'digits':      # the job's clock: launched .. ended (time.time())
            return dict(base, status='ok', results=results, job_s=job_s,
                        launched=launched, ended=ended, out=str(out),
                        loadavg=os.getloadavg()[0])
        row = runner.summarize(results, system, workload, rate, n, s, bound_s)
        row.update(status='ok', job_s=job_s, loadavg=os.getloadavg()[0],
                   settings=base['settings'], label=base['label'], security=security)
        if timeline:
            row['data_wait'] = base['data_wait']
        if row.get('leftover_pids'):
            self.notes.append(f'{tag}: {row["leftover_pids"]} processes were left in the '
                              'namespaces after the job and were killed')
        return row

    def merge_timeline(self, system, out):
        """--timeline: merge the job's timeline into OUT/timeline.json (no PNG), log the
        report's lines (python -m ssdsgd.report OUT --timeline prints them again) and
        return each worker's wait for its data chunks ({rank: {first, other}} in s)."""
        from ssdsgd.timeline_merge import TimelineError, lines, merge
        try:
            merged = merge(out, draw=False)
        except (TimelineError, OSError) as e:
            self.log(f'{system.label}: no timeline: {e}')
            return None
        for line in lines(merged):
            self.log(f'{system.label}: {line}')
        return merged['data_wait']

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


def security_mode(system, insecure=False):
    """How a row's connections were secured. The emulated hosts are separate machines, so
    an ssd_sync row runs as ssh, mpi and slurm do by default: ``aesgcm`` (authenticated
    and encrypted), or its own ``security`` (``curve``, or ``plain``: authenticated, not
    encrypted), or ``plain`` with --insecure. MXNet's ps-lite cannot be secured: ``open``. Compute alone
    has no connections: None."""
    if system.kind == 'native':
        return 'open'
    if system.kind != 'ssd':
        return None
    return system.security or ('plain' if insecure else 'aesgcm')


def labelled(system, security):
    """A row's name in the tables and plots, with the mode its connections ran in."""
    return f'{system.label} [{security}]' if security else system.label


def compression_params(system, args):
    """kv.set_gradient_compression's dict for ``system`` (None: uncompressed)."""
    if system.compression == '2bit':
        return {'type': '2bit', 'threshold': system.threshold or args.threshold}
    if system.compression == 'topk':
        return {'type': 'topk', 'ratio': system.ratio or args.topk_ratio}
    if system.compression == 'auto':        # the job chooses (ssdsgd/sync/auto.py)
        return {'type': 'auto'}
    return None


def compression_args(system, args):
    spec = compression_params(system, args)
    return ['--compression', json.dumps(spec)] if spec else []


def job_settings(system, warmup, glu_state=None):
    """The settings an ssd_sync row's job is given, by name: the row's own, then the
    experiment's warm-up and ``glu_state`` (--glu-state) where the row has none. The
    defaults row is given nothing (a user's defaults; the driver has cleared the shell's
    SSDSGD_* variables, which the launcher would pass on)."""
    if system.kind != 'ssd' or system.defaults:
        return {}
    values = dict(system.settings)
    values.setdefault('warmup_steps', warmup)
    if glu_state:
        values.setdefault('glu_state', glu_state)
    return values


def default_glu_state(args):
    """The glu_state of ssd rows without one of their own: --glu-state, else the code's."""
    from ssdsgd.settings import BY_NAME
    return args.glu_state or BY_NAME['glu_state'].default


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


def csv(text):
    """'a, b,,c' -> ['a', 'b', 'c']."""
    return [t.strip() for t in str(text).split(',') if t.strip()]
