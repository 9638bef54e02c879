"""Host lists, placement and the other pure parts of the multi-host launchers, in process."""
import os
import signal
import sys

import pytest

from ssdsgd.launch import addresses, rank_entry, remote
from ssdsgd.launch.hosts import (Host, HostError, describe, oversubscribed, parse_hostfile,
                                 parse_hosts, place, read_hostfile, slot_order)

# how long rank_entry takes to exit once its launcher's lifeline closes, at most
LIFELINE_REACTION_S = 5.0


def test_hostfile_takes_dmlc_and_horovod_lines():
    text = """
# dmlc-tracker style
node1
node2:2222
# Horovod / OpenMPI style
node3 slots=4
10.0.0.4:22 slots=2 max_slots=8   # both at once; max_slots is OpenMPI's and ignored
"""
    assert parse_hostfile(text) == [Host("node1"), Host("node2", 1, 2222), Host("node3", 4),
                                    Host("10.0.0.4", 2, 22)]


@pytest.mark.parametrize("text, message", [
    ("", "hostfile: no hosts"),
    ("# only a comment\n\n", "hostfile: no hosts"),
    ("node1 slots=0", "hostfile:1: slots must be an integer >= 1, got '0'"),
    ("node1 slots=two", "hostfile:1: slots must be an integer >= 1, got 'two'"),
    ("a\nnode1:ssh", "hostfile:2: the ssh port (host:port) must be an integer >= 1"),
    ("node1:70000", "hostfile:1: ssh port 70000 is not a TCP port"),
    ("node1 cpus=2", "hostfile:1: unknown key 'cpus' (expected slots=N)"),
    ("node1 4", "hostfile:1: expected 'host[:port]' or 'host slots=N', got 'node1 4'"),
    ("no/de", "hostfile:1: 'no/de' is not a host name or IPv4 address"),
    ("-oProxyCommand=x", "is not a host name"),
    ("node1\nnode1 slots=2", "hostfile: host node1 is listed twice (give it slots=N)"),
])
def test_hostfile_errors_are_one_line_naming_the_line(text, message):
    with pytest.raises(HostError) as e:
        parse_hostfile(text)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_hostfile_read_names_the_file(tmp_path):
    f = tmp_path / "hosts"
    f.write_text("a slots=2\nb\n")
    assert read_hostfile(f) == [Host("a", 2), Host("b")]
    with pytest.raises(HostError, match=r"hostfile .*missing: cannot read it \(No such file"):
        read_hostfile(tmp_path / "missing")
    f.write_text("a\nb slots=x\n")
    with pytest.raises(HostError, match=rf"^{f}:2: slots must be"):
        read_hostfile(f)


def test_host_list_is_horovods_host_colon_slots():
    assert parse_hosts("h1:2,h2:2") == [Host("h1", 2), Host("h2", 2)]
    assert parse_hosts(["h1", "h2:3"], "cluster.hosts") == [Host("h1"), Host("h2", 3)]
    with pytest.raises(HostError, match=r"^--hosts: slots of h2 must be an integer >= 1"):
        parse_hosts("h1:2,h2:0")
    with pytest.raises(HostError, match=r"^cluster.hosts: empty host name"):
        parse_hosts(["h1", ""], "cluster.hosts")


def test_slots_are_taken_round_robin_over_the_hosts():
    hosts = [Host("a", 2), Host("b", 1), Host("c", 3)]
    assert [h.name for h in slot_order(hosts)] == ["a", "b", "c", "a", "c", "c"]


def where(plan):
    return [(s.label, s.host) for s in plan]


