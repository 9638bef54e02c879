"""A per-process timeline of spans: what each worker and server was doing, and when.

Horovod's timeline records rank 0 only; a straggler shows up there as waiting, not as the
rank that was late. Here every process records its own spans, cheaply, and
``ssdsgd.timeline_merge`` puts them on one clock (the scheduler's) afterwards
(docs/training.md, "The timeline").

A span is (name, lane, start, end, and at most one argument: a name and a number, such
as ``step`` 12): ``time.perf_counter()`` seconds of this process, a lane (the recording
thread's name unless given). Spans on one lane either nest or follow each other; the
merge checks it.

``RECORDER`` is the process's one recorder, off until ``start``: a hook costs an
attribute check while it is off. Recording a span costs about a microsecond: six
doubles appended to an array (names and lanes as numbers of a table), no lock (one
``array.extend`` is atomic under the GIL), no formatting. Spans go to
``DIR/<role>-<rank>.jsonl``, appended every FLUSH_EVERY spans and at the end, one JSON
object a line:

    {"process": {"role", "rank", "pid", "host", "cap"}}    a process began (a restarted
                                                          job appends a second one)
    {"names": [...]}           the next entries of the segment's table of names
    {"spans": "BASE64"}        little-endian float64, six a span: name, lane (both
                               indexes of the table), start, end, the argument's name
                               (index, -1 for none) and value
    {"offset": s, "rtt": s, "at": t}    the scheduler's clock minus this one's at t, from
                               a heartbeat's round trip (NTP's midpoint); the shortest
                               of each CLOCK_WINDOW is the last of that window
    {"dropped": n}             spans not recorded: the cap was reached

Memory is bounded by FLUSH_EVERY spans, the file by ``cap`` spans a process (MAX_SPANS:
16 MB; the merge of a job's files then takes seconds, not minutes); the spans beyond it
are counted, and the process says once that it reached the cap.
"""
import array
import atexit
import base64
import functools
import json
import os
import socket
import sys
import threading
import time

now = time.perf_counter
MAX_SPANS = 250_000       # a worker records about 5.5 a step: 45,000 steps (6.5 under
                          # dynamic data, its data span: 38,000)
FLUSH_EVERY = 4_096
FIELDS = 6                # doubles a span
PROBES = 8                # round trips measured at once, not one a heartbeat interval
PROBE_S = 0.05            # between those
CLOCK_WINDOW = 60.0       # s: one offset (the shortest round trip's) per window


