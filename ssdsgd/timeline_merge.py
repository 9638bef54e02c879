"""The job's timeline: every process's spans (``ssdsgd/timeline.py``) on one clock, as a
Chrome trace, a PNG with one lane per rank, and who the others waited for.

    python -m ssdsgd.report RUN_DIR --timeline

reads ``RUN_DIR/timeline/*.jsonl`` and writes ``RUN_DIR/timeline.json`` (Chrome's trace
event format: open it in https://ui.perfetto.dev or chrome://tracing; one process per
node, one thread per lane, a server's ``queue`` spans as async slices, since a worker's
requests overlap there) and ``RUN_DIR/timeline.png``. The launcher of a job with
``train.timeline`` does the same at its end.

The clock is the scheduler's: each process's times are moved by its offset to it, from
the shortest heartbeat round trip of each minute (so the error is at most half of it),
interpolated between minutes; processes on the scheduler's host read its clock already
and stay as they are.

**Who the others waited for.** A worker's ``blocked`` span inside a ``pull`` (a
synchronous step t) or a ``reset`` (the steps-delay stage's wait for the pull of step
t - 1) waits for step s = the parent's ``waits_for``: the servers answer once every
worker has pushed step s. The worker whose ``push`` of step s ended last held it up, so
the blocked time is put to that worker's account. Likewise a worker's n-th ``barrier``
(a checkpoint's, the end of the warm-up's) is put to the account of the worker that
arrived last at its n-th barrier (rank 0 validating, say). Time a worker waited for
itself (it pushed last, and waited for the network and the servers) is on nobody's
account. The slowest rank is the worker with the most time on its account;
``waited_for_slowest_s`` is that time, summed over the other workers. With a quorum,
asgd or preduce a step does not wait for the last push, and the account means less.

**Waiting for data.** Under dynamic data a worker's ``data`` spans are its waits for the
scheduler's chunks (ssdsgd/data/dynamic.py): ``data_wait`` sums them per worker, the
epochs' first chunks (``first`` 1: asked with nothing in flight) apart from the others.
"""
from __future__ import annotations

import base64
import collections
import functools
import json
import math
import os
from pathlib import Path

from ssdsgd.timeline import CLOCK_WINDOW, FIELDS

ROLES = ("worker", "server")
ASYNC_LANES = "queue"          # lanes whose spans may overlap (a server's queue per worker)
COLORS = {"compute": "#c7c7c7", "step": "#e8e8e8", "push": "#1f77b4", "blocked": "#d62728",
          "pull": "#ff7f0e", "reset": "#9467bd", "local_update": "#2ca02c",
          "send": "#17becf", "barrier": "#000000", "apply": "#bcbd22",
          "finish": "#8c564b", "data": "#e377c2"}
MANY_TO_DRAW = 50_000          # the PNG draws the last this many spans (all the run's, or
                               # a window at its end: single steps are not seen in more)
Span = collections.namedtuple("Span", "role rank lane name start end args")


class TimelineError(ValueError):
    pass


def read_file(path) -> list[dict]:
    """The segments of one process's file (one per start of the process: a restarted job
    appends), each {role, rank, pid, host, clock: [(at, offset, rtt)], dropped, spans:
    [(name, lane, start, end, args)]}; a torn last line is skipped."""
    segments = []
    with open(path) as f:
        for line in f:
            try:
                _read_line(json.loads(line), segments)
            except (ValueError, KeyError, IndexError, TypeError):
                continue        # torn by a killed process: the rest still counts
    return segments


def _read_line(obj, segments):
    if "process" in obj:
        segments.append(dict(obj["process"], clock=[], dropped=0, spans=[], names=[]))
    elif not segments:
        return
    elif "names" in obj:
        segments[-1]["names"] += obj["names"]
    elif "spans" in obj:
        segments[-1]["spans"] += _decode(obj["spans"], segments[-1]["names"])
    elif "offset" in obj:
        segments[-1]["clock"].append((obj["at"], obj["offset"], obj["rtt"]))
    elif "dropped" in obj:
        segments[-1]["dropped"] = obj["dropped"]