def test_placement_scheduler_here_then_servers_then_workers():
    hosts = [Host("a"), Host("b"), Host("c")]
    assert where(place(hosts, 2, 1)) == [("scheduler", ""), ("server 0", "a"),
                                         ("worker 0", "b"), ("worker 1", "c")]
    # two slots each: servers spread over the hosts first, then the workers
    hosts = [Host("a", 2), Host("b", 2)]
    assert where(place(hosts, 2, 2)) == [("scheduler", ""), ("server 0", "a"),
                                         ("server 1", "b"), ("worker 0", "a"),
                                         ("worker 1", "b")]
    # more processes than slots: round and round again (and it is said)
    hosts = [Host("a"), Host("b", 1, 2222)]
    plan = place(hosts, 4, 1, scheduler="b")
    assert where(plan) == [("scheduler", "b"), ("server 0", "a"), ("worker 0", "b"),
                           ("worker 1", "a"), ("worker 2", "b"), ("worker 3", "a")]
    assert plan[0].port == 2222 and plan[2].port == 2222 and plan[1].port is None
    assert oversubscribed(hosts, 4, 1) == 3 and oversubscribed(hosts, 1, 1) == 1
    with pytest.raises(HostError):
        place(hosts, 0, 1)


def test_placement_is_printed_one_line_per_host():
    plan = place([Host("a", 2), Host("b")], 3, 1)     # 4 processes on 3 slots: a, b, a, a
    assert describe(plan, "10.1.1.1") == ["10.1.1.1 (the launcher's host): scheduler",
                                          "a: server 0, worker 1, worker 2", "b: worker 0"]


def test_the_environment_that_travels():
    env = {"SSDSGD_NUM_WORKERS": "2", "MXNET_ENGINE_TYPE": "NaiveEngine", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": "/code", "LD_LIBRARY_PATH": "/lib", "HOME": "/root", "MINE": "1",
           "TERM": "xterm"}
    out = remote.forwarded(env, extra_keys=("MINE",))
    assert set(out) == {"SSDSGD_NUM_WORKERS", "MXNET_ENGINE_TYPE", "OMP_NUM_THREADS",
                        "PYTHONPATH", "LD_LIBRARY_PATH", "MINE"} | (
        {"HOME"} if remote.os.environ.get("HOME") != "/root" else set()) | (
        {"TERM"} if remote.os.environ.get("TERM") != "xterm" else set())
    cmd = [sys.executable, "-m", "ssdsgd.node"]
    assert remote.replace_python(cmd, "/opt/py/bin/python") == ["/opt/py/bin/python", "-m",
                                                                "ssdsgd.node"]
    assert remote.replace_python(cmd, None) == cmd


def test_addresses_of_this_host():
    assert addresses.interface_address("lo") == "127.0.0.1"
    with pytest.raises(addresses.AddressError, match=r"interface 'nosuch0': .*interfaces here: "
                       r".*\blo\b"):
        addresses.interface_address("nosuch0")
    assert addresses.route_source("127.0.0.1") == "127.0.0.1"
    assert addresses.advertised("localhost") == "127.0.0.1"
    assert addresses.is_local("127.0.0.1") and addresses.is_local("localhost")
    assert not addresses.is_local("192.0.2.1")        # TEST-NET-1: never this host's
    assert addresses.wait_reachable("127.0.0.1", 9, timeout=0.3, refused_timeout=0.5)


