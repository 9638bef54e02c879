"""Processes for tests and benchmarks: a clean environment, stopping process groups, and
running ``launch/dist.py`` from this checkout with a timeout that leaves nothing behind.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from ssdsgd.launch.local import kill_group

__all__ = ['REPO', 'DIST', 'clean_env', 'stop_groups', 'run_dist']

#: The checkout this module is in, and its launcher.
REPO = Path(__file__).resolve().parents[2]
DIST = REPO / 'launch' / 'dist.py'

#: How long launch/dist.py gets after SIGTERM: it stops its own processes (each in a
#: session of its own, out of reach of its group) with SIGTERM, 5 s, SIGKILL.
LAUNCHER_GRACE_S = 15.0
_POLL_S = 0.05


def clean_env(**extra) -> dict[str, str]:
    """This process's environment without ps-lite's (DMLC_*) or ssdsgd's (SSDSGD_*)
    variables, so a job started from a test never inherits a role from its caller; plus
    ``extra`` (values turned to str)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(('DMLC_', 'SSDSGD_'))}
    env.update({k: str(v) for k, v in extra.items()})
    return env


def stop_groups(popens, grace: float = 2.0) -> None:
    """Stop the process groups led by ``popens`` (started with start_new_session=True).

    SIGTERM every group still running and wait up to ``grace`` seconds (0: skip this),
    then SIGKILL every group, also those whose leader has exited (a child may linger),
    and reap the leaders.
    """
    running = [p for p in popens if p.poll() is None]
    if grace > 0:
        for p in running:
            kill_group(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while running and time.monotonic() < deadline:
            running = [p for p in running if p.poll() is None]
            time.sleep(_POLL_S)
    for p in popens:
        kill_group(p.pid, signal.SIGKILL)
    for p in popens:
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


def run_dist(args, *, env: dict | None = None, timeout: float,
             merge_output: bool = False, cwd=REPO) -> subprocess.CompletedProcess:
    """``python launch/dist.py ARGS`` in a session of its own; waits for it.

    Returns a CompletedProcess with text output (stderr in stdout with
    ``merge_output``). ``env`` is added to :func:`clean_env`. After ``timeout`` seconds
    the launcher gets SIGTERM (it then stops its job) and raises
    subprocess.TimeoutExpired carrying the output so far. Either way the launcher's
    process group is killed before this returns.
    """
    cmd = [sys.executable, str(DIST), *map(str, args)]
    proc = subprocess.Popen(cmd, cwd=cwd, env=clean_env(**(env or {})), text=True,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT if merge_output else subprocess.PIPE,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop_groups([proc], grace=LAUNCHER_GRACE_S)
        out, err = proc.communicate()
        raise subprocess.TimeoutExpired(cmd, timeout, output=out, stderr=err) from None
    finally:
        stop_groups([proc], grace=0)     # anything the launcher left in its group
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
