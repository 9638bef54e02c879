"""The policies' own messages (ssdsgd/sync/events.py) and the scheduler's policies
(ssdsgd/sync/scheduler_policies.py), in process: what the transport hands over unread is
checked by the policy that takes it, and the scheduler's parts decide the messages a
quorum and preduce need."""
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from ssdsgd.sync import events
from ssdsgd.sync.averaging import GroupAverages
from ssdsgd.sync.dense import DenseSync
from ssdsgd.sync.policy import PolicyError
from ssdsgd.sync.quorum import QuorumRounds
from ssdsgd.sync.scheduler_policies import FormGroups, RelayRounds, make_scheduler_policy

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("payload, hop, text", [
    ({"event": "nope"}, None, "unknown policy event 'nope'"),
    ({"event": 3}, None, "unknown policy event 3"),
    ({}, None, "unknown policy event None"),
    ({"event": "ready", "final": 1}, None, "field 'final' must be true or false, got 1"),
    ({"event": "ready", "extra": 1}, None, "unexpected field 'extra'"),
    ({"event": "group", "group": 1}, None, "field 'members' is missing"),
    ({"event": "group", "group": 1, "members": [2, 1]}, None, "increasing list"),
    ({"event": "round", "log": "x" * (events.MAX_LOG + 1)}, None, "a string of round"),
    ({"event": "pause"}, ("worker", "scheduler"), "does not go from a worker to a scheduler"),
    ({"event": "round", "log": "c"}, ("worker", "scheduler"), "does not go from a worker"),
])
def test_a_bad_event_is_refused_naming_the_field(payload, hop, text):
    with pytest.raises(PolicyError, match=re.escape(text)):
        events.read(payload, hop)


def test_a_good_event_reads_back_and_a_sender_cannot_build_a_bad_one():
    payload = events.message("group", group=4, members=[0, 2])
    assert events.read(payload, ("scheduler", "worker")) == ("group", {"group": 4,
                                                                      "members": [0, 2]})
    with pytest.raises(PolicyError, match="members"):
        events.message("group", group=4, members=[])


def test_request_options_are_checked_before_the_policy_sees_them():
    p = DenseSync(2, 3, "ssd")
    p.declare(0)
    with pytest.raises(PolicyError, match="PUSH's policy options: unexpected field 'final'"):
        p.request("push", 0, [(0, 0, np.ones(2))], None, {"final": True})
    with pytest.raises(PolicyError, match="field 'final' must be true or false"):
        p.request("pull", 0, [(0, -1)], "T", {"final": "yes"})
    assert p.request("push", 0, [(0, 0, np.ones(2))], None, {}) == []


def quorum(leader=True):
    return QuorumRounds(2, 4, "ssd", quorum=1, max_staleness=3, leader=leader, replicate=True)


def test_a_workers_policy_message_reaches_its_event():
    q = quorum()
    assert q.on_event(1, {"event": "pause"}, [], "P") == [("answer", "P", None)]
    with pytest.raises(PolicyError, match="a barrier's pause names keys"):
        q.on_event(1, {"event": "pause"}, [(0, None)], "P")
    with pytest.raises(PolicyError, match="does not go from a worker to a server"):
        q.on_event(1, {"event": "round", "log": "c0.1"}, [], "P")
    p = DenseSync(2, 3, "preduce", averaging=GroupAverages(2))
    payload = {"event": "average", "group": 0, "members": [0, 1]}
    assert p.on_event(1, payload, [(9, np.float32([1]))], "T1") == []
    with pytest.raises(PolicyError, match="carries the weights of every key"):
        p.on_event(0, payload, [(9, None)], "T0")
    acts = p.on_event(0, payload, [(9, np.float32([3]))], "T0")
    assert [a[:4] for a in acts] == [("fill", "T1", 0, 0), ("fill", "T0", 0, 0)]
    assert acts[0][4].tolist() == [2.0]