def test_rank_entry_picks_its_process_and_checks_a_train_command(tmp_path, monkeypatch):
    spec = {"procs": [["scheduler", 0, ["x"]], ["server", 0, ["y"]],
                      ["worker", 1, ["z"], "node7"]]}
    assert rank_entry.choose(spec, 2) == (2, "worker", 1, ["z"])
    assert rank_entry.here() == "node7"
    with pytest.raises(rank_entry.EntryError, match="rank 3 is outside the job's 3 processes"):
        rank_entry.choose(spec, 3)
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "1")
    monkeypatch.setenv("SSDSGD_LAUNCH_SPEC", '{"procs": []}')
    assert rank_entry.read_spec(["--rank-from", "OMPI_COMM_WORLD_RANK"], None) == (
        {"procs": []}, 1)
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "")
    with pytest.raises(rank_entry.EntryError, match="OMPI_COMM_WORLD_RANK: the variable is ''"):
        rank_entry.read_spec(["--rank-from", "OMPI_COMM_WORLD_RANK"], None)
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(f"data: {{path: {tmp_path / 'nodata'}}}\n")
    cmd = ["py", "-m", "ssdsgd.train", str(run / "config.yaml"), "--run-dir", str(run)]
    with pytest.raises(rank_entry.EntryError, match=rf"^host node7: data.path {tmp_path}/nodata "
                       "does not exist on this host"):
        rank_entry.check_train_command(cmd)
    (tmp_path / "nodata").mkdir()
    rank_entry.check_train_command(cmd)
    with pytest.raises(rank_entry.EntryError, match=r"^host node7 does not see the run "
                       rf"directory {tmp_path}/other; it must be on a filesystem every host"):
        rank_entry.check_train_command(cmd[:-1] + [str(tmp_path / "other")])
    rank_entry.check_train_command(["python", "my_train.py"])      # not ours: no check
    rank_entry.HOST["label"] = None


def test_the_remote_exit_code_of_a_signal_is_the_signal():
    class P:
        def __init__(self, code):
            self.code = code

        def poll(self):
            return self.code
    from ssdsgd.launch.ssh import RemoteProcess
    assert RemoteProcess("worker", 0, P(128 + signal.SIGKILL)).poll() == -signal.SIGKILL
    assert RemoteProcess("worker", 0, P(2)).poll() == 2
    assert RemoteProcess("worker", 0, P(255)).poll() == 255


def test_slurm_tasks_per_node_and_no_allocation():
    from ssdsgd.launch.slurm import allocation_hosts, expand_counts
    assert expand_counts("2(x3),1") == [2, 2, 2, 1]
    assert expand_counts("4") == [4] and expand_counts("") == []
    with pytest.raises(remote.LaunchError, match=r"SLURM_TASKS_PER_NODE='2\(3\)': expected"):
        expand_counts("2(3)")
    with pytest.raises(remote.LaunchError, match="--launcher slurm runs inside an allocation"):
        allocation_hosts({})


def test_where_the_hosts_come_from():
    from ssdsgd.launch.launchers import make_launcher
    assert remote.host_list(remote.Options(), "a:2,b") == [Host("a", 2), Host("b")]
    assert remote.host_list(remote.Options(hosts="c:3"), "a:2") == [Host("c", 3)]
    assert remote.host_list(remote.Options()) is None
    with pytest.raises(remote.LaunchError, match="either -H/--hostfile or --hosts, not both"):
        remote.host_list(remote.Options(hostfile="f", hosts="a"))
    with pytest.raises(remote.LaunchError, match="^cluster.hosts: hosts need --launcher ssh"):
        make_launcher(remote.Options(), 2, 1, "a:2,b")
    with pytest.raises(remote.LaunchError, match="^--launcher ssh needs hosts"):
        make_launcher(remote.Options(launcher="ssh"), 2, 1)
    with pytest.raises(remote.LaunchError, match=r"^cluster.hosts: slots of b must be"):
        make_launcher(remote.Options(launcher="ssh"), 2, 1, "a,b:0")


