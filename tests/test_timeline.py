"""The per-process timeline (ssdsgd/timeline.py) and its merge (ssdsgd/timeline_merge.py),
in process: what a recorder writes, that it stays within its cap, the clock offsets the
merge applies, the nesting check, who the others waited for, the Chrome trace and the
files a merge writes. tests/test_timeline_job.py runs a real job with the timeline on."""
import json
import threading

import pytest

from ssdsgd import report, timeline as T, timeline_merge as M


@pytest.fixture
def rec():
    r = T.Recorder()
    yield r
    r.on = False


def test_a_recorder_that_is_off_records_nothing(tmp_path, rec):
    rec.span("push", 0.0, 1.0)
    rec.begin_step(0)
    rec.end_step()
    rec.clock(0.0, 1.0, 5.0)
    rec.flush()
    assert rec.count == 0 and not rec.probing and not list(tmp_path.iterdir())


def test_the_recorder_writes_its_spans_and_the_steps_between_them(tmp_path, rec):
    rec.start(tmp_path / "tl", "worker", 3)
    for t in range(3):
        rec.begin_step(t)
        rec.span("push", T.now(), key="step", value=t)
        rec.span("blocked", T.now(), lane="other")
        rec.end_step()
    rec.close()
    rec.span("late", 0.0, 1.0)                      # after close: not recorded
    seg, = M.read_file(tmp_path / "tl" / "worker-3.jsonl")
    assert (seg["role"], seg["rank"], seg["dropped"]) == ("worker", 3, 0)
    names = [s[0] for s in seg["spans"]]
    assert names.count("step") == 3 and names.count("push") == 3
    assert names.count("compute") == 2                # between steps, not before the first
    lanes = {s[1] for s in seg["spans"]}
    assert lanes == {threading.current_thread().name, "other"}
    steps = sorted((s for s in seg["spans"] if s[0] == "step"), key=lambda s: s[2])
    computes = sorted((s for s in seg["spans"] if s[0] == "compute"), key=lambda s: s[2])
    for (_, _, _, end, _), (_, _, start, stop, args), nxt in zip(steps, computes, steps[1:]):
        assert start == end and stop == nxt[2] and args == {"step": nxt[4]["step"]}
    spans = M.spans_of([seg])
    assert M.nesting(spans)[1] == []


def test_spans_are_written_every_flush_every_spans(tmp_path, rec, monkeypatch):
    monkeypatch.setattr(T, "FLUSH_EVERY", 5)
    rec.start(tmp_path, "server", 0)
    for i in range(12):
        rec.span("apply", float(i), float(i) + 0.5)
    lines = [json.loads(ln) for ln in (tmp_path / "server-0.jsonl").read_text().splitlines()]
    assert [sorted(ln) for ln in lines] == [["process"], ["names"], ["spans"], ["spans"]]
    assert len(M.read_file(tmp_path / "server-0.jsonl")[0]["spans"]) == 10
    rec.close()
    seg, = M.read_file(tmp_path / "server-0.jsonl")
    assert seg["spans"] == [("apply", threading.current_thread().name, float(i),
                             float(i) + 0.5, None) for i in range(12)]


def test_the_recorder_is_bounded_and_says_so(tmp_path, rec, capsys):
    rec.start(tmp_path, "worker", 0, cap=10)
    for i in range(25):
        rec.span("push", float(i), float(i) + 0.1)
    rec.close()
    seg, = M.read_file(tmp_path / "worker-0.jsonl")
    assert len(seg["spans"]) == 10 and seg["dropped"] == 15
    err = capsys.readouterr().err
    assert err.count("reached its cap of 10 spans") == 1
    out = M.merge(_run_with(tmp_path, [seg]), draw=False)
    assert out["dropped"] == 15
    assert any("15 spans were not recorded" in line for line in M.lines(out))


