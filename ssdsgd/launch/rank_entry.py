"""The remote end of every multi-host launcher: one process of the job on its host.

    ssh HOST 'cd DIR && exec PYTHON .../ssdsgd/launch/rank_entry.py --stdin'
    mpirun ... PYTHON .../ssdsgd/launch/rank_entry.py --rank-from OMPI_COMM_WORLD_RANK
    srun ...   PYTHON .../ssdsgd/launch/rank_entry.py --rank-from SLURM_PROCID

(run as a file, so that it starts in a fraction of a second: ``python -m`` would import the
``ssdsgd`` package and with it MXNet; it needs only the standard library and PyYAML).

It reads the job's spec (JSON: the environment, working directory and the table of
processes) from its first stdin line (ssh: nothing of it lands on a command line) or from
``SSDSGD_LAUNCH_SPEC``; takes its key file (ssh: its text from the spec, written here
0600 and removed at the end; mpi/slurm: only its path, on the shared filesystem, checked
to be this user's regular file that nobody else can read); picks its entry (ssh: the one given; mpi/slurm: index = the rank
variable, so rank 0 is the scheduler, then the servers, then the workers); finds the
address to advertise; checks before anything starts that this host reaches the scheduler,
sees the run directory and has the data; then runs the scheduler/server node or the worker
command as its child and supervises it:

* the child dies with this process (PR_SET_PDEATHSIG) and gets SIGTERM then SIGKILL when
  the launcher is gone: ssh closes stdin (EOF) when its launcher dies; mpi/slurm processes
  hold a TCP "lifeline" connection to the launcher, which the kernel closes when it dies.
  Both are watched from before the checks, so a job stopped while this process still
  waits for the scheduler's port ends it at once (not after REFUSED_SECONDS);
* a line ``<signal number>`` on stdin (ssh) signals the child's process group;
* with ``tag``, every output line goes to stdout as ``@@ssdsgd <index> o|e <text>`` and
  the end as ``@@ssdsgd <index> x <code> <host>``, so the launcher can split one mpirun's
  or srun's output into the processes' lines and exit codes.

Exit code: the child's (128 + N when it was killed by signal N); 2 for a failed check.
"""
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time

if __package__:
    from . import addresses
    from .local import die_with_parent
else:   # run as a file (ENTRY_FILE): no `import ssdsgd`, whose MXNet takes seconds to load
    import addresses                       # noqa: I001 - this directory is sys.path[0]
    from local import die_with_parent

ENTRY_FILE = os.path.abspath(__file__)

TAG = "@@ssdsgd"
GRACE_SECONDS = 5.0
REFUSED_SECONDS = 120.0       # the scheduler's own bound for everyone to register
CHECK_FAILED = 2
LINE_CHUNK = 3000             # tagged lines stay below PIPE_BUF: writes are not interleaved


class EntryError(RuntimeError):
    """A check failed before the child started; the message is the one line to print."""


HOST = {"label": None}         # this host's name in the launcher's host list


def here():
    return HOST["label"] or addresses.hostname()


def read_spec(args, stdin):
    if "--stdin" in args:
        line = stdin.readline()
        if not line:
            raise EntryError("no job spec on stdin (the launcher went away)")
        return json.loads(line), None
    if "--rank-from" in args:
        i = args.index("--rank-from")
        var = args[i + 1] if i + 1 < len(args) else ""
        raw_index = os.environ.get(var, "")
        if not raw_index.isdigit():
            raise EntryError(f"--rank-from {var}: the variable is {raw_index!r}, not a rank "
                             "(start this with mpirun or srun)")
        text = os.environ.get("SSDSGD_LAUNCH_SPEC")
        if not text:
            raise EntryError("SSDSGD_LAUNCH_SPEC is not set (start this through "
                             "launch/dist.py --launcher mpi|slurm)")
        return json.loads(text), int(raw_index)
    raise EntryError("usage: rank_entry.py --stdin | --rank-from VAR")


def choose(spec, index):
    """(index, role, rank, cmd) of this process; entries are [role, rank, cmd, host]."""
    table = spec["procs"]
    index = spec.get("index", 0) if index is None else index
    if not 0 <= index < len(table):
        raise EntryError(f"rank {index} is outside the job's {len(table)} processes "
                         "(mpirun -np / srun -n must equal 1 + servers + workers)")
    role, rank, cmd = table[index][:3]
    if len(table[index]) > 3 and table[index][3]:
        HOST["label"] = table[index][3]
    return index, role, int(rank), list(cmd)


def node_address(env, role):
    """SSDSGD_NODE_HOST for this process (kept when the user set it)."""
    sched = env["SSDSGD_SCHEDULER_HOST"]
    if role == "scheduler":
        return sched
    if env.get("SSDSGD_NODE_HOST"):
        return env["SSDSGD_NODE_HOST"]
    iface = env.get("SSDSGD_INTERFACE") or None
    try:
        addr = addresses.advertised(sched, iface)
    except addresses.AddressError as e:
        raise EntryError(f"host {here()}: {e}; it cannot reach the scheduler's address "
                         f"(choose --interface or --scheduler-host)") from None
    if addr.startswith("127.") and not addresses.resolve(sched).startswith("127."):
        raise EntryError(f"host {here()} would advertise {addr} (interface {iface}), which "
                         f"the other hosts cannot reach; choose --interface with the address "
                         f"the scheduler's network reaches")
    return addr


