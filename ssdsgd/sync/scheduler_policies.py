"""What the scheduler decides for a synchronization mode: events in, messages out.

The scheduler (``kvstore/scheduler.py``) is membership: registration, barriers,
heartbeats. A mode may need more of it -- a quorum's leader decisions relayed to the
other servers, preduce's groups formed from the workers that report ready -- and that is
a policy part here. The scheduler hands each POLICY message to ``on_event`` and sends
what it returns:

* ``("workers", ranks, payload)``: to each of those workers;
* ``("servers", except_rank, payload)``: to every server but that one; a server that
  does not take it ends the job (a lost decision would stall it).

A part's ``on_event(role, rank, name, fields)`` gets the event already checked
(``events.read``); what it sends it builds with ``events.message``.

A part takes the events it names (``takes``: (sender's role, event name)); an event no
part takes is refused, naming the job's algorithm. The node wiring (``ssdsgd.node``)
passes ``make_scheduler_policy`` to the scheduler: the transport names no policy.
"""
from ..settings import quorum_rounds
from . import events
from .events import PolicyError
from .. import fields as F
from .groups import REPORT, GroupError, GroupGenerator


class RelayRounds:
    """Quorum with several servers (docs/spec/quorum.md): server 0 decides the rounds,
    every other server replays its decisions."""
    takes = {("server", "round")}

    def on_event(self, role, rank, name, fields):
        if rank != 0:
            raise PolicyError(f"only server 0 decides quorum rounds, not server {rank}")
        return [("servers", rank, events.message(name, **fields))]

    def at_barrier(self, rank):
        return []

    def barrier_released(self):
        pass

    def rebuild(self, reports):
        """Its decisions are server 0's, sent again by it (decision_log.py)."""
        return None


class FormGroups:
    """preduce (docs/spec/preduce.md): the group generator of the ready workers."""
    takes = {("worker", "ready")}

    def __init__(self, num_workers, group_size):
        self.groups = GroupGenerator(num_workers, min(group_size, num_workers))

    def on_event(self, role, rank, name, fields):
        return self._formed(self.groups.arrive, rank, fields.get("final", False))

    def at_barrier(self, rank):
        """A worker at the barrier reports no ready until it releases, so the ready ones
        must not wait for it (sync/groups.py)."""
        return self._formed(self.groups.wait_at_barrier, rank)

    def barrier_released(self):
        self.groups.barrier_released()

    def rebuild(self, reports):
        """A restarted scheduler: the generator from the workers' group reports."""
        for rank, report in reports.items():
            if report is not None and not REPORT[0](report):
                raise PolicyError(f"worker {rank}'s report of its groups must be "
                                  f"{REPORT[1]}, got {F.short(report)}")
        try:
            return self.groups.rebuild(reports)
        except GroupError as e:
            raise PolicyError(str(e)) from None

    def _formed(self, event, *args):
        try:
            formed = event(*args)
        except GroupError as e:
            raise PolicyError(str(e)) from None
        out = []
        for group in formed:
            payload = group.message()
            events.read(payload)
            out.append(("workers", list(group.to or group.members), payload))
        return out


class SchedulerPolicy:
    """The parts a job's mode needs, each event routed to the part that takes it."""
    Error = PolicyError     # what its refusals raise (the transport imports no policy module)

    def __init__(self, parts, describe, env=None):
        self.parts, self.describe, self.env = parts, describe, env

    def not_yet_leaving(self, rank, agreed, asked=True):
        """Why worker ``rank`` may not leave yet in this job's mode, or None (``agreed``:
        the names of the barriers' agreements reached so far; ``asked``: a departure
        asked for, else a dead worker's removal, cluster.on_worker_failure: continue). In
        ssd with a knob at auto, worker 0 chooses at the end of the warm-up (sync/auto.py)
        and the others take its choice at a barrier; until they agreed, its departure or
        removal would leave nobody to choose (docs/spec/membership.md rule 8)."""
        from .auto import AGREEMENT, is_auto, relay_listens
        env = self.env
        if rank != 0 or env is None or env.algorithm != "ssd" or AGREEMENT in agreed:
            return None
        # the relay at auto is chosen only where one may be (else it is off from the
        # start, and with k pinned no agreement ever comes)
        knobs = [name for name, auto in (("sync.delay_steps", is_auto(env.delay_steps)),
                                          ("sync.pull_relay", relay_listens(env)
                                           and is_auto(env.pull_relay))) if auto]
        if not knobs:
            return None
        return (f"its choice of {' and '.join(knobs)} (auto) at the end of the warm-up is "
                "the job's, and the workers have not agreed on it yet; "
                + ("ask again after the warm-up, or pin them" if asked else
                   "pin them for a job that may lose worker 0 in its warm-up"))

    def on_event(self, role, rank, payload):
        name, fields = events.read(payload, (role, "scheduler"))
        for part in self.parts:
            if (role, name) in part.takes:
                return part.on_event(role, rank, name, fields)
        raise PolicyError(f"the policy event {name!r} from a {role}: this job "
                          f"({self.describe}) has none")

    def at_barrier(self, rank):
        """Worker ``rank`` waits at a barrier that has not released yet."""
        return [action for part in self.parts for action in part.at_barrier(rank)]

    def barrier_released(self):
        for part in self.parts:
            part.barrier_released()

    def rebuild(self, reports):
        """A restarted scheduler's parts from the workers' reports (rank -> their group
        report, or None); what each rebuilt, one line (None: nothing to say)."""
        said = [line for part in self.parts if (line := part.rebuild(reports))]
        return "; ".join(said) or None


def make_scheduler_policy(env):
    """The scheduler's policy for the job ``env`` describes (a NodeEnv)."""
    parts = []
    if quorum_rounds(env.quorum, env.num_workers) and env.num_servers > 1:
        parts.append(RelayRounds())
    if env.algorithm == "preduce":
        parts.append(FormGroups(env.num_workers, env.group_size))
    return SchedulerPolicy(parts, f"algorithm {env.algorithm}, quorum {env.quorum}", env)
