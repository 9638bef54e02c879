"""Quorum rounds as a server policy (docs/spec/quorum.md): ``rounds.Rounds`` decides which
pushes make round r and when a reply may go; this turns its decisions into the server's
actions -- a round's pushes summed key by key in rank order, one optimizer update, the
replies it releases.

One push is one contribution (the client sends it unchunked, to every server). The lr
schedule counts global batches (pushes / N): a round holds Q <= N pushes. Whom a round
waits for is a rule (``quorum_rules``); the leader's rule says each change it decides
(``("say", text)``: server 0 prints it) and its record rides on the final replies
(``("note", token, fields)``: their ``policy`` meta), for the run's summary.
"""
from .policy import PolicyError, ServerPolicy
from .quorum_rules import describe
from .rounds import RoundError, Rounds


class QuorumRounds(ServerPolicy):
    global_batches = True

    def __init__(self, num_workers, steps_ahead, algorithm, averaging=None, *, quorum,
                 max_staleness, leader, replicate):
        """``quorum``: Q, or a rule of ``quorum_rules``."""
        super().__init__(num_workers, steps_ahead, algorithm, averaging)
        self.rounds = Rounds(num_workers, quorum, max_staleness, leader=leader,
                             replicate=replicate, max_queued=steps_ahead + 2)
        self.finals = set()      # the reply tokens of final pulls

    def push(self, rank, items, token, latest=False):
        item = [(key, grad) for key, _, grad in items]
        return self._decided(self.rounds.push, rank, item, token, latest=latest)

    def pull(self, rank, items, token, final=False):
        """A final pull waits for the end of every worker's pushes; any other pull gets
        the newest closed round."""
        if not final:
            return [("answer", token, None)]
        self.finals.add(token)
        try:
            return self._decided(self.rounds.final, rank, token)
        except PolicyError:
            self.finals.discard(token)
            raise

    def pause(self, rank, token):
        """Until its next push the rounds do not wait for it (it cannot push while it
        waits for the others)."""
        return self._decided(self.rounds.pause, rank) + [("answer", token, None)]

    def follow(self, text):
        return self._decided(self.rounds.follow, text)

    def decisions(self):
        if not self.rounds.log:
            return None
        text = " ".join(self.rounds.log)
        self.rounds.log.clear()
        return text

    def _decided(self, event, *args, **kwargs):
        try:
            decided = event(*args, **kwargs)
        except RoundError as e:
            raise PolicyError(str(e)) from None
        actions = [("say", describe(change)) for change in self.rounds.decided]
        self.rounds.decided.clear()
        record = None
        for kind, what in decided:
            if kind == "close":
                actions.append(self._close(what))
                continue
            if what in self.finals:
                self.finals.discard(what)
                if record is None and self.rounds.leader:     # the leader's rule decides
                    record = self.rounds.rule.record()
                if record is not None:
                    actions.append(("note", what, {"quorum_auto": record}))
            actions.append(("answer", what, None))
        return actions

    def _close(self, contributions):
        """Each key's pushes of the round, in rank order; the lr clock counts them all."""
        per_key = {}
        for _, item in contributions:
            for key, grad in item:
                per_key.setdefault(key, []).append(grad)
        return self._apply([(key, grads, None) for key, grads in per_key.items()],
                           pushes=len(contributions))