@pytest.mark.system
def test_a_secret_file_reaches_the_process_as_a_0600_file_of_its_host(tmp_path):
    """rank_entry writes the spec's secret files again (mode 0600), gives the process
    their path, and removes them when it ends."""
    check = ("import os, stat, sys; p = os.environ['SSDSGD_SECRET_FILE']; "
             "print(p); assert stat.S_IMODE(os.stat(p).st_mode) == 0o600, oct(os.stat(p).st_mode); "
             "assert open(p).read() == 'the keys'; assert p not in ' '.join(sys.argv)")
    out = tmp_path / "out"
    spec = {"procs": [["scheduler", 0, ["sh", "-c", f"{sys.executable} -c \"{check}\" > {out}"]]],
            "env": {"SSDSGD_SCHEDULER_HOST": "127.0.0.1"}, "files": {"SSDSGD_SECRET_FILE":
                                                                    "the keys"}}
    with pytest.raises(remote.LaunchError, match=r"SSDSGD_SECRET_FILE=.*/k: cannot read it"):
        remote.split_secrets({"SSDSGD_SECRET_FILE": str(tmp_path / "k")})
    (tmp_path / "k").write_text("the keys")
    assert remote.split_secrets({"SSDSGD_SECRET_FILE": str(tmp_path / "k"), "A": "1"}) == (
        {"A": "1"}, {"SSDSGD_SECRET_FILE": "the keys"})
    assert rank_entry.run(spec, 0, None) == 0
    path = out.read_text().strip()
    assert path.startswith(("/dev/shm/ssdsgd-secret-", "/tmp/ssdsgd-secret-"))
    assert not os.path.exists(path)


def test_rank_entry_takes_only_its_users_private_key_file_from_the_shared_filesystem(
        tmp_path):
    """mpi/slurm (issue 28, item 1): the spec carries a key file's path, never its text;
    rank_entry gives the process that path only if it is a regular file of this user with
    no group or other permission, else one line naming the file and why."""
    key = tmp_path / "keys-worker-0.json"
    key.write_text("{}")
    os.chmod(key, 0o600)
    env = {}
    rank_entry.shared_key_files({"SSDSGD_SECRET_FILE": str(key)}, env)
    assert env == {"SSDSGD_SECRET_FILE": str(key)}
    os.chmod(key, 0o640)
    link, folder, theirs = tmp_path / "link", tmp_path / "dir", tmp_path / "theirs"
    link.symlink_to(key)
    folder.mkdir(mode=0o700)
    theirs.write_text("{}")
    os.chmod(theirs, 0o600)
    cases = [(key, "has mode 0640; a key file must be readable by its owner only"),
             (tmp_path / "gone", f"^host {rank_entry.here()} does not see its key file "
                                 ".* must be on a filesystem every host shares"),
             (link, "is not a regular file"), (folder, "is not a regular file")]
    if os.geteuid() == 0:       # a file of another user needs root to make
        os.chown(theirs, 65534, 65534)
        cases.append((theirs, "belongs to uid 65534, not to this user"))
    for path, message in cases:
        with pytest.raises(rank_entry.EntryError, match=message):
            rank_entry.shared_key_files({"SSDSGD_SECRET_FILE": str(path)}, {})
    assert remote.secret_paths({"SSDSGD_SECRET_FILE": str(key), "A": "1"}) == (
        {"A": "1"}, {"SSDSGD_SECRET_FILE": str(key)})


@pytest.mark.system
def test_a_group_rank_is_given_the_key_files_path_and_refuses_a_readable_one(tmp_path):
    """The same through rank_entry.run with a group command's spec (``rank_keys``): the
    process gets the path as it is, and does not start when the file is too readable."""
    key = tmp_path / "keys-scheduler.json"
    key.write_text("the keys")
    os.chmod(key, 0o600)
    out = tmp_path / "out"
    check = "import os; print(os.environ['SSDSGD_SECRET_FILE'])"
    spec = {"procs": [["scheduler", 0, ["sh", "-c", f"{sys.executable} -c \"{check}\" > {out}"]]],
            "env": {"SSDSGD_SCHEDULER_HOST": "127.0.0.1"},
            "rank_keys": [{"SSDSGD_SECRET_FILE": str(key)}]}
    assert rank_entry.run(spec, 0, None) == 0
    assert out.read_text().strip() == str(key) and key.exists()
    os.chmod(key, 0o644)
    out.unlink()
    assert rank_entry.run(spec, 0, None) == rank_entry.CHECK_FAILED
    assert not out.exists()


