"""Hosts that appear while a job runs (``--host-discovery-script FILE``, as Horovod's
elastic ``horovodrun --host-discovery-script``): the ssh launcher's loop that grows a job.

Every ``POLL_S`` seconds the launcher runs the script (at most ``SCRIPT_TIMEOUT_S``
seconds); it prints the hosts available now, one ``host[:slots]`` a line (Horovod's
format; blank lines and ``#`` comments skipped). A host that is not one of the job's own
gets a joiner per slot (``launch/dist.py --join RUN_DIR --host HOST``, launch/cli.py)
while spare ranks last (``cluster.max_workers``); each joiner's lines come prefixed as
``[worker R on HOST]``. What the script says is reported once per change: a script
that fails or prints a malformed line is one line and the job goes on with the hosts it
has. When a host disappears from the list, its workers leave the job (``leaving.leave``:
at a step every worker hears of in time, docs/spec/membership.md): a joiner's rank comes
from the claim file its ``--join`` wrote (its pid), and a worker still joining is asked
again at the next poll; a host the job started on loses its first workers once the
script has listed it and then stops (a script that lists only new hosts keeps them),
worker 0 too (the chief's part passes to the lowest rank left, docs/spec/membership.md
rule 8); the scheduler stays on the launcher's host. Its servers go too
where a backup can take their keys (``cluster.server_replicas: 1``, no server lost
yet): each is stopped, the launcher sees it exit and tells the scheduler, which hands its
keys to its backup at once (the job then has no replica left); otherwise they stay, and
the loop says why.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

from .hosts import HostError, parse_hosts
from .job import _pump
from .joining import JoinRefused, read
from .leaving import leave
from .local import LocalProcess, signal_group, start_child

POLL_S = 2.0
SCRIPT_TIMEOUT_S = 10.0
JOINER_GRACE_S = 30.0       # a joiner's end after the job's (it ends with its worker)
DIST = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "launch",
                    "dist.py")


def read_hosts(text, source):
    """``{host: slots}`` from the script's output; HostError (one line) if malformed."""
    items = [ln.split("#", 1)[0].strip() for ln in text.splitlines()]
    items = [i for i in items if i]
    return {} if not items else {h.name: h.slots for h in parse_hosts(items, source)}