def test_the_leaders_decisions_travel_as_round_events_and_the_follower_replays_them():
    leader, follower = quorum(), quorum(leader=False)
    for p in (leader, follower):
        p.declare(0)
    acts_l = leader.push(0, [(0, 0, np.ones(2))], token=(0,))
    acts_f = follower.push(0, [(0, 0, np.ones(2))], token=(0,))
    (payload,) = leader.to_servers()
    assert payload["event"] == "round" and leader.to_servers() == []
    replayed = follower.from_servers(payload)
    assert acts_f == [] and acts_l and len(replayed) == len(acts_l)
    assert same(replayed, acts_l)
    with pytest.raises(PolicyError, match="does not go from a scheduler to a server"):
        follower.from_servers({"event": "pause"})


def same(a, b):
    """Equal actions: the same structure, arrays of the same values."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.array_equal(a, b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return a == b


def test_the_scheduler_relays_only_server_0s_rounds_and_only_with_several_servers():
    relay = make_scheduler_policy(env(quorum="1", num_servers=2))
    payload = events.message("round", log="c0.1", first=0)
    assert relay.on_event("server", 0, payload) == [("servers", 0, payload)]
    with pytest.raises(PolicyError, match="only server 0 decides quorum rounds"):
        relay.on_event("server", 1, payload)
    with pytest.raises(PolicyError, match="'ready' from a worker: this job"):
        relay.on_event("worker", 0, events.message("ready"))
    for one in (env(quorum="1", num_servers=1), env(quorum="all")):
        with pytest.raises(PolicyError, match="'round' from a server: this job"):
            make_scheduler_policy(one).on_event("server", 0, payload)
    assert [type(p) for p in relay.parts] == [RelayRounds]


def test_the_scheduler_forms_preduce_groups_of_the_ready_workers():
    policy = make_scheduler_policy(env(algorithm="preduce", num_workers=3, group_size=2))
    assert [type(p) for p in policy.parts] == [FormGroups]
    assert policy.on_event("worker", 2, events.message("ready")) == []
    (action,) = policy.on_event("worker", 0, events.message("ready", final=False))
    assert action == ("workers", [0, 2], {"event": "group", "group": 0, "members": [0, 2],
                                          "repeat": False, "final": False})
    # a worker at a barrier is away: the ready one does not wait for it
    assert policy.on_event("worker", 0, events.message("ready")) == []
    assert policy.at_barrier(1) == []          # worker 2 is still active: 0 waits for it
    (action,) = policy.at_barrier(2)           # now 0 is the only active worker
    assert action == ("workers", [0], {"event": "group", "group": 1, "members": [0],
                                       "repeat": False, "final": False})
    with pytest.raises(PolicyError, match="worker 1 reported ready while waiting at a barrier"):
        policy.on_event("worker", 1, events.message("ready"))
    policy.barrier_released()
    assert policy.on_event("worker", 0, events.message("ready")) == []
    with pytest.raises(PolicyError, match="worker 0 reported ready twice"):
        policy.on_event("worker", 0, events.message("ready"))
    with pytest.raises(PolicyError, match="'group' does not go from a worker"):
        policy.on_event("worker", 1, events.message("group", group=0, members=[0, 1]))


def env(**kw):
    values = dict(algorithm="ssd", num_workers=4, num_servers=2, quorum="all", group_size=2)
    return SimpleNamespace(**dict(values, **kw))


def test_the_clients_event_names_are_the_policies():
    """The transport's worker side names the events it sends; they must be the ones the
    policies take (a misspelt one would be refused at run time, by every server)."""
    source = (ROOT / "ssdsgd" / "kvstore" / "client.py").read_text()
    sent = set(re.findall(r'"event": "(\w+)"', source))
    options = set(re.findall(r'"policy": \{"(\w+)"', source))
    assert sent == {"pause", "ready", "average"} and sent <= set(events.EVENTS)
    assert options == {"latest", "final"}
    assert options <= {name for table in events.OPTIONS.values() for name in table}