def _refusing_port():
    """A bound, never listening socket: connecting to its port is refused while it lives."""
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    return s, s.getsockname()[1]


def _waiting_entry(refusing_port, extra_env=None, args=("--stdin",), spec_extra=None):
    """rank_entry.py as a worker whose scheduler port refuses: it waits in its check (up
    to REFUSED_SECONDS) before any child starts."""
    import json
    import subprocess
    spec = {"procs": [["worker", 0, [sys.executable, "-c", "pass"]]],
            "env": {"SSDSGD_SCHEDULER_HOST": "127.0.0.1",
                    "SSDSGD_SCHEDULER_PORT": str(refusing_port)},
            "connect_timeout": 5, **(spec_extra or {})}
    env = dict(os.environ, **(extra_env or {}))
    if "--stdin" not in args:
        env["SSDSGD_LAUNCH_SPEC"] = json.dumps(spec)
    proc = subprocess.Popen([sys.executable, rank_entry.ENTRY_FILE, *args], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    if "--stdin" in args:
        proc.stdin.write(json.dumps(spec) + "\n")
        proc.stdin.flush()
    return proc


@pytest.mark.system
@pytest.mark.parametrize("stop", ["eof", "signal line"])
def test_a_stop_while_the_scheduler_check_waits_ends_the_process_at_once(stop):
    """Issue 9's race: the launcher stops the job (ssh: EOF on stdin, or a signal line)
    while a process still waits for the scheduler's port, which may refuse for up to
    REFUSED_SECONDS. The process must end at once, not outlive the job by minutes."""
    import time
    sock, port = _refusing_port()
    proc = _waiting_entry(port)
    try:
        time.sleep(1.5)                      # inside the check: the port refuses
        assert proc.poll() is None, proc.stderr.read()
        t0 = time.monotonic()
        if stop == "eof":
            proc.stdin.close()
        else:
            proc.stdin.write("15\n")
            proc.stdin.flush()
        code = proc.wait(timeout=10)
        assert time.monotonic() - t0 < 5
        assert code == 128 + signal.SIGTERM
    finally:
        sock.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
            pytest.fail("rank_entry still ran 10 s after the launcher's stop")
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            pipe.close()


@pytest.mark.system
def test_a_lost_lifeline_while_the_scheduler_check_waits_ends_the_process_at_once():
    """The same race for mpi/slurm, which have no stdin to watch: the process holds its
    lifeline to the launcher from before the checks, and its closing (the launcher died,
    even by SIGKILL) ends the process while it still waits for the scheduler."""
    import socket
    import time
    sock, port = _refusing_port()
    launcher = socket.create_server(("127.0.0.1", 0))
    launcher.settimeout(10)
    proc = _waiting_entry(port, {"MYRANK": "0"}, ("--rank-from", "MYRANK"),
                          {"lifeline": list(launcher.getsockname()[:2])})
    try:
        held = []
        deadline = time.monotonic() + 10
        while not held and time.monotonic() < deadline:
            try:
                conn, _ = launcher.accept()      # a check's probe connects and closes;
                conn.settimeout(1.0)             # the lifeline is the one that stays open
                try:
                    if conn.recv(1) == b"":
                        conn.close()
                        continue
                except socket.timeout:
                    held.append(conn)
            except socket.timeout:
                break
        assert held, "rank_entry never held a lifeline to the launcher while checking"
        # held for as long as it takes to exit once the lifeline closes (below): it could
        # have exited in this time, had it not waited for the launcher
        time.sleep(LIFELINE_REACTION_S)
        assert proc.poll() is None, proc.stderr.read()
        t0 = time.monotonic()
        held[0].close()
        launcher.close()
        code = proc.wait(timeout=10)
        assert time.monotonic() - t0 < LIFELINE_REACTION_S
        assert code == 128 + signal.SIGTERM
    finally:
        sock.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
            pytest.fail("rank_entry still ran 10 s after its lifeline closed")
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            pipe.close()