def _run_with(tmp_path, segments):
    """A run directory whose timeline holds ``segments`` (as read_file returns them),
    written by recorders."""
    run = tmp_path / "run"
    for seg in segments:
        r = T.Recorder()
        r.start(run / "timeline", seg["role"], seg["rank"])
        for name, lane, start, end, args in seg["spans"]:
            (key, value), = args.items() if args else [(None, 0)]
            r.span(name, start, end, lane, key, value)
        r.dropped = seg["dropped"]
        for at, offset, rtt in seg["clock"]:
            r._offsets.append({"offset": offset, "rtt": rtt, "at": at})
        r.close()
    return run


def test_the_clock_keeps_the_shortest_round_trip_of_each_window(tmp_path, rec):
    rec.start(tmp_path, "worker", 0)
    assert rec.probing
    rec.clock(10.0, 10.2, 110.3)        # offset 100.2, rtt 0.2
    rec.clock(11.0, 11.1, 111.15)       # shorter: offset 100.1
    rec.clock(12.0, 12.4, 999.0)        # longer: not kept
    rec.clock(10.0 + T.CLOCK_WINDOW, 10.3 + T.CLOCK_WINDOW, 110.0 + T.CLOCK_WINDOW)
    rec.clock(5.0, 4.0, 0.0)            # a negative round trip: ignored
    rec.close()
    seg, = M.read_file(tmp_path / "worker-0.jsonl")
    later = 10.15 + T.CLOCK_WINDOW
    assert [v for a, o, _ in seg["clock"] for v in (a, o)] == pytest.approx(
        [10.1, 100.2, 11.05, 100.1, later, 99.85])
    ats, offsets = M.offsets(seg["clock"])   # the shortest round trip of each window
    assert ats == pytest.approx([11.05, later]) and offsets == pytest.approx([100.1, 99.85])
    assert rec.probes == 4


def _segment(role, rank, spans, clock=(), host="h1", dropped=0):
    return {"role": role, "rank": rank, "pid": 1, "host": host, "cap": 10, "clock": list(clock),
            "dropped": dropped, "spans": list(spans)}


def test_the_merge_moves_each_process_to_the_schedulers_clock():
    segments = [
        _segment("scheduler", 0, [], host="sched"),
        _segment("worker", 0, [("step", "main", 1.0, 2.0, None)], [(0.0, 100.0, 0.001)]),
        # two windows: the offset is interpolated between them
        _segment("worker", 1, [("step", "main", 60.0, 61.0, None)],
                 [(0.0, 10.0, 0.001), (120.0, 12.0, 0.001)]),
        _segment("server", 0, [("apply", "main", 5.0, 6.0, None)]),     # measured none
        # on the scheduler's host: the same clock, whatever was measured
        _segment("server", 1, [("apply", "main", 7.0, 8.0, None)], [(0.0, 0.5, 1.0)],
                 host="sched"),
    ]
    got = {(s.role, s.rank): (s.start, s.end) for s in M.spans_of(segments)}
    assert got == {("worker", 0): (101.0, 102.0), ("worker", 1): (71.0, pytest.approx(72.0167,
                                                                                      abs=1e-3)),
                   ("server", 0): (5.0, 6.0), ("server", 1): (7.0, 8.0)}


def _spans(*rows):
    return [M.Span(*row) for row in rows]


def test_nesting_finds_the_parent_of_each_span_and_the_overlaps():
    spans = _spans(("worker", 0, "main", "step", 0.0, 10.0, None),
                   ("worker", 0, "main", "push", 1.0, 2.0, None),
                   ("worker", 0, "main", "pull", 3.0, 9.0, None),
                   ("worker", 0, "main", "blocked", 4.0, 8.0, None),
                   ("worker", 0, "main", "compute", 10.0, 12.0, None),     # touches: follows
                   ("worker", 0, "io", "send", 1.5, 3.5, None),             # its own lane
                   ("worker", 1, "main", "step", 0.0, 1.0, None),           # another node
                   ("server", 0, "queue w0", "queue", 0.0, 5.0, None),      # async: may overlap
                   ("server", 0, "queue w0", "queue", 1.0, 6.0, None))
    parents, bad = M.nesting(spans)
    assert parents == [None, 0, 0, 2, None, None, None, None, None] and bad == []
    spans.append(M.Span("worker", 0, "main", "local_update", 1.5, 2.5, None))  # crosses push
    parents, bad = M.nesting(spans)
    assert bad == [(spans[-1], spans[1])]


