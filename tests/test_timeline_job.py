"""A real 2-worker digits job with ``train.timeline`` on: every rank's spans are there,
on the scheduler's clock, and they nest (a step's push, pull, reset and local update
inside that step, on the training thread or, queued, on the engine's lane; the waits
inside those; a server's apply and send inside the message
that caused them); the launcher merged them and named the slowest rank. And a 2-worker
job with dynamic data (quorum auto): each wait for a chunk is a ``data`` span between two
steps, and the report sums them per worker."""
import json
import re

import pytest

from ssdsgd import report, timeline_merge as M
from test_e2e_configs import dist, records, run_dir_of, sets

STEPS = 44      # 2 epochs of 22 steps (1797 digits / (2 workers x 32))
WARMUP = 4


def _ancestors(spans, parents, i):
    p = parents[i]
    while p is not None:
        yield spans[p]
        p = parents[p]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("timeline")
    p = dist(["configs/digits.yaml", *sets(
        train__epochs=2, train__timeline="true", sync__warmup_steps=WARMUP,
        sync__delay_steps=2, output__dir=root / "runs")])
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    return p, run_dir_of(root / "runs")


@pytest.mark.system
def test_every_rank_recorded_its_spans_and_they_nest(run):
    _, run_dir = run
    assert sorted(f.name for f in (run_dir / "timeline").iterdir()) == [
        "scheduler-0.jsonl", "server-0.jsonl", "worker-0.jsonl", "worker-1.jsonl"]
    segments = M.load(run_dir)
    spans = M.spans_of(segments)
    parents, bad = M.nesting(spans)
    assert bad == []
    for rank in (0, 1):
        mine = [(i, s) for i, s in enumerate(spans) if (s.role, s.rank) == ("worker", rank)]
        names = [s.name for _, s in mine]
        # a steps-delay step queued on MXNet's engine has its push, reset and local
        # update inside a step of the lane ``engine`` (worker/delay_on_engine.py); a
        # warm-up step queued there (all but the last, k pinned) its push and wait inside
        # a pull of that lane (worker/deferred.py), as ssgd's
        threads = [s.name for _, s in mine if s.lane != "engine"]
        engine = [s.name for _, s in mine if s.lane == "engine"]
        assert threads.count("step") == names.count("push") == STEPS
        assert engine.count("step") == engine.count("local_update")
        assert engine.count("push") == engine.count("step") + WARMUP - 1
        assert engine.count("pull") == WARMUP - 1
        assert engine.count("step") > STEPS / 2 and engine.count("reset") > 0
        assert names.count("compute") == STEPS - 1
        assert names.count("pull") == WARMUP             # the synchronous steps
        assert names.count("local_update") == STEPS - WARMUP
        assert names.count("reset") > 0 and names.count("blocked") > 0
        assert names.count("send") >= STEPS              # on the I/O thread's lane
        for i, s in mine:
            up = list(_ancestors(spans, parents, i))
            if s.name in ("push", "pull", "reset", "local_update"):
                if s.lane == "engine" and not any(a.name == "step" for a in up):
                    # a queued warm-up step's: its push inside its pull, of the same step
                    pull = s if s.name == "pull" else up[0]
                    assert pull.name == "pull" and pull.lane == "engine", (s, up)
                    assert pull.args["waits_for"] < WARMUP - 1
                    assert s.name == "pull" or s.args["step"] == pull.args["waits_for"]
                    continue
                step, = [a for a in up if a.name == "step"]      # in its step, once
                if s.name == "push":
                    assert s.args == step.args == {"step": s.args["step"]}
                else:
                    waits_for = (s.args or {}).get("waits_for", step.args["step"])
                    assert step.args["step"] - waits_for in (0, 1)
            if s.name == "blocked" and up and up[0].name in ("pull", "reset"):
                assert s.start >= up[0].start and s.end <= up[0].end
        waits = [s for i, s in mine if s.name == "blocked"
                 and any(a.name in ("pull", "reset") for a in _ancestors(spans, parents, i))]
        assert waits, "a step that waited for the others"
    server = [(i, s) for i, s in enumerate(spans) if s.role == "server"]
    assert {"PUSH", "apply", "send", "queue"} <= {s.name for _, s in server}
    for i, s in server:
        if s.name in ("apply", "send"):
            assert parents[i] is not None and spans[parents[i]].name.isupper(), s
    assert {s.lane for _, s in server if s.name == "queue"} == {"queue w0", "queue w1"}


@pytest.mark.system
def test_the_clock_offsets_were_measured_and_are_within_their_bounds(run):
    """Every process of this job reads the same clock (one host), so each measured
    offset must be within half its round trip of 0: what NTP's midpoint promises."""
    _, run_dir = run
    for seg in M.load(run_dir):
        if seg["role"] == "scheduler":
            continue
        assert seg["clock"], (seg["role"], seg["rank"])
        for _, offset, rtt in seg["clock"]:
            assert abs(offset) <= rtt / 2 + 1e-9