def check_reach(what, host, port, timeout, addr):
    """Bounded: ``timeout`` s to reach the host, REFUSED_SECONDS while it refuses (the
    scheduler may still be importing its libraries on a busy host)."""
    err = addresses.wait_reachable(host, int(port), timeout, REFUSED_SECONDS)
    if err is not None:
        limit = max(timeout, REFUSED_SECONDS) if "refused" in err.lower() else timeout
        raise EntryError(f"host {here()} ({addr}) cannot reach {what} at {host}:{port} "
                         f"within {limit:g} s ({err}); check that the host is on the "
                         "scheduler's network (route, firewall) or choose --interface")


def _arg_after(cmd, flag):
    return cmd[cmd.index(flag) + 1] if flag in cmd[:-1] else None


def check_train_command(cmd):
    """For ``python -m ssdsgd.train CONFIG --run-dir DIR``: this host must see the run
    directory and the data path (each worker reads its data on its own host)."""
    if "ssdsgd.train" not in cmd:
        return
    run_dir = _arg_after(cmd, "--run-dir") or _arg_after(cmd, "--resume")
    if run_dir and not os.path.isdir(run_dir):
        raise EntryError(f"host {here()} does not see the run directory {run_dir}; it must be "
                         "on a filesystem every host shares at the same path (set output.dir)")
    config = cmd[cmd.index("ssdsgd.train") + 1] if cmd[-1] != "ssdsgd.train" else None
    if not config or config.startswith("-") or not os.path.exists(config):
        return
    import yaml
    with open(config) as f:
        data = (yaml.safe_load(f) or {}).get("data") or {}
    path = data.get("path")
    if path and not os.path.exists(path):
        raise EntryError(f"host {here()}: data.path {path} does not exist on this host "
                         "(every worker reads its data from the same path on its own host)")


class Output:
    """Where the child's lines go: straight through, or tagged on stdout."""

    def __init__(self, index, tag):
        self.index, self.tag = index, tag
        self.lock = threading.Lock()

    def line(self, stream, text):
        if not self.tag:
            target = sys.stdout if stream == "o" else sys.stderr
            target.write(text + "\n")
            target.flush()
            return
        for i in range(0, max(len(text), 1), LINE_CHUNK):
            self._raw(f"{TAG} {self.index} {stream} {text[i:i + LINE_CHUNK]}\n")

    def end(self, code):
        if self.tag:
            self._raw(f"{TAG} {self.index} x {code} {here()}\n")

    def _raw(self, text):
        data = text.encode("utf-8", "replace")
        with self.lock:
            try:
                os.write(1, data)
            except OSError:
                pass            # nobody reads any more: the launcher is gone


def _pump(pipe, stream, out):
    for raw in iter(pipe.readline, b""):
        out.line(stream, raw.decode("utf-8", "replace").rstrip("\n"))
    pipe.close()