def test_the_slowest_rank_is_the_one_the_others_waited_for():
    w = "worker"
    spans = _spans(
        # step 5, synchronous: worker 1 pushes last, worker 0 waits 1.5 s for it
        (w, 0, "m", "push", 0.0, 1.0, {"step": 5}), (w, 1, "m", "push", 0.5, 2.0, {"step": 5}),
        (w, 0, "m", "pull", 1.0, 3.0, {"waits_for": 5}), (w, 0, "m", "blocked", 1.1, 2.6, None),
        (w, 1, "m", "pull", 2.0, 3.0, {"waits_for": 5}), (w, 1, "m", "blocked", 2.0, 2.9, None),
        # step 6, steps delay: worker 0 pushes last; worker 1's reset at 7 waits 0.25 s
        (w, 0, "m", "push", 4.0, 5.0, {"step": 6}), (w, 1, "m", "push", 4.0, 4.5, {"step": 6}),
        (w, 1, "m", "reset", 6.0, 7.0, {"waits_for": 6}), (w, 1, "m", "blocked", 6.0, 6.25, None),
        # a barrier: worker 1 arrives last; worker 0 waits 2 s there
        (w, 0, "m", "barrier", 10.0, 12.0, None), (w, 1, "m", "barrier", 11.9, 12.0, None),
        # a blocked span outside any step (the end's pull) is nobody's doing
        (w, 0, "m", "blocked", 20.0, 25.0, None),
        (w, 0, "m", "compute", 30.0, 31.0, None))
    out = M.slowest(spans, M.nesting(spans)[0])
    assert out["slowest_rank"] == 1
    assert out["waited_for_slowest_s"] == pytest.approx(3.5)
    assert out["waited_for"] == {0: pytest.approx(0.25), 1: pytest.approx(3.5)}
    assert out["waiting"] == {0: pytest.approx(8.5), 1: pytest.approx(1.25)}


def test_without_waiting_the_slowest_rank_is_the_one_that_computed_longest():
    spans = _spans(("worker", 0, "m", "compute", 0.0, 1.0, None),
                   ("worker", 1, "m", "compute", 0.0, 2.0, None))
    out = M.slowest(spans, M.nesting(spans)[0])
    assert (out["slowest_rank"], out["waited_for_slowest_s"]) == (1, 0.0)
    assert M.slowest([], [])["slowest_rank"] is None


def test_the_waits_for_data_are_summed_per_worker_an_epochs_first_chunk_apart():
    w = "worker"
    spans = _spans((w, 0, "m", "data", 0.0, 0.5, {"first": 1}),
                   (w, 0, "m", "data", 1.0, 1.25, {"first": 0}),
                   (w, 0, "m", "data", 2.0, 2.5, {"first": 0}),
                   (w, 0, "m", "data", 9.0, 9.125, {"first": 1}),
                   (w, 1, "m", "data", 0.0, 2.0, {"first": 1}),
                   (w, 2, "m", "compute", 0.0, 2.0, None),           # no data: not listed
                   ("server", 0, "m", "data", 0.0, 5.0, {"first": 1}))   # not a worker's
    waits = M.data_waits(spans)
    assert waits == {0: {"first": 0.625, "other": 0.75}, 1: {"first": 2.0, "other": 0.0}}
    out = dict(M.slowest(spans, M.nesting(spans)[0]), trace="t.json", png=None, spans=7,
               not_nested=0, dropped=0, data_wait=waits, nodes=[(w, 0), (w, 1), (w, 2)])
    assert ("timeline: each worker's wait for its data chunks, the epochs' first / the "
            "others: 0: 0.62 / 0.75 s, 1: 2.00 / 0.00 s") in M.lines(out)


