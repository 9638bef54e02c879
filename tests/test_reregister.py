"""The restarted scheduler's rebuild (ssdsgd/kvstore/reregister.py) in process: whom it
waits for, what it refuses, and the barrier a node waits at when the lost scheduler had
released it to the others only. The jobs are in tests/test_scheduler_restart.py."""
import shutil

import pytest

from ssdsgd.kvstore.reregister import Rebuild, RejoinError, SetUpLost

COUNTS = {"server": 2, "worker": 3}


def rebuild(**prior):
    return Rebuild({"started": True, "workers": [0, 1, 2], "finished": [], **prior},
                   COUNTS, restart=1, now=0.0, wait_s=30.0)


def node(role, rank, **meta):
    return dict(role=role, rank=rank, ready=True, **meta)


def test_it_waits_for_every_server_and_every_worker_that_neither_finished_nor_left():
    r = rebuild(finished=[2], left=[1])
    assert r.missing() == [("server", 0), ("server", 1), ("worker", 0)]
    for ident, (role, rank) in enumerate(r.missing()):
        assert r.take(ident, node(role, rank), f"{role} {rank}") == (role, rank, False)
    assert r.complete()
    # a finished worker still waiting for its FINISH's answer may come back, as finished
    assert r.take(9, node("worker", 2), "worker 2") == ("worker", 2, True)
    assert r.deadline == 30.0


def test_it_refuses_a_wrong_key_a_second_rejoin_a_worker_that_left_and_a_set_up_not_done():
    r = rebuild(left=[2])
    with pytest.raises(RejoinError, match="worker 0's key cannot act as worker 1"):
        r.take(1, node("worker", 1), "worker 0")
    r.take(1, node("worker", 1), "worker 1")
    with pytest.raises(RejoinError, match="worker 1 has rejoined already"):
        r.take(2, node("worker", 1), "worker 1")
    with pytest.raises(RejoinError, match="worker 2 left the job"):
        r.take(3, node("worker", 2), "worker 2")
    with pytest.raises(RejoinError, match="names no worker rank"):
        r.take(4, node("worker", 3), None)
    with pytest.raises(SetUpLost, match="lost during the job's set-up: worker 0 had not "
                                        "heard where the servers listen"):
        r.take(5, dict(node("worker", 0), ready=False), "worker 0")


def test_a_node_that_missed_a_release_is_released_alone_and_the_others_wait_together():
    """The lost scheduler released barrier 3 of the workers, and worker 2's release was
    lost with it: workers 0 and 1 wait at barrier 4, worker 2 still at 3."""
    r = rebuild()
    r.take("w0", node("worker", 0, passed={"worker": [4, 7]}), None)
    r.take("w1", node("worker", 1, passed={"worker": [4, 7]}), None)
    r.take("w2", node("worker", 2, passed={"worker": [3, 5]}), None)
    assert r.behind("w0", "worker") is None       # ahead: it waits with the others
    assert r.behind("w2", "worker") == 7          # behind: released with their value
    assert r.behind("w2", "worker") is None       # once: its next barrier is theirs
    assert r.behind("w1", "worker") is None


def test_nodes_at_the_same_barrier_wait_together():
    r = rebuild()
    for rank in range(3):
        r.take(rank, node("worker", rank, passed={"worker": [2, 0]}), None)
    assert [r.behind(rank, "worker") for rank in range(3)] == [None] * 3
    fresh = rebuild()        # none passed a barrier yet (the set-up barrier)
    fresh.take(0, node("worker", 0), None)
    assert fresh.behind(0, "worker") is None


def test_mpi_refuses_scheduler_restarts_in_one_line_before_starting_anything(tmp_path):
    """mpirun starts every rank with one command and ends them all when one dies: the
    launcher refuses the setting (exit 2) before it runs mpirun, and removes the keys."""
    from ssdsgd.launch.hosts import parse_hosts
    from ssdsgd.launch.job import run_job
    from ssdsgd.launch.mpi import MPILauncher
    from ssdsgd.launch.remote import Options

    if shutil.which("mpirun") is None:
        pytest.skip("mpirun is not installed (Debian: openmpi-bin)")
    lines = []
    launcher = MPILauncher(parse_hosts("127.0.0.1:4"), 1, 1, Options(launcher="mpi"))
    code = run_job(1, 1, ["true"], {"SSDSGD_SCHEDULER_RESTARTS": "1"}, launcher=launcher,
                   log=lines.append, run_dir=str(tmp_path))
    assert code == 2 and launcher.popen is None
    assert lines == ["cluster.scheduler_restarts=1: mpirun and srun start every rank with "
                     "one command and end them all when one dies, so a scheduler cannot "
                     "be restarted alone; use --launcher local or ssh"]
    assert [p.name for p in tmp_path.iterdir()] == []      # the key directory is gone
    launcher.listener.close()


def test_a_node_that_registers_anew_had_not_received_its_rank_so_the_set_up_was_lost():
    """Lost after it recorded the job's start but before a node got its rank, the
    scheduler's successor hears that node's REGISTER again (it never had a rank to
    rejoin with): that is the set-up lost, named as such, not a stray REGISTER (a CI
    run failed the job with "none registers anew" instead)."""
    r = rebuild()
    with pytest.raises(SetUpLost, match="lost during the job's set-up: server 0 had not "
                                        "received its rank"):
        r.registered_again({"role": "server", "rank": 0})
    with pytest.raises(SetUpLost, match="set-up: a worker had not received its rank"):
        r.registered_again({"role": "worker", "rank": -1})
    r.done = True         # once rebuilt, a REGISTER is a stray's: no verdict on the set-up
    assert r.registered_again({"role": "worker", "rank": 1}) is None


def test_a_worker_that_joined_is_expected_back_and_waits_with_the_others():
    """A job that takes joiners (docs/spec/membership.md): the lost scheduler recorded
    worker 3's join, so it is expected back with a rank above the first workers; it
    passed only the barriers after its join, so its fewer releases do not mean it
    missed one."""
    r = rebuild(membership={"joined": [[3, 6]], "departed": [], "agreed": {},
                            "deciding": [], "layout": None, "listen": None})
    assert ("worker", 3) in r.missing()
    with pytest.raises(RejoinError, match="names no worker rank"):
        r.take("w4", node("worker", 4), None)
    for rank in range(4):
        r.take(f"w{rank}", node("worker", rank, passed={"worker": [1 if rank == 3 else 4,
                                                                  7]}), None)
    assert r.behind("w3", "worker") is None


def test_a_node_the_launcher_saw_die_while_it_waits_is_no_longer_waited_for():
    r = Rebuild({"started": True, "workers": [0, 1, 2], "finished": []}, COUNTS, restart=1,
                now=0.0, wait_s=30.0, lost=[1])
    assert ("server", 1) not in r.missing() and r.lost == [1]
    r.take(0, node("server", 0), "server 0")
    assert r.lose([0, 1, 5]) == ([], [])  # back already, named before, not a server's rank
    r2 = rebuild(finished=[2])
    r2.take(0, node("worker", 0), "worker 0")
    r2.take(3, node("server", 1), "server 1")
    assert r2.missing() == [("server", 0), ("worker", 1)]
    # rank 0 never leaves; worker 2 finished; worker 1 is gone, server 0 lost
    assert r2.lose([0], [0, 1, 2]) == ([0], [1]) and r2.complete()
    assert r2.lost == [0] and r2.gone == {1}
    assert r2.lose([0], [1]) == ([], [])  # told once
    with pytest.raises(RejoinError, match="server 0 was seen dead by its launcher"):
        r2.take(4, node("server", 0), "server 0")
