"""What a parameter server decides, apart from how it moves messages: events in, actions out.

A server policy sees the events of its shard of the keys -- a key declared, a worker's
push, pull, barrier pause, departure, a group's weights to average, the leader's round
decisions -- and returns the actions the transport (``ssdsgd.kvstore.server``) carries
out, in order, the way ``rounds.py`` does:

* ``("apply", [(key, gradients, scale), ...], pushes)``: add up each key's gradients (in
  the order given: rank order) and run the optimizer once for all of them; ``scale`` not
  None: the sum times ``scale`` (the mean gradient of fewer workers, counted as N);
  ``pushes``: pushes this update counts on a global-batch lr clock (quorum rounds).
* ``("answer", token, slot)``: the reply ``token`` gets the key of its ``slot`` as the
  weights are now; ``slot`` None: every key of it (none: an empty reply).
* ``("fill", token, slot, step, value)``: the reply's ``slot`` gets ``value`` (not the
  weights: a group's average), its record stamped ``step``.
* ``("note", token, fields)``: the reply ``token`` carries ``fields`` (a JSON object) as
  its ``policy`` meta (a quorum auto leader's record, on the final replies).
* ``("say", text)``: the server prints ``text`` (a decision the user should see).

Gradients, values and reply tokens are opaque: the policy never reads them (except the
averages it computes). It knows which steps are applied because it is the one that asks
for each application. A request the policy cannot accept raises ``PolicyError`` before
anything changes; the transport answers it with an ERROR naming the problem.
"""
from . import events
from .decision_log import DecisionLog, Followed
from .events import PolicyError


class ServerPolicy:
    """The events every policy takes, with the answers of a policy that has nothing to
    decide about them. A subclass is one synchronization mode."""
    Error = PolicyError      # what its refusals raise (the transport imports no policy module)
    global_batches = False   # the lr schedule counts global batches (pushes / N), not updates

    def __init__(self, num_workers, steps_ahead, algorithm, averaging=None):
        self.n = num_workers
        self.steps_ahead = steps_ahead    # steps past the last applied one a push may be
        self.algorithm = algorithm        # its name, for messages
        self.averaging = averaging        # preduce's group averages, if the job averages
        self.version = {}                 # key -> updates applied, in declaration order
        self.removed = {}                 # rank of a worker that left -> the step it is out from
        self.decided = DecisionLog()      # a leader's round decisions, numbered and kept
        self.followed = Followed()        # a follower's count of the leader's it applied

    # ---- messages, as the transport hands them over -----------------------------------
    def request(self, kind, rank, items, token, options):
        """A worker's PUSH or PULL (``kind``: 'push' or 'pull') with its ``policy``
        options, checked here (the transport does not read them)."""
        return getattr(self, kind)(rank, items, token, **events.options(kind, options))

    def on_event(self, rank, payload, items, token):
        """A worker's POLICY message: ``items`` ``[(key, values or None)]``, the keys it
        names, slot i of ``token`` being item i."""
        name, fields = events.read(payload, ("worker", "server"))
        if name == "pause":
            if items:
                raise PolicyError(f"worker {rank}: a barrier's pause names keys")
            return self.pause(rank, token)
        if any(values is None for _, values in items):
            raise PolicyError("an average carries the weights of every key it names")
        return self.average(rank, fields["group"], tuple(fields["members"]), items, token)

    def from_servers(self, payload):
        """Another server's POLICY message, through the scheduler: the leader's decisions
        not applied yet (one sent again after a scheduler restart is skipped)."""
        _, fields = events.read(payload, ("scheduler", "server"))
        text = self.followed.take(fields["first"], fields["log"])
        return self.follow(text) if text else []

    def to_servers(self):
        """POLICY messages for the other servers (the leader's round decisions)."""
        text = self.decisions()
        if not text:
            return []
        return [events.message("round", log=text, first=self.decided.add(text))]

    def sent_again(self):
        """Every decision kept, for the other servers again (a restarted scheduler has
        every node back: what the lost one had not passed on, and what was decided while
        it was down)."""
        return [events.message("round", log=text, first=first)
                for first, text in self.decided.kept()]

    # ---- events ----------------------------------------------------------------------
    def declare(self, key):
        """A key exists (rank 0's initial values)."""
        self.version.setdefault(key, 0)

    def push(self, rank, items, token, latest=False):
        """Worker ``rank``'s push: items ``[(key, step, gradient)]``, slot i of ``token``
        (a reply wanted, or None) being item i; ``latest``: the reply wants the newest
        weights, not those of the push's step."""
        raise NotImplementedError

    def pull(self, rank, items, token, final=False):
        """Worker ``rank`` pulls: items ``[(key, step)]`` as of ``step``; ``final``: its
        last request, once every push of the job is in."""
        raise NotImplementedError

    def pause(self, rank, token):
        """Worker ``rank`` enters a barrier; ``token`` (no keys) is answered at once."""
        return [("answer", token, None)]

    def has_push(self, rank, key, step):
        """Has this server taken worker ``rank``'s push of ``key`` at ``step``, applied or
        waiting for the others'? (chain replication: a push sent again after a takeover
        is skipped if so, kvstore/chain.py). A policy that keeps no steps: never."""
        return False

    def first_missing(self, rank):
        """A departing worker: the first step this server has not received from it."""
        return min(self.version.values(), default=0)

    def leave(self, rank, from_step):
        """Worker ``rank`` is out of the job from ``from_step`` on."""
        self.removed[rank] = from_step
        return []

    def hold(self, rank):
        """Worker ``rank`` asks to join the job (docs/spec/membership.md): the first step
        this server could admit it from, holding every step from there until ``admit``."""
        raise PolicyError(f"workers cannot join a job whose algorithm is {self.algorithm} "
                          "(only ssgd and ssd with sync.quorum: all take them)")

    def admit(self, rank, from_step):
        """Worker ``rank`` is in the job from ``from_step`` on."""
        raise PolicyError(f"workers cannot join a job whose algorithm is {self.algorithm}")

    def hold_departure(self, rank):
        """Worker ``rank`` asks to leave the job (docs/spec/membership.md): as ``hold``."""
        raise PolicyError(f"workers cannot leave a job whose algorithm is {self.algorithm} "
                          "at a step the others hear of (only ssgd and ssd with "
                          "cluster.max_workers take joiners and leavers)")

    def depart(self, rank, from_step):
        """Worker ``rank`` pushes the steps before ``from_step`` only."""
        raise PolicyError(f"workers cannot leave a job whose algorithm is {self.algorithm}")

    def average(self, rank, group, members, items, token):
        """A member of preduce group ``group`` sends its weights ``[(key, values)]``."""
        if self.averaging is None:
            raise PolicyError(f"an average in a job whose algorithm is {self.algorithm}, "
                              "not preduce")
        return self.averaging.average(rank, group, members, items, token)

    def follow(self, text):
        """Another server's round decisions (only a quorum's follower takes them)."""
        raise PolicyError("received round decisions without a quorum")

    # ---- questions -------------------------------------------------------------------
    def busy(self):
        """(key, step) of a step half aggregated, or None: the optimizer may change only
        between steps."""
        return None

    def decisions(self):
        """Decisions the other servers must replay (the leader's), as text, or None."""
        return None

    # ---- for subclasses --------------------------------------------------------------
    def _apply(self, grads, pushes=0):
        """The apply action for ``grads`` ``[(key, gradients, scale)]``; the keys'
        versions count it."""
        for key, _, _ in grads:
            self.version[key] += 1
        return ("apply", grads, pushes)