def _signal_group(child, sig):
    try:
        os.killpg(child.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class Supervisor:
    """Runs the child; ends it when the launcher is gone or asks."""

    def __init__(self, child):
        self.child = child
        self.stop_at = None       # monotonic time of the SIGTERM; SIGKILL GRACE_SECONDS on

    def terminate(self, sig=signal.SIGTERM):
        if self.child.poll() is not None:
            return
        if sig == signal.SIGKILL:
            _signal_group(self.child, signal.SIGKILL)
            return
        _signal_group(self.child, sig)
        if self.stop_at is None:
            self.stop_at = time.monotonic()

    def wait(self):
        while True:
            try:
                return self.child.wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                pass
            if self.stop_at is not None and time.monotonic() - self.stop_at > GRACE_SECONDS:
                _signal_group(self.child, signal.SIGKILL)


class LauncherWatch:
    """The launcher's signs of life, watched from before the checks on: ssh's stdin (a
    signal line, or EOF when the launcher or its ssh is gone) and mpi/slurm's lifeline
    socket (closed by the kernel when the launcher dies). A stop that comes while this
    process still checks or waits for the scheduler ends it at once; once the child runs,
    it goes to the child (``sup``)."""

    def __init__(self, secrets):
        self.sup, self.secrets, self.lock = None, secrets, threading.Lock()
        self.lifeline = None

    def run_stdin(self, stdin):
        for line in iter(stdin.readline, ""):
            text = line.strip()
            if text.lstrip("-").isdigit():
                self.stop(abs(int(text)))
        self.stop(None)

    def run_socket(self, sock):
        try:
            while sock.recv(64):
                pass
        except OSError:
            pass
        self.stop(None)

    def stop(self, sig):
        with self.lock:
            sup = self.sup
        if sup is None:           # no child yet (a started one dies with us: PDEATHSIG)
            _remove(self.secrets)
            os._exit(128 + (sig or signal.SIGTERM))
        sup.terminate(sig) if sig else sup.terminate()

    def attach(self, sup):
        with self.lock:
            self.sup = sup


def _background(target, *args):
    t = threading.Thread(target=target, args=args, daemon=True)
    t.start()
    return t


def write_secrets(files, env):
    """Each secret file of the spec written here, mode 0600 (mkstemp), its path in
    ``env``; returns the paths, removed when the process ends."""
    paths = []
    where = "/dev/shm" if os.path.isdir("/dev/shm") else None     # not on a disk if we can
    for var, text in files.items():
        fd, path = tempfile.mkstemp(prefix="ssdsgd-secret-", dir=where)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        env[var] = path
        paths.append(path)
    return paths


def shared_key_files(paths, env):
    """mpi/slurm: each key file the launcher made on the shared filesystem, checked (this
    user's own regular file, readable by nobody else), its path in ``env``."""
    for var, path in paths.items():
        try:
            info = os.lstat(path)
        except OSError as e:
            raise EntryError(f"host {here()} does not see its key file {path} ({e.strerror}); "
                             "with --launcher mpi or slurm the run directory (or, with -- "
                             "COMMAND, the working directory) must be on a filesystem every "
                             "host shares at the same path") from None
        if not stat.S_ISREG(info.st_mode):
            raise EntryError(f"{var}={path} is not a regular file; refusing it as a key file")
        if info.st_uid != os.geteuid():
            raise EntryError(f"{var}={path} belongs to uid {info.st_uid}, not to this user "
                             f"(uid {os.geteuid()}); refusing it as a key file")
        if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise EntryError(f"{var}={path} has mode {stat.S_IMODE(info.st_mode):04o}; a key "
                             "file must be readable by its owner only (0600)")
        env[var] = path


def prepare(spec, role, cmd, watch):
    """The child's environment, after the checks (EntryError when one fails). The
    lifeline is held (and watched) before the scheduler's check, which may wait long."""
    env = dict(os.environ)
    env.update(spec.get("env", {}))
    env.pop("SSDSGD_LAUNCH_SPEC", None)
    addr = node_address(env, role)
    env["SSDSGD_NODE_HOST"] = addr
    timeout = float(spec.get("connect_timeout", 30))
    if spec.get("lifeline"):
        check_reach("the launcher", *spec["lifeline"], timeout, addr)
        lifeline = socket.create_connection(tuple(spec["lifeline"]), timeout=10)
        lifeline.settimeout(None)
        _background(watch.run_socket, lifeline)
        watch.lifeline = lifeline           # held open until this process ends
    if role != "scheduler":
        check_reach("the scheduler", env["SSDSGD_SCHEDULER_HOST"],
                    env["SSDSGD_SCHEDULER_PORT"], timeout, addr)
    if role == "worker":
        check_train_command(cmd)
    return env


def run(spec, index, stdin):
    index, role, rank, cmd = choose(spec, index)
    out = Output(index, bool(spec.get("tag")))
    secrets = []
    watch = LauncherWatch(secrets)
    if stdin is not None:
        _background(watch.run_stdin, stdin)
    try:
        if spec.get("cwd"):
            os.chdir(spec["cwd"])
        env = prepare(spec, role, cmd, watch)
        env.update(SSDSGD_ROLE=role, SSDSGD_RANK=str(rank))
        secrets.extend(write_secrets(dict(spec.get("files") or {}), env))   # ssh; removed
        if spec.get("rank_keys"):                                            # mpi, slurm
            shared_key_files(dict(spec["rank_keys"][index]), env)
        child = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, start_new_session=True,
                                 stdout=subprocess.PIPE if out.tag else None,
                                 stderr=subprocess.PIPE if out.tag else None,
                                 preexec_fn=die_with_parent())
    except (EntryError, OSError, ValueError, KeyError) as e:
        _remove(secrets)
        out.line("e", f"ssdsgd: {role} {rank}: {e}")
        out.end(CHECK_FAILED)
        return CHECK_FAILED
    try:
        return _supervise(child, out, watch)
    finally:
        _remove(secrets)


def _remove(paths):
    for path in paths:
        try:
            os.unlink(path)
        except OSError:
            pass


def _supervise(child, out, watch):
    sup = Supervisor(child)
    pumps = [_background(_pump, child.stdout, "o", out),
             _background(_pump, child.stderr, "e", out)] if out.tag else []
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda s, _f: sup.terminate(signal.SIGTERM))
    watch.attach(sup)
    code = sup.wait()
    for t in pumps:
        t.join(timeout=5)
    code = 128 - code if code < 0 else code
    out.end(code)
    return code


def main(argv=None):
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        spec, index = read_spec(args, sys.stdin)
    except (EntryError, ValueError) as e:
        print(f"ssdsgd: rank_entry on {here()}: {e}", file=sys.stderr, flush=True)
        return CHECK_FAILED
    return run(spec, index, sys.stdin if "--stdin" in args else None)


if __name__ == "__main__":
    sys.exit(main())