class HostDiscovery:
    """``script``: the discovery script; ``job_hosts``: the hosts the job started on
    (they get no joiner); ``spare``: the ranks joiners may take; ``sinks``: where the
    joiners' output goes (stdout, stderr), whole lines under the job's output ``lock``."""

    def __init__(self, script, run_dir, job_hosts, spare, log, sinks, lock,
                 first_workers=None, servers=(), replicas=0):
        self.script, self.run_dir, self.log = script, str(run_dir), log
        self.job_hosts, self.spare = set(job_hosts), spare
        self.first_workers = first_workers or {}     # host -> the job's own worker ranks
        self.servers, self.replicas = list(servers), replicas   # the job's server processes
        self.sinks, self.lock = sinks, lock
        self.joiners = []         # (host, LocalProcess of `dist.py --join`)
        self.started = {}         # host -> joiners started there
        self.listed = {}          # the script's last good answer
        self.going = set()        # hosts no longer listed whose workers are still to leave
        self.gone = set()         # ranks that left (asked by this loop)
        self._said = None         # the last problem reported (reported once)
        self._full = False
        self._ended = set()       # joiners whose failure was reported
        self._server_said = set()    # servers on hosts no longer listed, acted on once
        self._stopped = set()        # and the one of them stopped
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True,
                                        name="host-discovery")

    def start(self):
        self.log(f"host discovery: running {self.script} every {POLL_S:g} s; new hosts get "
                 f"a joiner per slot ({self.spare} spare ranks, cluster.max_workers)")
        self._thread.start()
        return self

    def stop(self, ended=True):
        """The job is over: stop polling. After a clean end (``ended``) the joiners end
        with their workers (stopped after JOINER_GRACE_S if they do not); otherwise they
        are stopped now (their ssh, and so their remote worker, dies with them)."""
        self._stop.set()
        self._thread.join(timeout=SCRIPT_TIMEOUT_S + 5)
        deadline = time.monotonic() + JOINER_GRACE_S      # one grace for all of them
        for host, proc in self.joiners:
            if not ended:
                signal_group(proc.popen, 15)
            try:
                proc.popen.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                self.log(f"host discovery: the joiner on {host} did not end with the job; "
                         "stopping it")
                signal_group(proc.popen, 9)
                proc.popen.wait(timeout=10)

    def _loop(self):
        while True:
            self.poll()
            if self._stop.wait(POLL_S):
                return

    def _say_once(self, text):
        if text != self._said:
            self.log(f"host discovery: {text}")
            self._said = text

    def poll(self):
        """Run the script once and act on its answer."""
        try:
            r = subprocess.run([self.script], capture_output=True, text=True,
                               stdin=subprocess.DEVNULL, timeout=SCRIPT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return self._say_once(f"{self.script} did not answer within "
                                  f"{SCRIPT_TIMEOUT_S:g} s; keeping the hosts it listed")
        except OSError as e:
            return self._say_once(f"cannot run {self.script} ({e.strerror}); keeping the "
                                  "hosts it listed")
        if r.returncode != 0:
            last = (r.stderr.strip().splitlines() or [""])[-1]
            why = last or "no message"
            return self._say_once(f"{self.script} exited {r.returncode} ({why}); keeping "
                                  "the hosts it listed")
        try:
            hosts = read_hosts(r.stdout, self.script)
        except HostError as e:
            return self._say_once(f"{e}; keeping the hosts it listed")
        self._said = None
        for host, proc in self.joiners:
            if proc.poll() not in (None, 0) and proc not in self._ended:
                self._ended.add(proc)
                self.log(f"host discovery: the joiner on {host} ended with exit "
                         f"{proc.poll()} (its lines say why); {host} gets no other try")
        self.going = (self.going | (set(self.listed) - set(hosts))) - set(hosts)
        for host in sorted(self.going):
            if self._remove(host):         # its workers' departures decided, then
                self._stop_servers(host)   # its servers
                self.going.discard(host)
        self.listed = hosts
        for host, slots in hosts.items():
            if host in self.job_hosts:
                continue
            for _ in range(slots - self.started.get(host, 0)):
                if not self._join(host):
                    return

    def _remove(self, host):
        """``host`` is no longer listed: each worker this loop started there leaves the
        job; False while one of them is still joining (asked again at the next poll)."""
        ranks, retry = self._ranks_on(host)
        first = [r for r in self.first_workers.get(host, []) if r not in self.gone]
        if not ranks and not retry and not first:
            if host in self.started and host not in self.job_hosts:
                self.log(f"host discovery: {host} is no longer listed; no worker of the "
                         "job runs there")
            return True
        for rank in sorted(ranks + first):
            try:
                step = leave(self.run_dir, rank, wait_s=SCRIPT_TIMEOUT_S)
            except JoinRefused as e:
                if rank not in first and ("still joining" in str(e)
                                          or "is not in the job" in str(e)):
                    retry = True         # not registered yet: ask at the next poll
                    continue
                self.log(f"host discovery: {host} is no longer listed; {e}")
                self.gone.add(rank)
                continue
            self.gone.add(rank)
            if rank not in first:
                self.started[host] -= 1
            self.log(f"host discovery: {host} is no longer listed; worker {rank} leaves the "
                     f"job at step {step}")
        return not retry

    def _stop_servers(self, host):
        """The job's servers on ``host`` (no longer listed): stopped where a backup can take
        their keys (cluster.server_replicas: 1 and no server lost yet; the launcher sees the
        exit and tells the scheduler), else left running, said once each."""
        for proc in [p for p in self.servers if p.host == host and p not in self._server_said]:
            self._server_said.add(proc)
            if proc.poll() is not None:
                continue
            lost = [p.rank for p in self.servers if p.poll() is not None or p in self._stopped]
            if self.replicas and not lost:
                self.log(f"host discovery: {host} is no longer listed; server {proc.rank} "
                         "stops there and its backup takes its keys "
                         "(cluster.server_replicas: 1; no replica is left after it)")
                self._stopped.add(proc)
                proc.signal(signal.SIGKILL)
                continue
            why = (f"server {lost[0]} was lost before it and the job has no replica left"
                   if self.replicas else
                   "no backup holds its keys (cluster.server_replicas: 0)")
            self.log(f"host discovery: {host} is no longer listed; server {proc.rank} stays "
                     f"there ({why})")

    def _ranks_on(self, host):
        """(ranks of the running joiners this loop started on ``host``, from the claim
        files their ``--join`` wrote (``joining.claim``: its pid); whether one of them
        has claimed no rank yet)."""
        pids = {proc.popen.pid for h, proc in self.joiners
                if h == host and proc.poll() is None}
        if not pids:
            return [], False
        try:
            key_dir = read(self.run_dir)["key_dir"]
            names = os.listdir(key_dir)
        except (JoinRefused, OSError):
            return [], False              # the job has ended
        claimed = {}
        for name in names:
            rank = name[len("claimed-worker-"):]
            if not name.startswith("claimed-worker-") or not rank.isdigit():
                continue
            try:
                with open(os.path.join(key_dir, name)) as f:
                    claimed[int(f.read().strip() or -1)] = int(rank)
            except (OSError, ValueError):
                continue
        ranks = [claimed[pid] for pid in pids if pid in claimed]
        return sorted(r for r in ranks if r not in self.gone), len(ranks) < len(pids)

    def _join(self, host):
        """Start one joiner on ``host``; False once no spare rank is left."""
        if len(self.joiners) >= self.spare:
            if not self._full:
                self.log(f"host discovery: {host} is listed but every spare rank is taken "
                         f"({self.spare} joined; cluster.max_workers)")
                self._full = True
            return False
        self.log(f"host discovery: {host} is new; starting a worker there")
        popen = start_child([sys.executable, DIST, "--join", self.run_dir, "--host", host],
                            dict(os.environ))
        proc = LocalProcess("joiner", len(self.joiners), popen, host)
        for stream, sink in ((popen.stdout, self.sinks[0]), (popen.stderr, self.sinks[1])):
            # the job's own pump and lock: its lines, already prefixed by --join
            threading.Thread(target=_pump, args=(stream, "", sink, self.lock),
                             daemon=True).start()
        self.joiners.append((host, proc))
        self.started[host] = self.started.get(host, 0) + 1
        return True


def check(opts, workers, max_workers):
    """Before anything starts: ``--host-discovery-script`` needs the ssh launcher (it
    starts joiners with ``--join --host``), spare ranks to give (cluster.max_workers
    above the workers) and a script it can run; LaunchError (one line) if not."""
    from .remote import LaunchError
    script = opts.host_discovery_script
    if not script:
        return
    if opts.launcher != "ssh":
        raise LaunchError(f"--host-discovery-script works with --launcher ssh only (it "
                          f"starts workers on new hosts over ssh), got --launcher "
                          f"{opts.launcher}")
    if not max_workers or max_workers <= workers:
        raise LaunchError("--host-discovery-script needs spare ranks for the hosts it finds: "
                          f"set cluster.max_workers above the job's {workers} workers")
    if not (os.path.isfile(script) and os.access(script, os.X_OK)):
        raise LaunchError(f"--host-discovery-script {script}: not an executable file")
