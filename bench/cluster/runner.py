"""Run one row (one job) on the emulated cluster and summarize its workers' results."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench.common import REPO, load_results
from ssdsgd.launch.job import run_job
from ssdsgd.settings import to_env
from ssdsgd.testing import NativePSError, clean_env, run_native_nodes, stop_groups

from . import netns
from .launchers import Layout, NetnsLauncher

WORKER = REPO / 'bench' / 'cluster_worker.py'
#: for every process of every job: one OpenMP thread (2 cores host every role)
JOB_ENV = {'OMP_NUM_THREADS': '1', 'MXNET_CPU_WORKER_NTHREADS': '1',
           'PYTHONPATH': str(REPO), 'PYTHONUNBUFFERED': '1'}


class Interrupted(KeyboardInterrupt):
    pass


def worker_cmd(kvstore, out, args):
    return [sys.executable, str(WORKER), '--kvstore', kvstore, '--out', str(out)] + \
        [str(a) for a in args]


def _tail(path, n=2500):
    try:
        return Path(path).read_text(errors='replace')[-n:]
    except OSError:
        return ''


def _leftovers(cluster):
    """Kill processes a job left inside the namespaces (there should be none)."""
    return [pid for ns in cluster.names for pid in netns.kill_inside(ns)]


RACE_NOTE = ('ssdsgd launcher: "the scheduler exited before the workers finished; stopping '
             'the job" although every worker had finished its work and written its result '
             '(the workers were still exiting); the row is kept')


def _launcher_exit_race(log_path, out, num_workers):
    """ssdsgd.launch.job.run_job fails a job when the scheduler (which leaves once every
    worker said FINISH) exits before a worker's process has exited, even if that worker
    is only tearing its interpreter down. Recognize exactly that case."""
    text = _tail(log_path, 4000)
    launcher = [l for l in text.splitlines() if l.startswith('[launcher]')]
    done = len(list(Path(out).glob('result-rank*.json'))) == num_workers
    return done and bool(launcher) and 'the scheduler exited before the workers finished' \
        in launcher[-1]


def run_job_on(cluster, system, num_workers, num_servers, args, out, timeout, settings,
               log_path, notes=None, security='curve'):
    """Run ``cluster_worker.py args`` as the workers of one job of ``system``; returns the
    per-worker result dicts. Raises RuntimeError (with the log's tail) on failure.
    ``settings``: an ssd_sync job's settings by name (``jobs.job_settings``), its only
    SSDSGD_* variables besides the launcher's own; ``security``: how an ssd_sync job's
    connections are secured (``curve``, ``aesgcm``: encrypted; ``plain``)."""
    layout = Layout(cluster, num_workers, num_servers)
    notes = notes if notes is not None else []
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    servers = [layout.host('server', r) for r in range(num_servers)]
    with CpuSampler(cluster, servers) as cpu:
        if system.kind == 'native':
            _run_native(system, layout, args, out, timeout, log_path)
        elif system.kind == 'ssd':
            _run_ssd(system, layout, args, out, timeout, settings, log_path, notes, security)
        elif system.kind == 'none':
            _run_compute_only(layout, args, out, timeout, log_path)
        else:
            raise ValueError(system.kind)
    left = _leftovers(cluster)
    results = load_results(out, num_workers)
    for r in results:
        r['leftover_pids'] = len(left)
        r['server_cpu_s'] = cpu.total()
    return results


class CpuSampler:
    """CPU seconds (user + system, all threads) of the processes in some hosts'
    namespaces, read from /proc every ``every`` s while a job runs. A process counts with
    its last reading, so up to ``every`` s of its CPU before it exits can be missed."""

    def __init__(self, cluster, hosts, every=0.5):
        self.names = [cluster.names[h] for h in hosts]
        self.every, self.seen = every, {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _run(self):
        while not self._stop.wait(self.every):
            for ns in self.names:
                for pid in netns.namespace_pids(ns):
                    cpu = cpu_seconds(pid)
                    if cpu is not None:
                        self.seen[(ns, pid)] = cpu

    def total(self):
        return sum(self.seen.values())


def cpu_seconds(pid):
    """utime + stime of a process (all its threads) in seconds; None if it is gone."""
    try:
        with open(f'/proc/{pid}/stat') as f:
            fields = f.read().rsplit(')', 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf('SC_CLK_TCK')


def _run_native(system, layout, args, out, timeout, log_path):
    """MXNet's ps-lite, every node on its host; the workers' output goes to the log."""
    try:
        workers = run_native_nodes(
            worker_cmd(system.mode, out, args), layout.num_workers, layout.num_servers,
            mode=system.mode, env=JOB_ENV, timeout=timeout, cwd=REPO,
            root_uri=layout.address('scheduler', 0), node=layout.native_node)
    except NativePSError as e:
        Path(log_path).write_text(str(e))
        raise RuntimeError(f'native {system.mode} failed: {str(e)[-2500:]}') from None
    with open(log_path, 'w') as f:
        for w in workers:
            f.write(f'--- worker {w.index} (exit {w.returncode})\n{w.stdout}\n{w.stderr}\n')


#: what each node of an ssd_sync job says of its port (security.Guard.describe)
SAID = {'curve': 'authenticated and encrypted (CURVE)',
        'aesgcm': 'authenticated and encrypted (AES-256-GCM on every frame)',
        'plain': "authenticated (the job's key file), not encrypted"}


def _run_ssd(system, layout, args, out, timeout, settings, log_path, notes, security):
    """ssdsgd's run_job with the netns launcher in mode ``security``; the launcher's exit
    race is a note. The job's own nodes must say they ran in that mode."""
    env = dict(JOB_ENV, **to_env(**settings))
    with open(log_path, 'w') as f:
        def log(text):
            f.write(f'[launcher] {text}\n')
            f.flush()
        code = _run_job_with_timeout(
            layout.num_workers, layout.num_servers, worker_cmd('ssd_sync', out, args), env,
            NetnsLauncher(layout, security), f, log, timeout)
    if code in (130, 143):
        raise Interrupted('SIGINT' if code == 130 else 'SIGTERM')
    if code == 1 and _launcher_exit_race(log_path, out, layout.num_workers):
        code = 0       # every worker finished and wrote its result; see the note
        notes.append(RACE_NOTE)
    if code != 0:
        raise RuntimeError(f'ssd_sync ({system.mode}) job exited {code}:\n'
                           f'{_tail(log_path)}')
    said = Path(log_path).read_text(errors='replace')
    if SAID[security] not in said or any(SAID[m] in said for m in SAID if m != security):
        raise RuntimeError(f'ssd_sync ({system.mode}) job: its nodes did not all say '
                           f'"{SAID[security]}" ({security} expected)')


def _run_compute_only(layout, args, out, timeout, log_path):
    """The workers alone, no kvstore, lined up by a file barrier in ``out``."""
    procs = []
    with open(log_path, 'w') as f:
        try:
            for i, h in enumerate(layout.worker_hosts()):
                env = clean_env(**JOB_ENV, BENCH_WORKER_INDEX=i,
                                BENCH_NUM_WORKERS=layout.num_workers,
                                BENCH_BARRIER_DIR=out / 'barrier')
                procs.append(layout.cluster.popen(h, worker_cmd('none', out, args), env=env,
                                                  stdout=f, stderr=subprocess.STDOUT,
                                                  stdin=subprocess.DEVNULL))
            deadline = time.monotonic() + timeout
            while any(p.poll() is None for p in procs):
                if time.monotonic() > deadline:
                    raise RuntimeError(f'compute-only workers timed out after {timeout:g} s')
                time.sleep(0.1)
        finally:
            stop_groups(procs, grace=0)
    bad = [p.returncode for p in procs if p.returncode != 0]
    if bad:
        raise RuntimeError(f'compute-only worker exited {bad[0]}:\n{_tail(log_path)}')


class JobTimeout(RuntimeError):
    pass


class _Deadline:
    """run_job calls progress.poll() every 0.1 s while it waits for the job; raising here
    makes run_job stop every process it started (its finally) and re-raise."""

    def __init__(self, timeout):
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout

    def poll(self):
        if time.monotonic() > self.deadline:
            raise JobTimeout(f'the job did not finish within {self.timeout:g} s')

    def close(self):
        pass


def _run_job_with_timeout(num_workers, num_servers, cmd, env, launcher, sink, log, timeout):
    try:
        return run_job(num_workers, num_servers, cmd, env, launcher=launcher, log=log,
                       stdout=sink, stderr=sink, progress=_Deadline(timeout))
    except JobTimeout as e:
        log(str(e))
        return 124


def steady_step(result, system):
    """Seconds per step in the steady state, from one worker's step end times.

    ssd: over whole pull periods, from the end of step k-1 to the end of step m*k-1 (the
    step before the m-th wait for a pull), so the queue of pushes in flight is in the same
    phase at both ends and neither the idle link of the first step nor the final drain
    counts; needs m >= 2. Other rows: every step but the first."""
    e = result.get('step_ends') or []
    if system.kind == 'ssd' and system.mode == 'ssd' and system.k:
        # the k the job ran (its own choice when auto), else the row's
        k = int((result.get('kv_metrics_end') or {}).get('delay_steps') or system.k)
        m = len(e) // k
        if m < 2:
            return None
        return (e[m * k - 1] - e[k - 1]) / ((m - 1) * k)
    if len(e) < 2:
        return None
    return (e[-1] - e[0]) / (len(e) - 1)


def ran_with(results, system):
    """k, the pull relay, the warm-up and the compression the job ran with: the row's settings, or the
    job's own choices where they were auto (rank 0's kvstore figures; docs/auto.md)."""
    ran = results[0].get('kv_metrics_end') or {}
    chosen = (ran.get('choices') or {}).get('compression') or {}
    return {'k': int(ran.get('delay_steps') or system.k),
            'pull_relay': ran.get('pull_relay') or ('chain' if system.relay else 'off'),
            'warmup_steps': ran.get('warmup_steps'),
            'compression_ran': chosen.get('value') or system.compression or 'none'}


def moved_bytes_per_worker(results):
    """The bytes through each worker's own interface (tx + rx, headers and heartbeats
    included) over its measured region, averaged over the workers; None unless every
    worker read its counters."""
    if not all('tx_bytes' in r for r in results):
        return None
    return sum(r['tx_bytes'] + r['rx_bytes'] for r in results) / len(results)


def summarize(results, system, workload, rate_bits, num_workers, num_servers, bound_s):
    """One table row from the workers' result files."""
    start = min(r['t_start'] for r in results)
    end = max(r['t_end'] for r in results)
    steps = results[0]['steps']
    wall = end - start
    samples = sum(r['steps'] * r['batch'] for r in results)
    row = {
        'system': system.key, 'label': system.label, 'workload': workload.name,
        'rate_bits': rate_bits, 'workers': num_workers, 'servers': num_servers,
        'glu_state': system.glu_state,
        'pull_schedule': 'staggered' if system.staggered else 'aligned',
        **ran_with(results, system), 'steps': steps, 'wall_s': wall,
        'samples_per_s': samples / wall if wall > 0 else None,
        'step_s': wall / steps if steps else None,
        'compute_per_step_s': sum(r['compute_s'] for r in results) / len(results) / steps,
        # time in trainer.step + waiting for the weights, and for ssd the final drain
        # (pushes still in flight when the last step returned), spread over the steps
        'blocked_per_step_s': sum(r['blocked_s'] + r.get('drain_s', 0.0) for r in results)
        / len(results) / steps,
        'drain_s': max(r.get('drain_s', 0.0) for r in results),
        # each timed step's blocked seconds, averaged over the workers
        'blocked_steps_s': [sum(b) / len(b) for b in zip(*(r.get('step_blocked') or []
                                                            for r in results))],
        'net_devs': [r.get('net_dev') for r in results],
        'leftover_pids': results[0].get('leftover_pids', 0),
    }
    if all('cpu_s' in r for r in results):
        row['worker_cpu_per_step_s'] = sum(r['cpu_s'] for r in results) / len(results) / steps
    if results[0].get('server_cpu_s'):
        # the whole job's server CPU (start-up and untimed steps included) over its steps
        row['server_cpu_per_step_s'] = results[0]['server_cpu_s'] / (
            steps + results[0].get('warmup', 0))
    moved = moved_bytes_per_worker(results)
    if moved is not None:
        row['wire_bytes_per_step'] = moved / steps
        row['tx_bytes_per_step'] = sum(r['tx_bytes'] for r in results) / len(results) / steps
        row['rx_bytes_per_step'] = sum(r['rx_bytes'] for r in results) / len(results) / steps
    steady = [steady_step(r, system) for r in results]
    if all(steady):
        row['steady_step_s'] = sum(steady) / len(steady)
        row['steady_samples_per_s'] = sum(r['batch'] for r in results) / row['steady_step_s']
    kvm = [r.get('kv_metrics') for r in results]
    if all(kvm):
        row['kv_bytes_per_step'] = sum(m.get('bytes_sent', 0) + m.get('bytes_received', 0)
                                       for m in kvm) / len(kvm) / steps
        row['replies_relayed'] = sum(m.get('replies_relayed_in', 0) for m in kvm)
    if bound_s:
        row['bound_samples_per_s'] = bound_s
        if row.get('steady_samples_per_s'):
            row['steady_fraction_of_bound'] = row['steady_samples_per_s'] / bound_s
        row['fraction_of_bound'] = row['samples_per_s'] / bound_s if row['samples_per_s'] \
            else None
    return row
