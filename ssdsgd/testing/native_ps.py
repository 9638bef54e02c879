"""Run a job on MXNet's own parameter server (ps-lite), all on this machine.

The MXNet wheel ships ps-lite.  A process whose environment says ``DMLC_ROLE=server`` or
``DMLC_ROLE=scheduler`` turns into a ps-lite node at ``import mxnet`` and exits when the
job ends; a worker is an ordinary script that creates a ``dist_*`` kvstore.  This module
starts one scheduler, ``num_servers`` servers and ``num_workers`` workers as subprocesses,
waits for the workers, and always kills every process it started.

It is the reference ssdsgd is compared against (tests/test_native_ps.py, bench/).
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from ssdsgd.launch.job import free_port

from .procs import clean_env, stop_groups

__all__ = ['CompletedWorker', 'NativePSError', 'run_native', 'run_native_nodes']

#: Variables run_native owns; ``env`` may not override them.
OWNED_VARS = ('DMLC_ROLE', 'DMLC_PS_ROOT_URI', 'DMLC_PS_ROOT_PORT',
              'DMLC_NUM_SERVER', 'DMLC_NUM_WORKER')
#: Modes MXNet's ``mx.kv.create`` accepts for a ps-lite job.
MODES = ('dist_sync', 'dist_async', 'dist_device_sync', 'dist_sync_device',
         'dist_device_async', 'dist_async_device')
#: The placeholder in ``cmd`` that run_native replaces with ``mode``.
MODE_PLACEHOLDER = '{mode}'
#: A scheduler or server: ps-lite takes over at ``import mxnet`` (DMLC_ROLE says which).
# ssdsgd first: its cache of MXNet's compiled operator code (mxglue/op_code_cache.py)
# speeds the import up, so the reference pays the start-up ssdsgd's own nodes pay.
_NODE_ARGS = [sys.executable, '-c', 'import ssdsgd, mxnet']

_POLL_S = 0.05
_NODE_EXIT_GRACE_S = 10.0   # how long scheduler/servers get to exit after the workers
_TERM_GRACE_S = 2.0         # SIGTERM -> SIGKILL
_TAIL_CHARS = 3000


@dataclass
class CompletedWorker:
    """One worker's outcome.

    ``index`` is the launch order, *not* ``kv.rank``: ps-lite assigns ranks itself
    (it sorts nodes by address), so a script that needs its rank must print or save it.
    """
    index: int
    args: list[str]
    returncode: int
    stdout: str
    stderr: str


class NativePSError(RuntimeError):
    """A process of the native job failed or the job timed out.

    ``workers`` holds what every worker had written so far (returncode is None for a
    worker that was still running and got killed).
    """

    def __init__(self, message: str, workers: list[CompletedWorker] | None = None):
        super().__init__(message)
        self.workers = workers or []


@dataclass
class _Proc:
    name: str            # 'scheduler', 'server 0', 'worker 1'
    role: str
    index: int
    args: list[str]
    popen: subprocess.Popen
    out_path: str
    err_path: str
    cleaned: bool = field(default=False)   # its process group got the final SIGKILL

    def read(self) -> tuple[str, str]:
        return _read(self.out_path), _read(self.err_path)

    def describe(self) -> str:
        out, err = self.read()
        text = (err or out)[-_TAIL_CHARS:]
        return (f'{self.name} (pid {self.popen.pid}, exit code {self.popen.returncode}); '
                f'last output:\n{text}')


def _read(path: str) -> str:
    with open(path, 'r', encoding='utf-8', errors='replace') as f:
        return f.read()


def _stop_all(procs: list[_Proc]) -> None:
    """SIGTERM every group still running, then SIGKILL whatever is left; reap all.

    Each group gets its final SIGKILL once only, so a later call cannot hit a reused pid.
    """
    procs = [p for p in procs if not p.cleaned]
    stop_groups([p.popen for p in procs], grace=_TERM_GRACE_S)
    for p in procs:
        p.cleaned = True


def run_native_nodes(cmd: list[str], num_workers: int, num_servers: int = 1,
                     mode: str = 'dist_sync', env: dict[str, str] | None = None,
                     timeout: float = 300, cwd: str | os.PathLike | None = None,
                     *, root_uri: str, node, check: bool = True) -> list[CompletedWorker]:
    """run_native with every process on a host of its own (e.g. a network namespace).

    ``node(role, index)`` returns ``(prefix, host)`` for the scheduler (index 0), each
    server and each worker (index = launch order): the process runs ``prefix + args``
    (e.g. ``['ip', 'netns', 'exec', NS]``) with ``DMLC_NODE_HOST=host``, the address
    ps-lite binds and advertises for it.  ``root_uri`` is the scheduler's address
    (``DMLC_PS_ROOT_URI``); it must be the scheduler's own host.  Everything else
    (``mode``, ``env``, ``timeout``, ``check``, the return value, errors and clean-up) is
    as in :func:`run_native`; ``DMLC_NODE_HOST`` in ``env`` is overridden per process.
    """
    return _run(cmd, num_workers, num_servers, mode, env, timeout, cwd, check=check,
                root_uri=root_uri, node=node)


def run_native(cmd: list[str], num_workers: int, num_servers: int = 1,
               mode: str = 'dist_sync', env: dict[str, str] | None = None,
               timeout: float = 300, cwd: str | os.PathLike | None = None,
               *, check: bool = True) -> list[CompletedWorker]:
    """Run ``cmd`` as ``num_workers`` workers of a local ps-lite job and wait for them.

    Starts one scheduler and ``num_servers`` servers (each ``python -c "import ssdsgd, mxnet"``
    with the same interpreter as the caller) and the workers, every one in its own
    process group, with ``DMLC_ROLE``, ``DMLC_PS_ROOT_URI=127.0.0.1``,
    ``DMLC_PS_ROOT_PORT`` (a free port), ``DMLC_NUM_SERVER`` and ``DMLC_NUM_WORKER`` set.

    ``mode`` (a ``dist_*`` kvstore type) replaces the text ``{mode}`` in any element of
    ``cmd``; the worker script itself calls ``mx.kv.create``, so ps-lite never sees it
    otherwise.  ``env`` is added to the environment of every process (workers, servers
    and scheduler), e.g. ``PS_VERBOSE`` or ``OMP_NUM_THREADS``; ``DMLC_NODE_HOST``
    defaults to 127.0.0.1.

    Returns one CompletedWorker per worker in launch order.  Raises NativePSError naming
    the process if any process exits with a non-zero code (with ``check=False``, a
    failed worker is reported in its returncode instead) or if the job outlives
    ``timeout`` seconds.  Every process started is killed before this returns or raises.
    """
    return _run(cmd, num_workers, num_servers, mode, env, timeout, cwd, check=check,
                root_uri='127.0.0.1', node=None)



def _run(cmd, num_workers, num_servers, mode, env, timeout, cwd, *, check, root_uri, node):
    worker_args = _validate(cmd, num_workers, num_servers, mode, env)
    job = _Job(_job_env(env, root_uri, num_servers, num_workers), node, cwd, mode)
    try:
        job.start('scheduler', 0, _NODE_ARGS)
        for i in range(num_servers):
            job.start('server', i, _NODE_ARGS)
        for i in range(num_workers):
            job.start('worker', i, worker_args)
        failed = job.wait_for_workers(timeout)
        if failed:
            return job.failed(failed, check)
        return job.finished(check)
    finally:
        job.close()


def _validate(cmd, num_workers, num_servers, mode, env) -> list[str]:
    """The worker's arguments with ``{mode}`` filled in; ValueError on bad arguments."""
    if num_workers < 1 or num_servers < 1:
        raise ValueError('num_workers and num_servers must be >= 1')
    if mode not in MODES:
        raise ValueError(f'mode must be one of {MODES}, got {mode!r}')
    clash = sorted(set(env or {}) & set(OWNED_VARS))
    if clash:
        raise ValueError(f'run_native sets {clash} itself; do not pass them in env')
    worker_args = [str(a).replace(MODE_PLACEHOLDER, mode) for a in cmd]
    if not worker_args:
        raise ValueError('cmd is empty')
    return worker_args


