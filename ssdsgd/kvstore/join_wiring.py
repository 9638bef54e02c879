"""The scheduler's half of a worker joining a running job, or leaving it
(docs/spec/membership.md): the messages around the pure decider ``joins.Admissions``, as
``_remove_worker`` wires ``removals.Removals``.

A joiner registers (REGISTER, its key's rank, one of the spare ranks
N..max_workers-1 the launcher made keys for) once the job runs. The scheduler refuses it
in one line (``joins.refusal``) or: gives it the topology and where the servers listen,
asks every server to hold (JOIN ``{joined, routing_id}``: the connection id is the
joiner's), and once every server answered (``{joined, next_step}``) tells every server
and the joiner the step it pushes from (``{joined, from_step}``). The old workers hear it
from the servers' replies (their ``policy`` field), in time for that step's batch.

A departure is decided the same way: a connection holding worker R's key (the worker
itself, or ``launch/dist.py --leave RUN_DIR --rank R``) sends LEAVE ``{leaving: R}``;
every server holds and answers, and every server, the leaver and the asker hear
``{leaving, from_step}``: the leaver pushes the steps before it, and ends there as if
its budget were spent; once it finished, barriers no longer wait for it.

A dead worker (``cluster.on_worker_failure: continue``) is dropped by the servers from
the first step they lack (``removals.py``), which no worker heard of in time; its data
then leaves as a departure asked for does, at a step every worker hears of in time
(membership.md rule 10). A joiner that dies while its join is decided is removed once
it joined (the servers already hold for it).
"""
import time

from . import protocol as P
from .joins import Admissions, JoinError, leave_refusal, refusal
from .topology import node_name, record