@pytest.mark.system
def test_the_launcher_merged_the_timeline(run):
    p, run_dir = run
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["slowest_rank"] in (0, 1) and summary["waited_for_slowest_s"] >= 0
    assert (f"[launcher] timeline: {run_dir / 'timeline.json'} (" in p.stdout
            and f"slowest rank: worker {summary['slowest_rank']};" in p.stdout)
    assert (run_dir / "timeline.png").read_bytes()[:4] == b"\x89PNG"
    trace = json.loads((run_dir / "timeline.json").read_text())
    named = {e["args"]["name"] for e in trace["traceEvents"]
             if e["ph"] == "M" and e["name"] == "process_name"}
    assert named == {"worker 0", "worker 1", "server 0"}
    assert all(e["ts"] >= 0 for e in trace["traceEvents"] if "ts" in e)


# ---- dynamic data: the waits for the scheduler's chunks ---------------------------------
EPOCHS = 3


@pytest.fixture(scope="module")
def dynamic_run(tmp_path_factory):
    """ssgd with quorum auto: data.assignment auto deals the batches (dynamic data);
    a checkpoint every epoch puts barriers between the epochs' chunks too."""
    root = tmp_path_factory.mktemp("timeline_dynamic")
    p = dist(["configs/digits.yaml", *sets(
        train__epochs=EPOCHS, train__timeline="true", sync__algorithm="ssgd",
        sync__quorum="auto", train__checkpoint_every=1, output__plots="false",
        output__dir=root / "runs")])
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    return p, run_dir_of(root / "runs")


@pytest.mark.system
def test_each_wait_for_a_chunk_is_a_data_span_between_two_steps(dynamic_run):
    _, run_dir = dynamic_run
    assert json.loads((run_dir / "summary.json").read_text())["data_assignment"] == "dynamic"
    spans = M.spans_of(M.load(run_dir))
    parents, bad = M.nesting(spans)
    assert bad == []
    for rank in (0, 1):
        data = [(i, s) for i, s in enumerate(spans)
                if (s.role, s.rank, s.name) == ("worker", rank, "data")]
        first = [s for _, s in data if s.args == {"first": 1}]
        assert len(first) == EPOCHS                   # one epoch start each
        assert all(s.args in ({"first": 0}, {"first": 1}) for _, s in data)
        assert first[0] == data[0][1]                 # the job's first wait is one
        # a wait for every chunk trained, and for the 1 or 2 answers saying an epoch (or
        # the budget) is over: 2 requests are in flight (data/dynamic.py)
        steps = records(run_dir, rank, "end")[-1]["steps"]
        assert EPOCHS <= len(data) - steps <= 2 * EPOCHS, (len(data), steps)
        assert len({s.lane for _, s in data}) == 1    # the training thread's
        # between two steps: inside the next step's compute span, or (before the first
        # step, after the last) at the top of the lane; never inside a step
        outside = [s for i, s in data if parents[i] is None]
        assert all(spans[parents[i]].name == "compute" for i, _ in data
                   if parents[i] is not None)
        assert 1 <= len(outside) <= 3, outside
        assert outside[0] == data[0][1]
        inner = {i for i, _ in data}
        assert not any(p in inner for p in parents), "a span inside a wait for data"


def _printed_waits(text):
    line, = [l for l in text.splitlines() if "wait for its data chunks" in l]
    return {int(r): (float(a), float(b))
            for r, a, b in re.findall(r"(\d+): ([\d.]+) / ([\d.]+) s", line.split("others:")[1])}


@pytest.mark.system
def test_the_report_prints_each_workers_wait_for_data_as_its_spans_sum(dynamic_run, capsys):
    p, run_dir = dynamic_run
    spans = M.spans_of(M.load(run_dir))
    want = {}
    for s in spans:
        if s.name == "data" and s.role == "worker":
            w = want.setdefault(s.rank, [0.0, 0.0])
            w[0 if s.args["first"] else 1] += s.end - s.start
    assert sorted(want) == [0, 1] and all(first > 0 for first, _ in want.values())
    assert report.main([str(run_dir), "--timeline"]) == 0
    # and the run's summary keeps them, by worker (the launcher's merge wrote them)
    summary = json.loads((run_dir / "summary.json").read_text())["data_wait_s"]
    assert sorted(summary) == ["0", "1"], summary
    for rank, waits in summary.items():
        assert waits["first"] == pytest.approx(want[int(rank)][0], abs=1e-5), summary
        assert waits["other"] == pytest.approx(want[int(rank)][1], abs=1e-5), summary
    for printed in (_printed_waits(capsys.readouterr().out), _printed_waits(p.stdout)):
        assert sorted(printed) == [0, 1]
        for rank, (first, other) in printed.items():
            assert first == pytest.approx(want[rank][0], abs=0.0051), (rank, printed, want)
            assert other == pytest.approx(want[rank][1], abs=0.0051), (rank, printed, want)
