"""What the benchmarks share: the checkout, workers' result files, the machine's record."""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def load_results(out, num_workers):
    """The ``result-rank*.json`` every worker of one job wrote into ``out``."""
    found = sorted(Path(out).glob('result-rank*.json'))
    if len(found) != num_workers:
        raise RuntimeError(f'expected {num_workers} result files in {out}, found {len(found)}')
    return [json.loads(f.read_text()) for f in found]


def machine_info():
    """Date, CPU, memory, load, library versions and the git commit, for the record."""
    info = {'date': time.strftime('%Y-%m-%d %H:%M:%S %Z'), 'python': sys.version.split()[0],
            'kernel': platform.release(), 'cpus': os.cpu_count()}
    info.update(_cpu_and_memory())
    try:
        info['loadavg_start'] = tuple(round(x, 2) for x in os.getloadavg())
    except OSError:
        pass
    for mod in ('mxnet', 'gluoncv', 'zmq', 'numpy'):
        try:
            info[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001
            pass
    info.update(_git())
    return info


def _cpu_and_memory():
    info = {}
    try:
        with open('/proc/cpuinfo') as f:
            names = [line.split(':', 1)[1].strip() for line in f if line.startswith('model name')]
        info['cpu'] = names[0] if names else platform.processor()
    except OSError:
        info['cpu'] = platform.processor()
    try:
        with open('/proc/meminfo') as f:
            kb = int(next(line for line in f if line.startswith('MemTotal')).split()[1])
        info['memory_gib'] = round(kb / 2**20, 1)
    except (OSError, StopIteration):
        pass
    return info


def _git():
    # BENCH_GIT_COMMIT names the commit of a source export (git archive) run outside a clone
    info = {'git': os.environ.get('BENCH_GIT_COMMIT', '')}
    try:
        if not info['git']:
            info['git'] = subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], cwd=REPO,
                                         capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(['git', 'status', '--porcelain', '--untracked-files=no',
                                'ssdsgd'], cwd=REPO, capture_output=True, text=True).stdout
        info['ssdsgd_dirty'] = bool(dirty.strip())
    except OSError:
        pass
    return info