def _decode(text, names) -> list[tuple]:
    """A spans line's spans (ssdsgd/timeline.py: six little-endian doubles each)."""
    import numpy as np
    rows = np.frombuffer(base64.b64decode(text), dtype="<f8").reshape(-1, FIELDS).tolist()
    return [(names[int(n)], names[int(lane)], start, end,
             None if key < 0 else {names[int(key)]: int(v) if v.is_integer() else v})
            for n, lane, start, end, key, v in rows]


def load(run_dir) -> list[dict]:
    """Every segment of RUN_DIR/timeline/, workers first, by rank."""
    files = sorted((Path(run_dir) / "timeline").glob("*.jsonl"))
    if not files:
        raise TimelineError(f"{run_dir}: no timeline/*.jsonl (was the job run with "
                            "train.timeline: true?)")
    segments = [s for p in files for s in read_file(p)]
    return sorted(segments, key=lambda s: (ROLES.index(s["role"]) if s["role"] in ROLES
                                           else len(ROLES), s["rank"]))


def offsets(clock) -> tuple[list, list]:
    """(times, offsets) to interpolate between: of each CLOCK_WINDOW, the round trip that
    was shortest (its error is at most half of it); ([], []) without any."""
    best = {}
    for at, offset, rtt in clock:
        window = int((at - clock[0][0]) // CLOCK_WINDOW)
        if window not in best or rtt < best[window][2]:
            best[window] = (at, offset, rtt)
    chosen = [best[w] for w in sorted(best)]
    return [c[0] for c in chosen], [c[1] for c in chosen]


def spans_of(segments) -> list[Span]:
    """Every span, on the scheduler's clock: moved by the process's offset, interpolated
    between its windows' (constant before the first and after the last; a process that
    measured none keeps its own clock, and so does one on the scheduler's host, which
    reads the same clock: time.perf_counter is the system's monotonic clock)."""
    import numpy as np
    here = {s["host"] for s in segments if s["role"] == "scheduler"}
    out = []
    for seg in segments:
        ats, offs = offsets(seg["clock"]) if seg["host"] not in here else ([], [])
        rows = seg["spans"]
        if not rows:
            continue
        starts = np.array([r[2] for r in rows], dtype=float)
        ends = np.array([r[3] for r in rows], dtype=float)
        if ats:
            starts, ends = starts + np.interp(starts, ats, offs), ends + np.interp(ends, ats, offs)
        out += [Span(seg["role"], seg["rank"], lane, name, float(s), float(e), args)
                for (name, lane, _, _, args), s, e in zip(rows, starts, ends)]
    return out


def nesting(spans) -> tuple[list, list]:
    """(parent index or None of every span, violations): on every lane but the async
    ones, two spans either nest or follow each other; a violation is (span, the span it
    overlaps without containing it)."""
    parents, bad = [None] * len(spans), []
    lanes = collections.defaultdict(list)
    for i, s in enumerate(spans):
        if not s.lane.startswith(ASYNC_LANES):
            lanes[(s.role, s.rank, s.lane)].append(i)
    for members in lanes.values():
        members.sort(key=lambda i: (spans[i].start, -spans[i].end))
        stack = []
        for i in members:
            while stack and spans[stack[-1]].end <= spans[i].start:
                stack.pop()
            if stack and spans[i].end > spans[stack[-1]].end:
                bad.append((spans[i], spans[stack[-1]]))
            parents[i] = stack[-1] if stack else None
            stack.append(i)
    return parents, bad


def _awaited(spans, parents, i):
    """The step span ``i`` waits for: its nearest ancestor's ``waits_for``, or None."""
    p = parents[i]
    while p is not None:
        if spans[p].args and "waits_for" in spans[p].args:
            return spans[p].args["waits_for"]
        p = parents[p]
    return None


def culprits(spans, parents) -> dict:
    """{index of a worker's waiting span: the worker it waited for} (the module's doc):
    a blocked span's awaited step's last push, a barrier's last worker to arrive."""
    last_push = {}      # step -> (end, rank) of the push that ended last
    barriers = collections.defaultdict(list)       # worker -> its barrier spans, in order
    for i, s in enumerate(spans):
        if s.role == "worker" and s.name == "push" and s.args and "step" in s.args:
            step = s.args["step"]
            if step not in last_push or s.end > last_push[step][0]:
                last_push[step] = (s.end, s.rank)
        elif s.role == "worker" and s.name == "barrier":
            barriers[s.rank].append(i)
    out = {}
    for i, s in enumerate(spans):
        if s.role == "worker" and s.name == "blocked":
            step = _awaited(spans, parents, i)
            if step in last_push:
                out[i] = last_push[step][1]
    for nth in zip(*(sorted(b, key=lambda i: spans[i].start) for b in barriers.values())):
        last = max(nth, key=lambda i: spans[i].start)       # the n-th barrier of each
        out.update({i: spans[last].rank for i in nth})
    return out


def slowest(spans, parents) -> dict:
    """Who the others waited for (the module's doc): {slowest_rank, waited_for_slowest_s,
    waited_for: {rank: seconds others waited for it}, waiting: {rank: seconds it spent
    in blocked and barrier spans}}; the slowest rank is None without workers, and the
    one that computed longest when nobody waited for anyone."""
    workers = sorted({s.rank for s in spans if s.role == "worker"})
    account, waiting, compute = ({r: 0.0 for r in workers} for _ in range(3))
    for i, culprit in culprits(spans, parents).items():
        if culprit != spans[i].rank:
            account[culprit] += spans[i].end - spans[i].start
    for s in spans:
        if s.role == "worker" and s.name in ("blocked", "barrier", "compute"):
            (compute if s.name == "compute" else waiting)[s.rank] += s.end - s.start
    # nobody waited for anyone (one worker, asgd): the one that computed longest
    rank = max(workers, key=lambda r: (account[r], compute[r])) if workers else None
    return {"slowest_rank": rank,
            "waited_for_slowest_s": round(account[rank], 6) if workers else 0.0,
            "waited_for": {r: round(v, 6) for r, v in account.items()},
            "waiting": {r: round(v, 6) for r, v in waiting.items()}}


def data_waits(spans) -> dict:
    """{worker rank: {"first": s, "other": s}}: its ``data`` spans summed, an epoch's
    first chunk apart from the others (the module's doc); only workers that have any."""
    out = {}
    for s in spans:
        if s.role == "worker" and s.name == "data":
            mine = out.setdefault(s.rank, {"first": 0.0, "other": 0.0})
            mine["first" if (s.args or {}).get("first") else "other"] += s.end - s.start
    return {r: {k: round(v, 6) for k, v in w.items()} for r, w in sorted(out.items())}


def _pid(role, rank):
    return rank if role == "worker" else 100_000 + rank


def trace_events(spans, segments):
    """Chrome's trace event format, one event at a time: an ``X`` event per span (``b``
    and ``e`` on async lanes), in microseconds from the first span; a process per node, a
    thread per lane, named."""
    t0 = min((s.start for s in spans), default=0.0)
    tids = {}
    for seg in segments:
        if seg["role"] in ROLES:
            pid = _pid(seg["role"], seg["rank"])
            yield {"ph": "M", "name": "process_name", "pid": pid,
                   "args": {"name": f"{seg['role']} {seg['rank']}"}}
            yield {"ph": "M", "name": "process_sort_index", "pid": pid,
                   "args": {"sort_index": pid}}
    for n, s in enumerate(spans):
        pid = _pid(s.role, s.rank)
        tid = tids.get((pid, s.lane))
        if tid is None:
            tid = tids[(pid, s.lane)] = len([k for k in tids if k[0] == pid]) + 1
            yield {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                   "args": {"name": s.lane}}
        ts, dur = round((s.start - t0) * 1e6, 3), round((s.end - s.start) * 1e6, 3)
        base = {"name": s.name, "cat": s.role, "pid": pid, "tid": tid}
        if s.lane.startswith(ASYNC_LANES):
            yield dict(base, ph="b", ts=ts, id=n, args=s.args or {})
            yield dict(base, ph="e", ts=round(ts + dur, 3), id=n)
        else:
            yield dict(base, ph="X", ts=ts, dur=dur, args=s.args or {})


def _trace_meta(segments) -> dict:
    return {"displayTimeUnit": "ms", "otherData": {
        "clock": "the scheduler's time.perf_counter(), from the first span",
        "measured offsets": {f"{s['role']} {s['rank']}": offsets(s["clock"])[1]
                             for s in segments if s["role"] in ROLES}}}


def chrome_trace(spans, segments) -> dict:
    """The whole trace as one dict (``write_trace`` writes it without holding it)."""
    return dict(_trace_meta(segments), traceEvents=list(trace_events(spans, segments)))


def write_trace(path, spans, segments) -> Path:
    """The trace of ``chrome_trace``, written event by event (a big job's trace would
    need gigabytes as one object), then renamed into place. An ``X`` event, most of
    them, is formatted from cached pieces: json.dumps of each dict took most of a big
    merge's time."""
    path = Path(path)
    tmp = path.with_suffix(".json.tmp")
    head = functools.lru_cache(maxsize=None)(lambda name, cat, pid, tid: json.dumps(
        {"name": name, "cat": cat, "ph": "X", "pid": pid, "tid": tid})[:-1])
    quote = functools.lru_cache(maxsize=None)(json.dumps)
    with open(tmp, "w") as f:
        f.write(json.dumps(_trace_meta(segments))[:-1] + ',"traceEvents":[')
        for n, e in enumerate(trace_events(spans, segments)):
            if e["ph"] == "X" and len(e["args"]) <= 1:
                args = "".join(f'{quote(k)}:{v!r}' if type(v) in (int, float) and math.isfinite(v)
                               else f'{quote(k)}:{json.dumps(v)}' for k, v in e["args"].items())
                text = (head(e["name"], e["cat"], e["pid"], e["tid"]) +
                        f',"ts":{e["ts"]!r},"dur":{e["dur"]!r},"args":{{{args}}}}}')
            else:
                text = json.dumps(e, separators=(",", ":"))
            f.write(("," if n else "") + text)
        f.write("]}\n")
    os.replace(tmp, path)
    return path


def _main_lanes(spans) -> dict:
    """The lane of each node that the PNG draws: the one whose spans cover the most time
    (the training thread, the server's loop)."""
    cover = collections.defaultdict(collections.Counter)
    for s in spans:
        if not s.lane.startswith(ASYNC_LANES):
            cover[(s.role, s.rank)][s.lane] += s.end - s.start
    return {node: lanes.most_common(1)[0][0] for node, lanes in cover.items()}


def plot(spans, parents, path, title) -> Path:
    """A PNG with one lane per rank: its main lane's spans, each nested span drawn
    over its parent, narrower (of a long run, the window at its end that holds the last
    MANY_TO_DRAW spans)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    nodes = sorted({(s.role, s.rank) for s in spans}, key=lambda n: (ROLES.index(n[0]), n[1]))
    t0 = min((s.start for s in spans), default=0.0)
    since = sorted(s.start for s in spans)[-MANY_TO_DRAW] if len(spans) > MANY_TO_DRAW else t0
    if since > t0:
        title += f" (the PNG: the last {max(s.end for s in spans) - since:.0f} s)"
    fig, ax = plt.subplots(figsize=(12, 1.0 + 0.7 * len(nodes)), dpi=100)
    lanes = _main_lanes(spans)
    rows = {node: row for row, node in enumerate(nodes)}
    bars = collections.defaultdict(list)      # (name, depth, row) -> [(x, width)]
    for i, s in enumerate(spans):
        if s.lane == lanes.get((s.role, s.rank)) and s.start >= since:
            depth, p = 0, parents[i]
            while p is not None:
                depth, p = depth + 1, parents[p]
            bars[(s.name, min(depth, 3), rows[(s.role, s.rank)])].append(
                (s.start - t0, s.end - s.start))
    named = set()
    for (name, depth, row), xs in sorted(bars.items(), key=lambda kv: kv[0][1]):
        height = 0.8 - 0.2 * depth
        color = COLORS.get(name, "#dddddd" if name.isupper() else "#8c564b")  # a message
        ax.broken_barh(xs, (row - height / 2, height), color=color,
                       label=None if name in named else name)
        named.add(name)
    ax.set_yticks(range(len(nodes)), [f"{r} {k}" for r, k in nodes])
    ax.invert_yaxis()
    ax.set_xlabel("seconds (the scheduler's clock, from the first span)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, ncol=6, loc="upper center", bbox_to_anchor=(0.5, -0.25 if len(
        nodes) < 4 else -0.12))
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)


def merge(run_dir, draw=True) -> dict:
    """Write RUN_DIR/timeline.json (and timeline.png with ``draw``), add the slowest rank
    and the workers' waits for data to RUN_DIR/summary.json if there is one; returns what
    ``lines`` prints."""
    run_dir = Path(run_dir)
    segments = load(run_dir)
    spans = spans_of(segments)
    parents, bad = nesting(spans)
    who = slowest(spans, parents)
    trace = write_trace(run_dir / "timeline.json", spans, segments)
    out = dict(who, trace=trace, png=None, spans=len(spans), not_nested=len(bad),
               data_wait=data_waits(spans),
               dropped=sum(s["dropped"] for s in segments),
               nodes=sorted({(s["role"], s["rank"]) for s in segments if s["role"] in ROLES}))
    if draw and spans:
        out["png"] = plot(spans, parents, run_dir / "timeline.png", _headline(out))
    _add_to_summary(run_dir / "summary.json", out)
    return out


def _add_to_summary(path, out):
    if not path.exists():
        return
    summary = json.loads(path.read_text())
    summary.update(slowest_rank=out["slowest_rank"],
                   waited_for_slowest_s=out["waited_for_slowest_s"])
    if out["data_wait"]:      # {worker rank: {first, other}} (JSON's keys are strings)
        summary["data_wait_s"] = {str(r): w for r, w in out["data_wait"].items()}
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(summary, indent=2) + "\n")
    os.replace(tmp, path)


def _headline(out) -> str:
    if out["slowest_rank"] is None:
        return "no worker spans"
    return (f"slowest rank: worker {out['slowest_rank']}; the others waited "
            f"{out['waited_for_slowest_s']:.2f} s for it")


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def lines(out) -> list[str]:
    """What the report and the launcher print of a merge."""
    roles = collections.Counter(role for role, _ in out["nodes"])
    text = [f"timeline: {out['trace']} ({out['spans']} spans of {_count(roles['worker'], 'worker')} "
            f"and {_count(roles['server'], 'server')}; open it in https://ui.perfetto.dev)"]
    if out["png"]:
        text.append(f"timeline: {out['png']}")
    text.append(f"timeline: {_headline(out)} (each worker's blocked and barrier time: "
                + ", ".join(f"{r}: {v:.2f} s" for r, v in out["waiting"].items()) + ")")
    if out.get("data_wait"):
        text.append("timeline: each worker's wait for its data chunks, the epochs' first / "
                    "the others: " + ", ".join(f"{r}: {w['first']:.2f} / {w['other']:.2f} s"
                                               for r, w in out["data_wait"].items()))
    if out["dropped"]:
        text.append(f"timeline: {out['dropped']} spans were not recorded (the cap of a "
                    "process's spans, ssdsgd/timeline.py MAX_SPANS)")
    if out["not_nested"]:
        text.append(f"timeline: {out['not_nested']} spans overlap a span of their lane "
                    "without nesting in it")
    return text