class Joins:
    """Mixed into ``Scheduler``: ``join_boundary`` (the stage rule's, from the node
    wiring) is None where the job takes no joiner."""

    def _init_joins(self, join_boundary):
        """``join_boundary(held, agreed)``: ``agreed`` the barriers' agreements so far."""
        boundary = join_boundary and (lambda held: join_boundary(held, self.barriers.agreed))
        self.admissions = Admissions(boundary) if join_boundary else None
        self.departures = Admissions(boundary, "leaving") if join_boundary else None
        self.joined = []          # {rank, from_step, time} of every join decided
        self.departed = {}        # rank -> {rank, from_step, time} of every departure decided
        self.leave_askers = {}    # rank -> the connection that asked it to leave
        self.listen_out = None    # what the workers heard from LISTEN: a joiner hears it too
        self.dead_joining = set() # joiners that died while their join was decided
        self.departed_done = set()  # ranks that left and finished their part
        self.lost_decisions = []  # a restarted scheduler's: joins/departures being decided

    def _in_job_at(self, rank, step):
        """Is worker ``rank`` (registered) in the job at ``step``: joined at or before it,
        and not left by then (docs/spec/membership.md rule 1)?"""
        joined = next((j["from_step"] for j in self.joined if j["rank"] == rank), 0)
        left = self.departed.get(rank, {}).get("from_step")
        return joined <= step and (left is None or step < left)

    def _joining(self, role, meta, frame):
        """Is this REGISTER a joiner's: a worker after the start, or one of a spare rank
        (by its key or the rank it asks for) at any time, in a job that takes them? (A
        spare rank early must not take a first worker's place.)"""
        if role != "worker" or (self.env.max_workers or 0) <= self.env.num_workers:
            return False
        who = self.guard.sender(frame)
        spare = (meta.get("rank", -1) >= self.env.num_workers
                 or (who or "").startswith("worker ") and who.split()[1].isdigit()
                 and int(who.split()[1]) >= self.env.num_workers)
        return self.started or spare

    def _join(self, ident, meta, frame):
        """A joiner's REGISTER: refused in one line, or taken and the servers asked."""
        who = self.guard.sender(frame)
        rank = meta.get("rank", -1)
        if who is not None and rank == -1 and who.startswith("worker "):
            rank = int(who.split()[1])
        workers = [n for n in self.nodes.values() if n["role"] == "worker"]
        taken = ({n["rank"] for n in workers} | self.left | {j["rank"] for j in self.joined}
                 | set(self.departed))
        pending = self.admissions.pending if self.admissions else {}
        ever = self.env.num_workers + len(self.joined) + len(pending)   # ranks handed out
        why = refusal(self.env.max_workers, len(workers), ever, self.listen_out is not None,
                      any(n["finished"] for n in workers if n["rank"] not in self.departed))
        if why is None and self.admissions is None:
            why = "this job's algorithm or settings take no joiner"
        if why is None and not self.env.num_workers <= rank < self.env.max_workers:
            why = (f"a joiner takes a spare rank {self.env.num_workers}.."
                   f"{self.env.max_workers - 1} (its key's), not {rank}")
        if why is None and (rank in taken or rank in pending):
            why = f"worker {rank} is or was in the job already (ranks are not reused)"
        if why is None and who is not None and who != f"worker {rank}":
            why = f"a connection holding {who}'s key cannot join as worker {rank}"
        if why is None and not meta.get("routing_id"):
            why = "a worker registers the id of its connections to the servers"
        if why is not None:
            raise P.ProtocolError(f"worker {rank} cannot join: {why}")
        node = record(dict(meta, rank=rank), "worker", who, time.monotonic())
        node["rank"] = rank
        self.nodes[ident] = node
        servers = self._members("server")
        self.admissions.begin(rank, servers)
        layout = dict(self.layout, rank=rank)
        self._send(ident, P.Kind.TOPOLOGY, layout)
        self._send(ident, P.Kind.LISTEN, self.listen_out)
        for i in servers:
            self._send(i, P.Kind.JOIN, {"joined": rank, "routing_id": meta["routing_id"]})
        self.log(f"{node_name(node)} asks to join; the servers hold")
        self._record()

    def _join_answer(self, ident, node, meta):
        """JOIN from a server: the first step it holds from; once every server answered,
        every server and the joiner hear the step the joiner pushes from."""
        if node["role"] != "server" or "next_step" not in meta:
            raise P.ProtocolError(f"JOIN from a {node['role']} that answers no join")
        if self.admissions is None:
            raise P.ProtocolError("JOIN in a job that takes no joiner")
        decision = self._decided(self.admissions, P.Kind.JOIN, ident, meta)
        if decision is not None:
            self._joined(decision)

    def _joined(self, decision):
        rank = decision["joined"]
        self.joined.append({"rank": rank, "from_step": decision["from_step"],
                            "time": time.time()})
        self._record()         # first: a restarted scheduler knows what was said
        workers = len(self._members("worker"))
        self.log(f"worker {rank} joins the job at step {decision['from_step']}; the servers "
                 f"aggregate {workers} workers from then on")
        if rank in self.dead_joining:
            self.dead_joining.discard(rank)
            self._begin_removal(rank)

    def _decided(self, decider, kind, ident, meta):
        """Server ``ident``'s answer to a join or departure ``decider`` (joins.Admissions)
        is deciding; once every server answered, the decision, which every server and
        the worker it is about hear (``kind``), else None."""
        try:
            decision = decider.answer(ident, meta)
        except JoinError as e:
            raise P.ProtocolError(str(e)) from None
        if decision is not None:
            self._announce(kind, decision[decider.field], decision)
        elif decider.answered(meta[decider.field]):
            self.log(f"worker {meta[decider.field]}'s {kind.name.lower()} waits for the "
                     "workers' agreement at the end of the warm-up (its step depends on k)")
        return decision

    def _announce(self, kind, rank, decision):
        """Every server and the worker ``rank`` hear a join's or departure's decision."""
        for i, n in self.nodes.items():
            if n["role"] == "server" or n["rank"] == rank and n["role"] == "worker":
                self._send(i, kind, decision)

    def _decide_waiting(self):
        """After an agreement: the joins and departures whose step waited for it."""
        self._announce_decided(lambda decider: decider.settle())

    def _decide_without(self, server):
        """Server ``server`` died (cluster.server_replicas): the joins and departures that
        waited for its answer are decided by the others' (its backup saw the same pushes
        and holds for the keys it takes)."""
        self._announce_decided(lambda decider: decider.forget(server))

    def _announce_decided(self, decisions):
        """Announce and record what ``decisions(decider)`` decides of joins, then of
        departures."""
        for decider, kind, done in ((self.admissions, P.Kind.JOIN, self._joined),
                                    (self.departures, P.Kind.LEAVE, self._left)):
            for decision in decisions(decider) if decider else ():
                self._announce(kind, decision[decider.field], decision)
                done(decision)

    # ---- departures ---------------------------------------------------------------------
    def _leave(self, ident, meta, frame):
        """LEAVE ``{leaving}`` from a connection holding that worker's key (registered or
        not: ``--leave`` dials with it): refused in one line, or the servers asked."""
        rank = meta["leaving"]
        node = self.nodes.get(ident)
        if node is not None and node["role"] == "server":
            self._leave_answer(ident, meta)
            return
        who = self.guard.sender(frame)
        workers = {n["rank"]: n for n in self.nodes.values() if n["role"] == "worker"}
        if self.departures is None:
            why = ("this job's algorithm or settings take no leaver (only ssgd and ssd "
                   "with cluster.max_workers above the workers)")
        elif who is not None and who != f"worker {rank}":
            why = f"a connection holding {who}'s key cannot make worker {rank} leave"
        elif self.listen_out is None:
            why = "the job has not started yet"
        elif rank in self.admissions.pending:
            why = f"worker {rank} is still joining; ask again once it has joined"
        else:
            why = leave_refusal(rank, {r for r, n in workers.items() if not n["finished"]},
                                set(self.departures.pending) | set(self.departed),
                                any(n["finished"] for r, n in workers.items()
                                    if r not in self.departed), self._choice_pending())
        if why is not None:
            raise P.ProtocolError(f"worker {rank} cannot leave: {why}")
        servers = self._members("server")
        self.departures.begin(rank, servers)
        self.leave_askers[rank] = ident
        for i in servers:
            self._send(i, P.Kind.LEAVE, {"leaving": rank})
        self.log(f"worker {rank} asks to leave; the servers hold")

    def _choice_pending(self, rank=0, asked=True):
        """Why worker ``rank`` may not leave yet in this job's mode (``asked``: a
        departure asked for, else a dead worker's removal), or None (its policy's
        ``not_yet_leaving``: the transport knows no algorithm)."""
        ask = getattr(self.policy, "not_yet_leaving", None)
        return (ask(rank, set(self.barriers.agreed), asked=asked) if ask is not None
                else None)

    def _leave_answer(self, ident, meta):
        """LEAVE from a server: the first step it holds from; once every server answered,
        every server, the leaver and the asker hear the step it pushes no more from."""
        decision = self._decided(self.departures, P.Kind.LEAVE, ident, meta)
        if decision is not None:
            self._left(decision)

    def _left(self, decision):
        rank = decision["leaving"]
        self.departed[rank] = {"rank": rank, "from_step": decision["from_step"],
                               "time": time.time()}
        asker = self.leave_askers.pop(rank, None)
        if asker is not None and asker not in self.nodes:
            self._send(asker, P.Kind.LEAVE, decision)
        self._record()         # first: a restarted scheduler knows what was said
        others = sum(1 for n in self.nodes.values()
                     if n["role"] == "worker" and n["rank"] != rank)
        if rank in self.left:
            self.log(f"worker {rank}'s chunks go to the {others} others from step "
                     f"{decision['from_step']} (it died: the servers aggregate without it "
                     "from the first step they lacked)")
        else:
            self.log(f"worker {rank} leaves the job at step {decision['from_step']}; the "
                     f"servers aggregate {others} workers from then on")

    # ---- a restarted scheduler (cluster.scheduler_restarts) -------------------------------
    def _membership_status(self):
        """What a restarted scheduler needs of the joins (job_status.py), or None in a job
        that takes no joiner: the joins, departures and agreements decided, the ranks
        whose join or departure is being decided, and what a joiner hears."""
        if self.admissions is None:
            return None
        return {"joined": [[j["rank"], j["from_step"]] for j in self.joined],
                "departed": [[r, d["from_step"]] for r, d in sorted(self.departed.items())],
                "agreed": dict(self.barriers.agreed),
                "deciding": sorted(set(self.admissions.pending) | set(self.departures.pending)),
                "layout": self.layout, "listen": self.listen_out}

    def _restore_joins(self, prior):
        """A restarted scheduler takes the lost one's record of the joins; the workers
        that joined are expected back with the others (``reregister.Rebuild``)."""
        record = (prior or {}).get("membership")
        if not record or self.admissions is None:
            return
        now = time.time()
        self.joined = [{"rank": r, "from_step": s, "time": now} for r, s in record["joined"]]
        self.departed = {r: {"rank": r, "from_step": s, "time": now}
                         for r, s in record["departed"]}
        self.barriers.agreed.update(record["agreed"])
        self.layout, self.listen_out = record["layout"], record["listen"]
        self.lost_decisions = list(record["deciding"])

    # ---- a dead worker (cluster.on_worker_failure: continue) ------------------------------
    def _removed_once_joined(self, rank):
        """A dead joiner whose join is still being decided: removed once it joined (True)."""
        if self.admissions is None or rank not in self.admissions.pending:
            return False
        self.dead_joining.add(rank)
        return True

    def _dead_departs(self, rank):
        """The servers dropped dead worker ``rank``: in a job that takes joiners its data
        leaves at a step every worker hears of in time, decided as a departure asked for
        (unless one is already being decided or was)."""
        if self.departures is None or rank in self.departures.pending or rank in self.departed:
            return
        servers = self._members("server")
        self.departures.begin(rank, servers)
        for i in servers:
            self._send(i, P.Kind.LEAVE, {"leaving": rank})
        self.log(f"worker {rank}'s chunks leave with it at a step every worker hears of in "
                 "time; the servers hold")

    def _departed_finish(self, ident, node):
        """A worker that left finished its part: barriers wait for it no more."""
        if node["role"] != "worker" or node["rank"] not in self.departed:
            return
        self.departed_done.add(node["rank"])
        del self.nodes[ident]
        for release in self.barriers.leave(ident, self._barrier_members):
            self._release(*release)
