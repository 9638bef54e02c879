"""The scheduler's half of a worker joining a running job (docs/spec/membership.md):
the messages around the pure decider ``joins.Admissions``, as ``_remove_worker`` wires
``removals.Removals``.

A joiner registers (REGISTER, its key's rank, one of the spare ranks
N..max_workers-1 the launcher made keys for) once the job runs. The scheduler refuses it
in one line (``joins.refusal``) or: gives it the topology and where the servers listen,
asks every server to hold (JOIN ``{joined, routing_id}``: the connection id is the
joiner's), and once every server answered (``{joined, next_step}``) tells every server
and the joiner the step it pushes from (``{joined, from_step}``). The old workers hear it
from the servers' replies (their ``policy`` field), in time for that step's batch.
"""
import time

from . import protocol as P
from .joins import Admissions, JoinError, refusal
from .topology import node_name, record


class Joins:
    """Mixed into ``Scheduler``: ``join_boundary`` (the stage rule's, from the node
    wiring) is None where the job takes no joiner."""

    def _init_joins(self, join_boundary):
        self.admissions = Admissions(join_boundary) if join_boundary else None
        self.joined = []          # {rank, from_step, time} of every join decided
        self.listen_out = None    # what the workers heard from LISTEN: a joiner hears it too

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
        taken = {n["rank"] for n in workers} | self.left | {j["rank"] for j in self.joined}
        pending = self.admissions.pending if self.admissions else {}
        ever = self.env.num_workers + len(self.joined) + len(pending)   # ranks handed out
        why = refusal(self.env.max_workers, len(workers), ever, self.listen_out is not None,
                      any(n["finished"] for n in workers))
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
        try:
            decision = self.admissions.answer(ident, meta)
        except JoinError as e:
            raise P.ProtocolError(str(e)) from None
        if decision is None:
            return
        rank = decision["joined"]
        self.joined.append({"rank": rank, "from_step": decision["from_step"],
                            "time": time.time()})
        for i, n in self.nodes.items():
            if n["role"] == "server" or n["rank"] == rank and n["role"] == "worker":
                self._send(i, P.Kind.JOIN, decision)
        workers = len(self._members("worker"))
        self.log(f"worker {rank} joins the job at step {decision['from_step']}; the servers "
                 f"aggregate {workers} workers from then on")
        self._record()