class Recorder:
    """The spans of one process (see the module's doc). The training thread and the I/O
    thread both record; only ``flush`` and a name seen for the first time take a lock."""

    def __init__(self):
        self.on = False
        self.path = None
        self.cap = MAX_SPANS
        self.last_step_end = None     # where the next compute span starts
        self._step = None             # (t, start) of the step under way
        self._flush_lock = threading.Lock()
        self._exit_hook = False
        self._reset()

    def _reset(self):
        self._buf = array.array("d")
        self._room = 0                    # doubles the buffer takes before a flush
        self._ids, self._names = {}, []   # name -> index, and the table in index order
        self._lanes = {}                  # thread id -> index of its name
        self.flushed = self.dropped = 0   # spans written, spans over the cap
        self._names_written = self._dropped_written = 0
        self.probes = 0                   # round trips measured
        self.rtt = None                   # the shortest of the current window
        self._window = None               # when the current window began (this clock)
        self._offsets = []                # offset lines not written yet

    def start(self, directory, role, rank, cap=MAX_SPANS):
        """Record from now on into ``directory``/<role>-<rank>.jsonl (appended)."""
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, f"{role}-{rank}.jsonl")
        self.cap, self.last_step_end, self._step = cap, None, None
        self._reset()
        self._append([{"process": {"role": role, "rank": rank, "pid": os.getpid(),
                                   "host": socket.gethostname(), "cap": cap}}],
                     fresh_line=True)
        self.on = True
        if not self._exit_hook:
            atexit.register(self.close)
            self._exit_hook = True

    @property
    def count(self):
        """Spans recorded so far."""
        return self.flushed + len(self._buf) // FIELDS

    def span(self, name, start, end=None, lane=None, key=None, value=0):
        """A span that ended at ``end`` (default: now), with the argument key=value."""
        if not self.on:
            return
        if len(self._buf) >= self._room and not self._make_room():
            return
        ids = self._ids
        lane_id = (ids.get(lane) if lane else self._lanes.get(threading.get_ident()))
        if lane_id is None:
            lane_id = self._id(lane or threading.current_thread().name, lane is None)
        name_id = ids.get(name)
        if name_id is None:
            name_id = self._id(name)
        key_id = -1 if key is None else (ids.get(key) if key in ids else self._id(key))
        self._buf.extend((name_id, lane_id, start, now() if end is None else end, key_id,
                          value))

    def _id(self, name, thread=False):
        with self._flush_lock:
            if name not in self._ids:
                self._ids[name] = len(self._names)
                self._names.append(name)
            if thread:
                self._lanes[threading.get_ident()] = self._ids[name]
            return self._ids[name]

    def _make_room(self):
        """The buffer is full: flush it; False (and the span counted) over the cap."""
        if self.count >= self.cap:
            self.dropped += 1
            if self.dropped == 1:
                print(f"ssdsgd timeline: {self.path} reached its cap of {self.cap} spans; "
                      "later spans are counted, not recorded", file=sys.stderr, flush=True)
            return False
        self.flush()
        return True

    def begin_step(self, t):
        """A training step begins (``end_step``: it ended; the training thread's): the span
        ``step`` (step=t), and before it ``compute``, the time since the last step ended
        (forward, backward, data, logging: the training program's)."""
        if self.on:
            self._step = (t, now())
            if self.last_step_end is not None:
                self.span("compute", self.last_step_end, self._step[1], None, "step", t)

    def end_step(self):
        if self.on and self._step is not None:
            end = now()
            self.span("step", self._step[1], end, None, "step", self._step[0])
            self.last_step_end, self._step = end, None

    @property
    def probing(self):
        """Does it want round trips sooner than the heartbeats bring them (the first
        PROBES, so a short job has an offset too)?"""
        return self.on and self.probes < PROBES

    def clock(self, sent, received, reference):
        """A round trip to the reference clock (the scheduler's): sent and received here,
        ``reference`` read there in between. NTP's estimate: the offset at the midpoint,
        off by at most half the round trip; so within each CLOCK_WINDOW the shortest round
        trip's offset is kept (the merge interpolates between windows: clocks of two
        hosts drift apart)."""
        rtt, mid = received - sent, (sent + received) / 2
        if not self.on or rtt < 0:
            return
        self.probes += 1
        if self._window is None or mid - self._window >= CLOCK_WINDOW:
            self._window, self.rtt = mid, None
        if self.rtt is None or rtt < self.rtt:
            self.rtt = rtt
            self._offsets.append({"offset": reference - mid, "rtt": rtt, "at": mid})

    def flush(self):
        """Append what was recorded since the last flush: new names, the spans, better
        offsets, a new count of dropped spans. The spans are taken with two atomic list
        operations (a slice, its deletion), so a span recorded meanwhile stays for the
        next flush."""
        with self._flush_lock:
            n = len(self._buf) - len(self._buf) % FIELDS
            chunk = self._buf[:n]
            del self._buf[:n]
            self.flushed += n // FIELDS
            self._room = min(FLUSH_EVERY, self.cap - self.flushed) * FIELDS
            names, self._names_written = self._names[self._names_written:], len(self._names)
            lines, self._offsets = self._offsets, []
            if names:
                lines.append({"names": names})
            if n:
                if sys.byteorder == "big":
                    chunk.byteswap()
                lines.append({"spans": base64.b64encode(chunk.tobytes()).decode()})
            if self.dropped != self._dropped_written:
                lines.append({"dropped": self.dropped})
                self._dropped_written = self.dropped
            if lines and self.path:
                self._append(lines)

    def close(self):
        """The last flush; nothing is recorded after it."""
        if self.on:
            self.flush()
            self.on = False

    def _append(self, objects, fresh_line=False):
        """``fresh_line``: first end a line a killed process left torn (its segment's last)."""
        try:
            with open(self.path, "ab+") as f:      # (appends go to the end, seek or not)
                size, torn = f.seek(0, os.SEEK_END), False
                if fresh_line and size:
                    f.seek(size - 1)
                    torn = f.read(1) != b"\n"
                f.write(("\n" if torn else "").encode() + "".join(
                    json.dumps(o, separators=(",", ":")) + "\n" for o in objects).encode())
        except OSError as e:       # a timeline must never stop training
            print(f"ssdsgd timeline: cannot write {self.path}: {e}; recording stops",
                  file=sys.stderr, flush=True)
            self.on = False


RECORDER = Recorder()


def start_node(env, role, rank):
    """Start this process's recorder if the job records a timeline (``env``: its
    NodeEnv; the directory is SSDSGD_TIMELINE_DIR, which the launcher of configured jobs
    sets to RUN_DIR/timeline). True if it records."""
    if getattr(env, "timeline", False) and getattr(env, "timeline_dir", None):
        RECORDER.start(env.timeline_dir, role, rank)
    return RECORDER.on


def traced(name):
    """A method recorded as the span ``name`` on each call (while the recorder is on)."""
    def wrap(fn):
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            if not RECORDER.on:
                return fn(*args, **kwargs)
            t0 = now()
            try:
                return fn(*args, **kwargs)
            finally:
                RECORDER.span(name, t0)
        return inner
    return wrap
