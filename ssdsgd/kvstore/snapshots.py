"""A server's copies of its weights as the job goes, so the global model can be tested
off the workers' path (``SSDSGD_SNAPSHOT_DIR``, ``SSDSGD_SNAPSHOT_EVERY``).

Rank 0's weights are the global model only in synchronous steps; in ssd's steps delay
they are its local weights, and a test of them takes rank 0's time. The servers hold the
global model: every ``every`` updates (when every key of this server has been updated
that many times) the server copies its shards, and a thread of its own writes them to
``DIR/server-R-VVVVVVVV.npz`` (V: the update count), with the wall-clock time of the
update (``time.time()``: one clock for every process of one machine) and the pushes
applied so far; at the end ``DIR/server-R-final.npz`` holds the
last weights and counts. Every server closes the same rounds (docs/spec/quorum.md), so
the files of one update count of all servers make one model (``read_model``).

What it costs the server: one copy of its shards per snapshot, on its loop (the
digits model's 70 KB: microseconds); the writing is off the loop. At most QUEUE copies
wait for the writer; a snapshot that finds the queue full is dropped and counted
(``dropped`` in the final file), never waited for. Off unless both variables are set.
"""
import json
import os
import queue
import threading
import time
from pathlib import Path

import numpy as np

QUEUE = 16            # snapshots waiting for the writer at most (each a copy of the shards)
JOIN_S = 30.0         # how long the end waits for the writer to write what is queued


def array_name(key, offset):
    return f"k{int(key)}_o{int(offset)}"


class Snapshots:
    """One server's snapshots (see the module's doc); ``after_apply`` from the apply."""

    def __init__(self, directory, rank, every):
        self.dir, self.rank, self.every = Path(directory), int(rank), int(every)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.taken = -1               # the last update count snapshotted
        self.pushes = 0               # pushes applied (complete updates' contributors)
        self.updates = 0
        self.at = time.time()         # when the last complete update was applied
        self.dropped = 0
        self._queue = queue.Queue(QUEUE)
        self._thread = threading.Thread(target=self._write_all, name="ssdsgd-snapshots",
                                        daemon=True)
        self._thread.start()

    @classmethod
    def from_env(cls, env, rank):
        """The server's snapshots if the job asks for them, else None."""
        if getattr(env, "snapshot_dir", None) and getattr(env, "snapshot_every", 0):
            return cls(env.snapshot_dir, rank, env.snapshot_every)
        return None

    def after_apply(self, shards, contributors):
        """After an apply of ``contributors`` pushes: a snapshot if every shard is at the
        same update count, a new multiple of ``every``."""
        versions = {s.version for s in shards.values()}
        if len(versions) != 1:
            return                    # an update half applied (a step cut into messages)
        version = versions.pop()
        if version == self.updates:
            return
        self.updates, self.at = version, time.time()
        self.pushes += contributors
        if version % self.every == 0 and version > self.taken:
            self.taken = version
            self._enqueue(f"{version:08d}", shards)

    def _enqueue(self, tag, shards):
        arrays = {array_name(s.key, s.offset): np.array(s.weight_view(), copy=True)
                  for s in shards.values()}
        try:
            self._queue.put_nowait((tag, arrays, self._meta()))
        except queue.Full:
            self.dropped += 1

    def _meta(self):
        """The counts and the time of the weights copied now (the last update's)."""
        return {"rank": self.rank, "updates": self.updates, "pushes": self.pushes,
                "time": self.at, "dropped": self.dropped}

    def _write_all(self):
        while True:
            item = self._queue.get()
            if item is None:
                return
            tag, arrays, meta = item
            path = self.dir / f"server-{self.rank}-{tag}.npz"
            tmp = path.with_name(path.name + ".tmp.npz")
            np.savez(tmp, __meta__=np.array(json.dumps(meta)), **arrays)
            os.replace(tmp, path)         # a reader never sees half a file

    def close(self, shards):
        """The last weights and counts (``-final``), once what is queued is written."""
        if shards:
            self._queue.put(("final", {array_name(s.key, s.offset): np.array(
                s.weight_view(), copy=True) for s in shards.values()}, self._meta()))
        self._queue.put(None)
        self._thread.join(JOIN_S)


def read_snapshot(path):
    """(meta, {(key, offset): array}) of one file."""
    with np.load(path, allow_pickle=False) as f:
        meta = json.loads(str(f["__meta__"]))
        arrays = {}
        for name in f.files:
            if name == "__meta__":
                continue
            key, offset = name[1:].split("_o")
            arrays[(int(key), int(offset))] = f[name]
    return meta, arrays


def read_model(directory, num_servers):
    """Every snapshot of every server joined by update count, oldest first: a list of
    (meta, {key: flat array}) where meta's time is the latest server's and ``tag`` is the
    update count (or ``final``). An update count not every server wrote is left out."""
    directory = Path(directory)
    tags = {}
    for path in sorted(directory.glob("server-*-*.npz")):
        if path.name.endswith(".tmp.npz"):
            continue
        _, rank, tag = path.stem.split("-", 2)
        tags.setdefault(tag, {})[int(rank)] = path
    models = []
    for tag in sorted(tags, key=lambda t: (t == "final", t)):
        if len(tags[tag]) != num_servers:
            continue
        parts, metas = {}, []
        for rank in range(num_servers):
            meta, arrays = read_snapshot(tags[tag][rank])
            metas.append(meta)
            for (key, offset), values in arrays.items():
                parts.setdefault(key, []).append((offset, values.ravel()))
        model = {key: np.concatenate([v for _, v in sorted(p, key=lambda x: x[0])])
                 for key, p in parts.items()}
        meta = {"tag": tag, "time": max(m["time"] for m in metas),
                "updates": metas[0]["updates"], "pushes": metas[0]["pushes"],
                "dropped": sum(m["dropped"] for m in metas)}
        models.append((meta, model))
    return models