def test_the_chrome_trace_names_every_node_and_lane():
    segments = [_segment("worker", 0, [("step", "MainThread", 10.0, 10.5, {"step": 0}),
                                       ("send", "ssdsgd-io", 10.1, 10.2, None)]),
                _segment("server", 2, [("queue", "queue w0", 10.05, 10.3, {"req": 7})])]
    spans = M.spans_of(segments)
    trace = json.loads(json.dumps(M.chrome_trace(spans, segments)))
    meta = [e for e in trace["traceEvents"] if e["ph"] == "M"]
    assert {(e["pid"], e["args"]["name"]) for e in meta if e["name"] == "process_name"} == {
        (0, "worker 0"), (100_002, "server 2")}
    assert {e["args"]["name"] for e in meta if e["name"] == "thread_name"} == {
        "MainThread", "ssdsgd-io", "queue w0"}
    step, = [e for e in trace["traceEvents"] if e["name"] == "step"]
    assert (step["ph"], step["ts"], step["dur"], step["args"]) == ("X", 0.0, 500000.0,
                                                                   {"step": 0})
    begin, end = [e for e in trace["traceEvents"] if e["name"] == "queue"]
    assert (begin["ph"], end["ph"], begin["id"]) == ("b", "e", end["id"])
    assert (begin["ts"], end["ts"]) == (50000.0, 300000.0)


def test_a_merge_writes_the_trace_the_png_and_the_summary(tmp_path, capsys):
    segments = [_segment("worker", r, [("push", "m", 0.0, 1.0 + r, {"step": 0}),
                                       ("pull", "m", 2.0, 4.0, {"waits_for": 0}),
                                       ("blocked", "m", 2.0, 3.0, None)]) for r in (0, 1)]
    segments.append(_segment("server", 0, [("PUSH", "m", 0.5, 0.6, None),
                                           ("apply", "m", 0.55, 0.58, None)]))
    run = _run_with(tmp_path, segments)
    (run / "summary.json").write_text(json.dumps({"steps": 1}))
    assert report.main([str(run), "--timeline"]) == 0
    out = capsys.readouterr().out
    assert f"timeline: {run / 'timeline.json'} (8 spans of 2 workers and 1 server" in out
    assert "slowest rank: worker 1; the others waited 1.00 s for it" in out
    assert "data chunks" not in out          # no dynamic data: no data spans, no line
    assert (run / "timeline.png").read_bytes()[:4] == b"\x89PNG"
    assert len(json.loads((run / "timeline.json").read_text())["traceEvents"]) > 7
    assert json.loads((run / "summary.json").read_text()) == {
        "steps": 1, "slowest_rank": 1, "waited_for_slowest_s": 1.0}


def test_a_run_without_a_timeline_is_an_error(tmp_path, capsys):
    assert report.main([str(tmp_path), "--timeline"]) == 2
    assert "no timeline/*.jsonl" in capsys.readouterr().err


def test_a_process_killed_mid_line_leaves_the_next_segment_readable(tmp_path, rec):
    rec.start(tmp_path, "worker", 1)
    rec.span("push", 1.0, 2.0, "m", "step", 0)
    rec.close()
    with open(tmp_path / "worker-1.jsonl", "a") as f:
        f.write('{"spans":"AAAA')                     # torn: the process was killed
    rec.start(tmp_path, "worker", 1)                  # the job restarted
    rec.span("pull", 3.0, 4.0, "m", "waits_for", 0)
    rec.close()
    first, second = M.read_file(tmp_path / "worker-1.jsonl")
    assert first["spans"] == [("push", "m", 1.0, 2.0, {"step": 0})]
    assert second["spans"] == [("pull", "m", 3.0, 4.0, {"waits_for": 0})]
