"""Which chunk each member trains at each step as workers join and leave
(ssdsgd/sync/membership.py, docs/spec/membership.md "The data"): each global chunk of
the budget once, in rank order within a step, the same chunks as a fixed job's."""
import pytest

from ssdsgd.sync.membership import Membership


def trained(m, steps):
    return [(t, r, m.chunk(r, t)) for t in range(steps) for r in range(6)
            if m.chunk(r, t) is not None]


def test_with_no_change_worker_r_trains_chunk_t_n_plus_r():
    m = Membership(2, per_epoch=10, budget=30)
    assert m.end() == 15
    assert m.chunk(1, 7) == divmod(15, 10) == (1, 5)
    assert m.chunk(0, 15) is None and m.chunk(2, 3) is None


@pytest.mark.parametrize("changes, end", [
    ([("join", 2, 5)], 5 + (31 - 10) // 3),                  # 10 chunks, then 3 a step
    ([("join", 2, 5), ("leave", 1, 9)], 9 + (31 - 10 - 12) // 2),
    ([("join", 2, 0)], 31 // 3),
])
def test_every_chunk_of_the_budget_is_trained_once_whoever_is_in(changes, end):
    m = Membership(2, per_epoch=10, budget=31)
    for event, rank, step in changes:
        getattr(m, event)(rank, step)
    assert m.end() == end
    rows = trained(m, 40)
    assert max(t for t, _, _ in rows) == end - 1
    globals_ = [e * 10 + c for _, _, (e, c) in rows]
    assert sorted(globals_) == list(range(len(globals_)))      # each once, none skipped
    assert 31 - len(globals_) < len(m.members(end - 1))      # at most |M| - 1 dropped
    for t in range(end):                                      # rank order within a step
        step = [e * 10 + c for s, _, (e, c) in rows if s == t]
        assert step == sorted(step) and len(step) == len(m.members(t))


def test_a_joiner_trains_nothing_before_its_step_and_ranks_are_not_reused():
    m = Membership(2, per_epoch=10, budget=40)
    m.join(2, 5)
    assert m.chunk(2, 4) is None and m.chunk(2, 5) == (1, 2)
    with pytest.raises(ValueError, match="in the job already"):
        m.join(1, 6)


def test_throughput_by_membership_splits_the_samples_at_each_join():
    """The summary's figure after a join (issue 29: "its throughput after the join"):
    the samples of the steps of each membership over the wall time between the moments
    the change was heard; never a sum of per-worker rates."""
    from ssdsgd.metrics import throughput_by_membership
    m = Membership(2, per_epoch=10, budget=40)
    m.join(2, 5)                                   # 10 chunks in 5 steps, then 3 a step
    assert m.end() == 15 and m.first_chunk(15) == 40
    spans = throughput_by_membership(m, [(5, 4.0)], wall=9.0, batch_size=8)
    assert spans == [
        {"workers": 2, "from_step": 0, "to_step": 5, "seconds": 4.0, "samples": 80,
         "samples_per_sec": 20.0},
        {"workers": 3, "from_step": 5, "to_step": 15, "seconds": 5.0, "samples": 240,
         "samples_per_sec": 48.0}]
    # no change: one span of the whole job
    (only,) = throughput_by_membership(Membership(2, 10, 40), [], wall=8.0, batch_size=8)
    assert only["samples"] == 320 and only["samples_per_sec"] == 40.0
    # a change heard at the very end has no time of its own: no rate, not a division by 0
    spans = throughput_by_membership(m, [(5, 9.0)], wall=9.0, batch_size=8)
    assert spans[1]["samples_per_sec"] is None
    # and a departure after it: 3 workers, then 2 again
    m.leave(1, 9)                                  # 10 + 12 chunks by step 9, then 2 a step
    assert m.end() == 18
    spans = throughput_by_membership(m, [(5, 4.0), (9, 6.0)], wall=9.0, batch_size=8)
    assert [(x["workers"], x["from_step"], x["to_step"], x["samples"]) for x in spans] == [
        (2, 0, 5, 80), (3, 5, 9, 96), (2, 9, 18, 144)]
    assert spans[2]["samples_per_sec"] == pytest.approx(144 / 3.0)


def test_a_dead_workers_untrained_chunks_are_not_counted_as_applied():
    """docs/spec/membership.md rule 10: a dead worker's pushes leave at E, its data at
    the later s; its chunks of steps E..s-1 were never trained, so the span holding them
    counts the servers' samples without them."""
    from ssdsgd.metrics import throughput_by_membership
    m = Membership(3, per_epoch=12, budget=60)
    m.leave(2, 8)                                   # its data leaves at s = 8
    spans = throughput_by_membership(m, [(8, 4.0)], wall=10.0, batch_size=8,
                                     untrained=[(5, 8)])     # its pushes left at E = 5
    assert [(x["workers"], x["from_step"], x["to_step"], x["samples"]) for x in spans] == [
        (3, 0, 8, (24 - 3) * 8), (2, 8, 26, 36 * 8)]
    assert spans[0]["samples_per_sec"] == pytest.approx(21 * 8 / 4.0)


def test_a_resumed_membership_continues_at_its_step_with_the_chunks_before_it():
    """A job that takes joiners, resumed from a checkpoint at step t whose chunks before
    it were G(t) (docs/spec/membership.md rule 11): its first N workers from t, the
    cursor at G(t). With no change before t, the same chunks as the uninterrupted job's;
    after a join, the chunks of the job whose joiner left at t."""
    whole = Membership(2, per_epoch=10, budget=31)
    resumed = Membership(2, per_epoch=10, budget=31, start_step=6, start_chunk=12)
    assert resumed.end() == whole.end() == 15
    assert [resumed.chunk(r, t) for t in range(6, 16) for r in range(2)] == [
        whole.chunk(r, t) for t in range(6, 16) for r in range(2)]
    assert resumed.first_chunk(9) == 18 and resumed.chunk(0, 5) is None
    grown = Membership(2, per_epoch=10, budget=31)
    grown.join(2, 4)
    grown.leave(2, 7)                               # as if the joiner left at the resume
    again = Membership(2, per_epoch=10, budget=31, start_step=7,
                       start_chunk=grown.first_chunk(7))
    again.join(2, 9)                                # a joiner of the resumed job
    assert again.first_chunk(7) == 4 * 2 + 3 * 3 == 17
    assert [again.chunk(r, t) for t in range(7, 9) for r in range(2)] == [
        grown.chunk(r, t) for t in range(7, 9) for r in range(2)]
    assert again.members(9) == [0, 1, 2] and again.end() == 9 + (31 - 17 - 4) // 3
    with pytest.raises(ValueError, match="before the resumed job's first step 7"):
        again.join(3, 6)


def test_a_checkpoint_is_due_where_the_chunks_pass_an_epoch_end():
    """Every member decides alike from the membership: the first step whose chunks
    before it reach a due epoch end (every ``every`` epochs, not the budget's end)."""
    m = Membership(3, per_epoch=10, budget=40)
    m.join(3, 2)                                   # 6 chunks, then 4 a step
    due = [t for t in range(1, m.end() + 1) if m.checkpoint_due(t, every=1)]
    assert due == [3, 6, 8]                        # G = 10, 18 -> 22 (passes 20), 30
    assert [t for t in range(1, m.end() + 1) if m.checkpoint_due(t, every=2)] == [6]


def test_the_chief_is_the_lowest_rank_in_the_job_worker_0_until_it_leaves():
    """docs/spec/membership.md rule 8: every worker computes the chief of a step alike
    from the membership; after the job's last step, that of its last members."""
    m = Membership(3, per_epoch=12, budget=60)
    assert [m.chief(t) for t in (0, 5, 30)] == [0, 0, 0]
    m.leave(0, 4)
    assert [m.chief(t) for t in (3, 4, 9)] == [0, 1, 1]
    m.join(3, 6)
    m.leave(1, 7)
    assert [m.chief(t) for t in (6, 7, 8)] == [1, 2, 2]
    assert m.chief(m.end()) == 2
