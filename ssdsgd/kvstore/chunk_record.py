"""Dynamic data and a restarted scheduler: what a worker tells the new scheduler of the
chunks it got, so that the new dealer (``chunks.Dealer.rebuild``) starts where the lost
one stopped and deals again exactly the chunks whose answers the lost one took with it
(docs/spec/dynamic_data.md, rule 8).

The dealer hands out global chunks in order. An answer is lost only while in flight, and
a worker whose answer was lost asks again (its I/O thread re-sends what it waits for).
So the new dealer needs, from every worker: the plan its requests state, the chunks it
received of its last two epochs (a chunk dealt and never received lies in the epoch of
a request still waiting, which no worker is two epochs past), how many it received in
all, the epoch of each of its requests still waiting (a worker keeps a few in flight,
``data.dynamic.CHUNKS_IN_FLIGHT``), and the cursor of a pause it was told of.
"""
from .. import fields as F

MAX_LISTED = 1 << 20        # chunks of two epochs a report may list
MAX_ASKING = 64             # requests in flight a report may list


class ChunkRecord:
    """The chunks one worker received, from its CHUNK requests and their answers (its
    I/O thread feeds it; ``report`` goes in its REJOIN)."""

    def __init__(self):
        self.plan = None          # (per_epoch, budget, start) of its requests
        self.got = {}             # epoch -> [global chunk numbers], its last two epochs
        self.count = 0            # chunks received in all
        self.asking = []          # the epoch of each request waiting for its answer, in order
        self.pause = None         # the cursor of a pause it was told of, until a release

    def asked(self, meta):
        if meta.get("per_epoch") is not None:
            self.plan = [meta["per_epoch"], meta["budget"], meta["start"]]
        self.asking.append(meta["epoch"])

    def answered(self, meta):
        if self.asking:               # the scheduler answers a worker's requests in order
            self.asking.pop(0)
        if meta.get("over") == "pause":
            self.pause = meta.get("at")
        if "chunk" not in meta or self.plan is None:
            return
        epoch = meta["epoch"]
        self.got.setdefault(epoch, []).append(epoch * self.plan[0] + meta["chunk"])
        for old in [e for e in self.got if e < epoch - 1]:
            del self.got[old]
        self.count += 1

    def released(self):
        """A barrier was released: the dealer's pause ends with it (chunks.py)."""
        self.pause = None

    def report(self):
        """The REJOIN field ``chunks`` (None before its first request)."""
        if self.plan is None:
            return None
        return {"plan": self.plan, "got": sorted(g for c in self.got.values() for g in c),
                "count": self.count, "asking": list(self.asking), "pause": self.pause}


def _report(v):
    return (isinstance(v, dict) and set(v) == {"plan", "got", "count", "asking", "pause"}
            and isinstance(v["plan"], list) and len(v["plan"]) == 3
            and all(F.int_in(0, F.MAX_STEP)(x) for x in v["plan"]) and v["plan"][0] >= 1
            and isinstance(v["got"], list) and len(v["got"]) <= MAX_LISTED
            and all(F.int_in(0, F.MAX_STEP)(g) for g in v["got"])
            and F.int_in(0, F.MAX_STEP)(v["count"])
            and isinstance(v["asking"], list) and len(v["asking"]) <= MAX_ASKING
            and all(F.int_in(0, 1 << 31)(e) for e in v["asking"])
            and (v["pause"] is None or F.int_in(0, F.MAX_STEP)(v["pause"])))


REPORT = (_report, "a worker's chunk report {plan, got, count, asking, pause}")