def _job_env(env, root_uri, num_servers, num_workers) -> dict[str, str]:
    """What every process of the job gets (DMLC_ROLE is added per process)."""
    common = clean_env()
    common.update({
        'DMLC_PS_ROOT_URI': root_uri,
        'DMLC_PS_ROOT_PORT': str(free_port()),
        'DMLC_NUM_SERVER': str(num_servers),
        'DMLC_NUM_WORKER': str(num_workers),
        'DMLC_NODE_HOST': '127.0.0.1',
    })
    common.update(env or {})
    return common


class _Job:
    """The processes of one native job, their logs, and how the job ends."""

    def __init__(self, env: dict[str, str], node, cwd, mode: str):
        self.env, self.node, self.cwd, self.mode = env, node, cwd, mode
        self.logdir = tempfile.TemporaryDirectory(prefix='native_ps-')
        self.procs: list[_Proc] = []

    @property
    def workers(self) -> list[_Proc]:
        return [p for p in self.procs if p.role == 'worker']

    @property
    def nodes(self) -> list[_Proc]:
        return [p for p in self.procs if p.role != 'worker']

    def start(self, role: str, index: int, args: list[str]) -> _Proc:
        name = role if role == 'scheduler' else f'{role} {index}'
        tag = name.replace(' ', '')
        out_path = os.path.join(self.logdir.name, f'{tag}.out')
        err_path = os.path.join(self.logdir.name, f'{tag}.err')
        penv = dict(self.env, DMLC_ROLE=role)
        prefix = []
        if self.node is not None:
            prefix, host = self.node(role, index)
            penv['DMLC_NODE_HOST'] = host
        with open(out_path, 'wb') as out, open(err_path, 'wb') as err:
            popen = subprocess.Popen(list(prefix) + list(args), env=penv, cwd=self.cwd,
                                     stdin=subprocess.DEVNULL,
                                     stdout=out, stderr=err, start_new_session=True)
        proc = _Proc(name, role, index, args, popen, out_path, err_path)
        self.procs.append(proc)
        return proc

    def collect(self) -> list[CompletedWorker]:
        done = []
        for w in self.workers:
            out, err = w.read()
            done.append(CompletedWorker(w.index, w.args, w.popen.returncode, out, err))
        return done

    def wait_for_workers(self, timeout: float) -> list[_Proc]:
        """Wait until every worker exited 0 (returns []) or a process failed (returns the
        failed ones in the order they were noticed); NativePSError after ``timeout``."""
        deadline = time.monotonic() + timeout
        exited: list[_Proc] = []          # in the order this loop noticed them
        while True:
            exited += [p for p in self.procs
                       if p not in exited and p.popen.poll() is not None]
            # Scheduler and servers may leave (with 0) as soon as ps-lite finalizes,
            # slightly before the workers' interpreters exit; only a code != 0 fails.
            failed = [p for p in exited if p.popen.returncode != 0]
            if failed or all(w in exited for w in self.workers):
                return failed
            if time.monotonic() > deadline:
                self._time_out(timeout)
            time.sleep(_POLL_S)

    def _time_out(self, timeout: float):
        running = [p.name for p in self.procs if p.popen.poll() is None]
        _stop_all(self.procs)
        raise NativePSError(
            f'native {self.mode} job timed out after {timeout:g} s; still running: '
            f'{", ".join(running)}\n' + '\n'.join(p.describe() for p in self.workers),
            self.collect())

    def failed(self, failed: list[_Proc], check: bool) -> list[CompletedWorker]:
        """A process failed: the others would wait for it forever (barriers), so stop
        them; raise, unless ``check`` is off and only workers failed."""
        _stop_all(self.procs)
        if not check and all(p.role == 'worker' for p in failed):
            return self.collect()
        first, others = failed[0], [p.name for p in failed[1:]]
        also = f' (also failed: {", ".join(others)})' if others else ''
        raise NativePSError(f'native {self.mode} job: {first.name} failed{also}: '
                            f'{first.describe()}', self.collect())

    def finished(self, check: bool) -> list[CompletedWorker]:
        """All workers exited 0; the scheduler and servers leave on their own (given
        _NODE_EXIT_GRACE_S), and one that exits non-zero fails the job under ``check``."""
        node_deadline = time.monotonic() + _NODE_EXIT_GRACE_S
        while (any(p.popen.poll() is None for p in self.nodes)
               and time.monotonic() < node_deadline):
            time.sleep(_POLL_S)
        bad_nodes = [p for p in self.nodes if p.popen.poll() not in (None, 0)]
        _stop_all(self.procs)
        if bad_nodes and check:
            raise NativePSError(f'native {self.mode} job: {bad_nodes[0].name} failed: '
                                f'{bad_nodes[0].describe()}', self.collect())
        return self.collect()

    def close(self) -> None:
        _stop_all(self.procs)
        self.logdir.cleanup()
