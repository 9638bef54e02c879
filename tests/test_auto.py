"""The knobs a job chooses itself (ssdsgd/sync/auto.py): the warm-up from the run's length,
k from the warm-up's timings, agreed by every worker, said and recorded."""
import json
import math

import pytest

from ssdsgd.sync import auto
from ssdsgd.sync.auto import K_MAX, K_MIN, SLACK, Schedule, Timings
from ssdsgd.kvstore.env import NodeEnv

from test_stage_machine import Job
from test_e2e_configs import dist, records, run_dir_of, sets


def _env(**settings):
    env = {"SSDSGD_SCHEDULER_PORT": "1", "SSDSGD_ROLE": "worker"}
    env.update({f"SSDSGD_{name.upper()}": str(value) for name, value in settings.items()})
    return NodeEnv.from_environ(env)


# ---- the warm-up ----------------------------------------------------------------------
def test_the_warmup_is_a_share_of_the_run_within_bounds():
    assert auto.warmup_steps("auto", 504)[0] == 26                  # 5 %, rounded up
    assert auto.warmup_steps("auto", 66)[0] == auto.WARMUP_MIN      # never too short to time
    assert auto.warmup_steps("auto", 10 ** 6)[0] == auto.WARMUP_MAX
    steps, why = auto.warmup_steps("auto", None)
    assert steps == auto.WARMUP_UNKNOWN_LENGTH and "SSDSGD_TOTAL_STEPS" in why
    assert auto.warmup_steps("40", 504) == (40, "pinned")
    for total in (20, 66, 220, 504, 5000):      # a run long enough to gain is never all warm-up
        assert auto.warmup_steps("auto", total)[0] < total


def test_an_unknown_length_is_taken_from_the_lr_schedulers_max_update(capsys):
    spec = {"name": "sgd", "params": {}, "lr_scheduler": {
        "name": "CosineScheduler", "params": {"max_update": 880, "base_lr": 0.1}}}
    s = Schedule(_env(), rank=0, num_workers=4)
    assert s.warmup_steps == auto.WARMUP_UNKNOWN_LENGTH
    s.learn_length(spec, t=0)
    assert s.warmup_steps == 44 and "max_update" in s.choices["warmup_steps"]["why"]
    assert "ssdsgd: warm-up 44 steps" in capsys.readouterr().err
    known = Schedule(_env(total_steps=60), rank=0, num_workers=4)     # the stated length wins
    known.learn_length(spec, t=0)
    assert known.warmup_steps == auto.WARMUP_MIN
    pinned = Schedule(_env(warmup_steps=7), rank=0, num_workers=4)
    pinned.learn_length(spec, t=0)
    assert pinned.warmup_steps == 7 and pinned.choices["warmup_steps"]["why"] == "pinned"


# ---- k ----------------------------------------------------------------------------------
def _k_meets_slack(t, k):
    """The rule's condition, restated: what the push that asks for a pull and the pull
    take beyond one step's compute, spread over k steps, is within SLACK of the
    push-every-step bound."""
    per_byte = t.round_s / (t.sent_bytes + t.received_bytes)
    excess = per_byte * (t.sent_bytes + t.pull_bytes) - t.compute_s
    return excess <= SLACK * max(t.compute_s, per_byte * t.sent_bytes) * k


@pytest.mark.parametrize("compute_s", [0.001, 0.01, 0.05, 0.2, 0.8, 3.0])
@pytest.mark.parametrize("round_s,sent,received,pull", [
    (4.0, 100e6, 100e6, 200e6),     # ResNet-50 shapes, 1 Gbit/s, exact state
    (2.0, 6e6, 100e6, 200e6),       # the same with 2bit pushes
    (0.4, 100e6, 100e6, 100e6),     # 10 Gbit/s, no state
    (0.004, 1e5, 1e5, 2e5),         # a small model on loopback
])
def test_k_is_the_smallest_that_hides_the_pulls_within_the_bounds(compute_s, round_s, sent,
                                                                  received, pull):
    t = Timings(compute_s, round_s, sent, received, pull)
    k, relay, why = auto.delay_steps(t)
    assert K_MIN <= k <= K_MAX and why.startswith("auto: compute") and relay is False
    if K_MIN < k < K_MAX:
        assert _k_meets_slack(t, k) and not _k_meets_slack(t, k - 1)
    elif k == K_MAX:
        assert not _k_meets_slack(t, k - 1)
    else:
        assert k == K_MIN


def test_a_pull_waits_for_the_push_that_asks_for_it():
    """A pull as of step t is answered once step t is applied (docs/spec/ssd-sgd.md), so
    it cannot start before that step's push has landed: what the step after it cannot
    hide is push + pull - compute. Rank 0's warm-up timings at the ResNet-20 shapes,
    10 Gbit/s, secure (docs/benchmarks/cluster_defaults_resnet20.md): compute 9.6 ms,
    push 6.0 ms, pull 12.1 ms. Counting the pull alone gave k = 3, which ran at 2.61x
    dist_sync in that invocation against k = 10's 3.53x (k = 5: 3.09x)."""
    t = Timings(compute_s=0.0096, round_s=0.0121, sent_bytes=1.1e6, received_bytes=1.1e6,
                pull_bytes=2.2e6)
    k, relay, why = auto.delay_steps(t)
    assert k >= 9 and relay is False, why
    assert "push 6.0 ms, pull 12.1 ms" in why


def test_k_follows_what_the_link_costs():
    cheap = auto.delay_steps(Timings(0.8, 0.4, 100e6, 100e6, 200e6))[0]
    dear = auto.delay_steps(Timings(0.8, 4.0, 100e6, 100e6, 200e6))[0]
    assert (cheap, dear) == (K_MIN, K_MAX)


def test_the_relay_is_chosen_where_the_pulls_are_not_hidden_and_a_chain_can_form():
    hidden = Timings(0.8, 0.4, 100e6, 100e6, 200e6)            # pull 0.4 s < compute
    burst = Timings(0.3, 0.3, 6e6, 100e6, 200e6)               # 2bit: pull 0.57 s > compute
    assert auto.delay_steps(hidden, relay_workers=4)[1] is False    # off where it costs
    k_alone, relay, _ = auto.delay_steps(burst, relay_workers=0)
    assert relay is False
    k_chain, relay, why = auto.delay_steps(burst, relay_workers=4)
    assert relay is True and "relayed" in why and k_chain < k_alone
    assert auto.delay_steps(burst, relay_workers=2)[1] is False     # no chain of 2


def test_the_relay_is_chosen_by_what_its_trial_measured():
    # secure ResNet-50 shapes at 10 Gbit/s on shared cores (docs/auto.md): rank 0 timed
    # compute 834 ms, push 915 ms, pull 1829 ms; the model took a relayed pull at 2/4 of
    # that and chose the relay, and the job ran at 0.57x dist_sync (k = 10: 1.02x); with k
    # = 2 then (the rule counted the pull without the push before it), with k = 10 now
    direct = dict(compute_s=0.834, round_s=1.83, sent_bytes=100e6, received_bytes=100e6,
                  pull_bytes=200e6)
    k, relay, why = auto.delay_steps(Timings(**direct), relay_workers=4)
    assert (k, relay) == (K_MAX, True) and "modelled, 2/4 of a pull" in why
    # its trial's relayed rounds took longer than the direct ones: no relay, k for the pull
    k, relay, why = auto.delay_steps(Timings(**direct, relayed_round_s=2.1), relay_workers=4)
    assert (k, relay) == (K_MAX, False)
    assert "relayed 2370.0 ms (measured: relayed rounds 2100.0 ms against 1830.0 ms)" in why
    # a trial that saved most of the reply's link time: relayed, with a smaller k than
    # alone (the relayed pull: the servers' one copy, 458 ms)
    k, relay, why = auto.delay_steps(Timings(**direct, relayed_round_s=1.83 - 0.9),
                                     relay_workers=4)
    assert relay is True and k < K_MAX and "measured" in why
    # a trial can show no more than the servers' one copy saved
    assert auto.relayed_pull_s(Timings(**direct, relayed_round_s=0.0), 1.0, 4)[0] == 0.25


def test_the_relays_trial_is_the_warmups_steps_before_its_last_on_every_worker():
    now, stats = [0.0], {"time_blocked": 0.0, "bytes_sent": 0, "bytes_received": 0}
    s = Schedule(_env(algorithm="ssd", warmup_steps=9, pull_relay="auto"), rank=0,
                 num_workers=4, relay_workers=4)
    assert s.trial_steps() == range(5, 8)
    assert [s.trial_relays(t) for t in range(10)] == [None] * 5 + [True] * 3 + [False, None]
    for t in range(9):
        relayed = t in range(5, 8)
        now[0] += 0.5                               # compute
        with s.timed(t, stats, clock=lambda: now[0]):
            blocked = 0.6 if relayed else 1.0       # relayed rounds are shorter here
            if t == 8:
                blocked = 1.4                       # and the last one waits for the chain
            stats["time_blocked"] += blocked
            stats["bytes_sent"] += 1000
            stats["bytes_received"] += 3000 if t == 8 else 1000
            now[0] += blocked
    timings = s.timings()
    # the span of steps 5-8 (3 x 1.1 + 1.9 s) less one direct step (1.5 s), per relayed
    # step, less the compute: relayed rounds of (5.2 - 1.5) / 3 - 0.5 s
    assert timings == Timings(0.5, 1.0, 1000, 1000, 3000,
                              relayed_round_s=pytest.approx((5.2 - 1.5) / 3 - 0.5))
    s.decide(None)
    assert not s.trial_steps() and s.trial_relays(6) is None
    # no trial where the relay is pinned, impossible, or the warm-up too short for it
    assert not Schedule(_env(algorithm="ssd", warmup_steps=9, pull_relay="off"), rank=0,
                        num_workers=4, relay_workers=4).trial_steps()
    assert not Schedule(_env(algorithm="ssd", warmup_steps=9, pull_relay="auto"), rank=0,
                        num_workers=4, relay_workers=0).trial_steps()
    short = Schedule(_env(algorithm="ssd", warmup_steps=6, pull_relay="auto"), rank=0,
                     num_workers=4, relay_workers=4)
    assert not short.trial_steps() and short.trial_relays(3) is None


# ---- sync.compression: auto --------------------------------------------------------------
LINK_BOUND = Timings(0.1, 1.0, 100e6, 100e6, 100e6)     # push 0.5 s against 0.1 s of compute


@pytest.mark.parametrize("timings,costs,chosen", [
    # the push bounds the step: topk brings it to 0.15 s, 2bit to 0.14 s: topk (within 10 %)
    (LINK_BOUND, {"topk": (0.05, 0.2), "2bit": (0.04, 1 / 16)}, "topk"),
    # topk's coding is dear here: 2bit's 0.14 s against topk's 0.4 s
    (LINK_BOUND, {"topk": (0.3, 0.2), "2bit": (0.04, 1 / 16)}, "2bit"),
    # the compute bounds the step: coding only adds to it
    (Timings(1.0, 0.1, 10e6, 10e6, 10e6), {"topk": (0.05, 0.2), "2bit": (0.04, 1 / 16)},
     "none"),
    # the push bounds it, but coding costs more than it saves
    (LINK_BOUND, {"topk": (0.6, 0.2), "2bit": (0.5, 1 / 16)}, "none"),
])
def test_auto_compression_takes_what_shortens_the_step_preferring_accuracy(timings, costs,
                                                                          chosen):
    name, why = auto.compression(timings, {n: auto.CodecCost(*c) for n, c in costs.items()})
    assert name == chosen and why.startswith("auto: a steps-delay step estimated at none")


def test_k_is_chosen_for_the_compressed_push():
    """k counts the coded push: its wire bytes (2bit: 1/16) and its coding time as
    compute. Push, pull and compute of 0.5 s each: uncompressed, the pull starts when the
    0.5 s push has landed and needs k = 10; coded, the push lands in 31 ms, the pull fits
    in the step after it (0.54 s with the coding), and k = 2 hides it."""
    even = Timings(0.5, 1.0, 100e6, 100e6, 100e6)
    plain = auto.delay_steps(even)[0]
    coded = auto.delay_steps(even, codec=auto.CodecCost(0.04, 1 / 16))[0]
    assert (plain, coded) == (K_MAX, K_MIN)


def test_the_codecs_cost_is_measured_on_a_probe_scaled_to_the_push():
    from ssdsgd.kvstore.compression import measure_codecs
    small, big = measure_codecs(4e6), measure_codecs(64e6 * 4)     # the big one is capped
    assert set(small) == {"2bit", "topk"}
    assert small["2bit"][1] == pytest.approx(1 / 16, rel=0.01)     # 2 bits of 32
    assert small["topk"][1] == pytest.approx(0.2, rel=0.01)        # 8 bytes per tenth
    assert all(big[n][0] > small[n][0] > 0 for n in small)


def test_every_worker_takes_rank_0s_compression_at_the_end_of_the_warmup(capsys, monkeypatch):
    measured = []
    monkeypatch.setattr(auto, "compression", lambda t, costs: ("2bit", "auto: test"))
    job = Job(3, algorithm="ssd", warmup_steps=4, delay_steps=5, local_rule="glu",
              glu_state="exact")
    told = {c.rank: [] for c in job.clients}
    for m, c in zip(job.machines, job.clients):
        c.set_compression = told[c.rank].append
        m.schedule.compress_auto(lambda nbytes: measured.append(nbytes) or {
            "2bit": auto.CodecCost(0.01, 1 / 16)})
    assert [m.schedule.compression for m in job.machines] == [None] * 3
    job.run(4)
    assert len(measured) == 1                       # rank 0 alone measures
    index = auto.CODECS_BY_COST.index("2bit")
    assert [c.barriers for c in job.clients] == [[(2 * 5) * 3 + index]] * 3
    assert all(len(told[r]) == 1 and told[r][0].type == "2bit" for r in told)
    assert all(m.metrics()["choices"]["compression"]["value"] == "2bit" for m in job.machines)
    assert "ssdsgd: compression 2bit (auto: test)" in capsys.readouterr().err
    arrays, saved = job.machines[1].state_dict()
    assert saved["compression"] == "2bit"
    # a resumed worker takes the job's codec from its checkpoint, measuring nothing
    again = Job(3, algorithm="ssd", warmup_steps=4, delay_steps=5, local_rule="glu",
                glu_state="exact", start_step=4)
    m, told_again = again.machines[1], []
    again.clients[1].set_compression = told_again.append
    m.schedule.compress_auto(lambda nbytes: pytest.fail("measured"))
    m.load_state_dict(arrays, saved)
    assert m.schedule.compression == "2bit" and [s.type for s in told_again] == ["2bit"]


def test_auto_compression_without_a_warmup_to_time_stays_off(capsys):
    job = Job(2, algorithm="ssgd")
    job.machines[0].schedule.compress_auto(lambda nbytes: pytest.fail("measured"))
    assert job.machines[0].schedule.choices["compression"]["value"] == "none"
    assert "ssgd has no warm-up to time" in capsys.readouterr().err


def _relay_env(**over):
    values = dict(num_workers=4, algorithm="ssd", pull_schedule="aligned", quorum="all",
                  on_worker_failure="abort", pull_relay="auto")
    values.update(over)
    return _env(**values)


def test_an_auto_relay_listens_only_where_the_registry_allows_a_chain():
    assert auto.relay_listens(_relay_env())
    assert auto.relay_listens(_relay_env(pull_relay="chain", num_workers=2))
    for refused in (dict(pull_relay="off"), dict(num_workers=2), dict(algorithm="ssgd"),
                    dict(pull_schedule="staggered"), dict(quorum="majority"),
                    dict(on_worker_failure="continue")):
        assert not auto.relay_listens(_relay_env(**refused)), refused


def test_a_pinned_relay_or_one_the_job_cannot_have_is_not_decided():
    s = Schedule(_relay_env(warmup_steps=4, delay_steps=5), rank=0, num_workers=4)
    assert not s.undecided and s.choices["pull_relay"]["value"] == "off"
    assert "cannot relay" in s.choices["pull_relay"]["why"]
    s = Schedule(_relay_env(warmup_steps=4, delay_steps=5, pull_relay="chain"), rank=0,
                 num_workers=4)
    assert s.relay is True and s.choices["pull_relay"] == {"value": "chain", "why": "pinned"}
    s = Schedule(_relay_env(warmup_steps=4, delay_steps=5), rank=0, num_workers=4,
                 relay_workers=4)
    assert s.undecided and s.delay_steps == 5      # k pinned, the relay still the job's


def _queued(schedule, steps):
    return [t for t in range(steps) if schedule.queues_warmup_step(t)]


@pytest.mark.parametrize("rank", [0, 1])
def test_which_warmup_steps_queue_on_the_engine(rank):
    """A warm-up step queued on MXNet's engine returns before its round is done and times
    nothing (docs/design.md). Only rank 0's timings choose k and the relay (the others
    pass 0 to the agreement), so only its timed steps stay on the training thread: the
    last TIMED_LAST before the relay's trial and the step before them. Every worker keeps
    the trial (its replies come down the chain) and the last step (it seeds the rule)."""
    warmup, last = 30, 29
    pinned = Schedule(_env(algorithm="ssd", warmup_steps=warmup, delay_steps=5,
                           pull_relay="off"), rank=rank, num_workers=4)
    assert _queued(pinned, 40) == list(range(last))
    s = Schedule(_env(algorithm="ssd", warmup_steps=warmup, pull_relay="auto"), rank=rank,
                 num_workers=4, relay_workers=4)
    assert s.trial_steps() == range(last - auto.RELAY_TRIAL, last)
    if rank:
        assert _queued(s, 40) == list(range(last - auto.RELAY_TRIAL))
    else:
        assert _queued(s, 40) == list(range(last - auto.RELAY_TRIAL - auto.TIMED_LAST - 1))
    # what rank 0 then reads: TIMED_LAST whole samples, none timed from a queued step
    now, stats = [0.0], {"time_blocked": 0.0, "bytes_sent": 0, "bytes_received": 0}
    for t in range(warmup):
        now[0] += 0.5
        if s.queues_warmup_step(t):
            s.skip_timing()
            continue
        with s.timed(t, stats, clock=lambda: now[0]):
            stats["time_blocked"] += 1.0
            stats["bytes_sent"] += 1000
            stats["bytes_received"] += 1000
            now[0] += 1.0
    if rank == 0:
        assert len(s._samples) == auto.TIMED_LAST
        assert s.timings().compute_s == 0.5 and s.timings().round_s == 1.0
    ssgd = Schedule(_env(algorithm="ssgd"), rank=rank, num_workers=4)
    assert _queued(ssgd, 40) == []            # no warm-up: its steps queue as ssgd's


def test_the_warmup_is_timed_from_its_second_step():
    s = Schedule(_env(warmup_steps=4, delay_steps="auto"), rank=0, num_workers=1)
    now = [0.0]
    stats = {"time_blocked": 0.0, "bytes_sent": 0, "bytes_received": 0}
    for t in range(4):
        now[0] += 0.5 if t else 9.0                  # the first step's set-up is not timed
        with s.timed(t, stats, clock=lambda: now[0]):
            stats["time_blocked"] += 0.25
            stats["bytes_sent"] += 1000
            stats["bytes_received"] += 3000 if t == 3 else 1000
            now[0] += 0.25
    assert s.timings() == Timings(0.5, 0.25, 1000, 1000, 3000)    # the last reply: the pull


def _spec(name, lr):
    return {"name": name, "params": {"learning_rate": lr, "momentum": 0.9}, "lr_scheduler": None}


@pytest.mark.parametrize("name, lr, cap", [
    ("sgd", 0.02, 10), ("sgd", 0.05, 10), ("sgd", 0.1, 5), ("nag", 0.1, 5), ("sgd", 0.08, 5),
    ("adam", 0.001, 10), ("adam", 0.03, 10)])
def test_k_is_capped_by_what_the_accuracy_data_supports_at_the_jobs_optimizer_and_lr(
        name, lr, cap):
    """docs/auto.md: the largest k whose runs in docs/glu.md ended within 1 point of SSGD
    at that optimizer and lr (an lr between two measured ones takes the larger's cap)."""
    k, why, warns = auto.k_cap(_spec(name, lr))
    assert k == cap and f"{name} lr {lr:g}" in why and not warns


def test_above_every_lr_measured_within_a_point_k_is_the_least_and_the_job_is_warned():
    k, why, warns = auto.k_cap(_spec("sgd", 0.2))
    assert k == K_MIN and "expect" in why and "SSGD" in why and warns
    assert auto.k_cap(_spec("adam", 0.1))[0] == K_MIN


def test_an_optimizer_without_accuracy_data_gets_the_papers_k_and_no_optimizer_no_cap():
    k, why, warns = auto.k_cap(_spec("rmsprop", 0.01))
    assert k == auto.K_UNTIMED and "no accuracy data for rmsprop" in why and not warns
    assert auto.k_cap(None)[0] == K_MAX


def test_the_timed_k_and_the_untimed_fallback_stay_within_the_cap(capsys):
    slow_link = Timings(compute_s=0.01, round_s=1.0, sent_bytes=1e6, received_bytes=1e6,
                        pull_bytes=1e6)
    assert auto.delay_steps(slow_link)[0] == K_MAX           # uncapped, the link asks for 10
    s = Schedule(_env(warmup_steps=4, delay_steps="auto"), rank=0, num_workers=1)
    s.learn_cap(_spec("sgd", 0.1))
    s._samples = [(0.01, 1.0, 1e6, 1e6)] * 3
    s.decide(None)
    assert s.delay_steps == 5 and "at most 5 at sgd lr 0.1" in s.choices["delay_steps"]["why"]
    hot = Schedule(_env(warmup_steps=1, delay_steps="auto"), rank=0, num_workers=4)
    hot.learn_cap(_spec("sgd", 0.2))
    assert "expect" in capsys.readouterr().err          # said once the lr is known
    hot.decide(None)
    assert hot.delay_steps == K_MIN and "untimed" in hot.choices["delay_steps"]["why"]
    pinned = Schedule(_env(warmup_steps=4, delay_steps=9), rank=0, num_workers=1)
    pinned.learn_cap(_spec("sgd", 0.2))                    # a pinned k is the user's
    assert pinned.delay_steps == 9


def test_a_warmup_too_short_to_time_falls_back_to_the_papers_k():
    s = Schedule(_env(warmup_steps=1), rank=0, num_workers=4)
    s.decide(None)
    assert s.delay_steps == auto.K_UNTIMED and "untimed" in s.choices["delay_steps"]["why"]


# ---- the stage machine: every worker takes rank 0's k -----------------------------------
def test_every_worker_takes_rank_0s_k_at_the_end_of_the_warmup(capsys, monkeypatch):
    chosen = iter([7, 3, 4])                         # what each worker's timings would give

    def timed(timings, k_max=K_MAX, relay_workers=0, codec=None):
        return next(chosen), False, "auto: test"
    monkeypatch.setattr(auto, "delay_steps", timed)
    job = Job(3, algorithm="ssd", warmup_steps=4, delay_steps="auto", local_rule="glu",
              glu_state="exact")
    job.run(4)
    ks = [m.schedule.delay_steps for m in job.machines]
    # one barrier, where rank 0 passed (2 k + relay) x 3 + codec and the others 0
    assert [c.barriers for c in job.clients] == [[2 * ks[0] * 3]] * 3 and ks[0] in (7, 3, 4)
    job.run(2 * ks[0] + 1)
    for client in job.clients:                  # pulls every k steps after the warm-up
        pulls = [step for kind, step, pull, *_ in client.log if kind == "push" and pull]
        assert pulls == [0, 1, 2, 3] + [4 + ks[0] - 1, 4 + 2 * ks[0] - 1]
    assert f"ssdsgd: k = {ks[0]}" in capsys.readouterr().err
    m = job.machines[1].metrics()
    assert m["delay_steps"] == ks[0] and m["warmup_steps"] == 4
    assert set(m["choices"]) == {"warmup_steps", "delay_steps", "pull_relay"}


def test_a_resumed_worker_keeps_the_k_its_job_chose():
    job = Job(2, algorithm="ssd", warmup_steps=4, delay_steps="auto", local_rule="glu",
              glu_state="exact")
    job.run(9)
    saved = [m.state_dict() for m in job.machines]
    k = job.machines[0].schedule.delay_steps
    assert all(meta["delay_steps"] == k for _, meta in saved)
    again = Job(2, algorithm="ssd", warmup_steps=4, delay_steps="auto", local_rule="glu",
                glu_state="exact", start_step=9)
    for m, (arrays, meta) in zip(again.machines, saved):
        m.load_state_dict(arrays, meta)
        assert m.schedule.delay_steps == k
        assert "before the restart" in m.schedule.choices["delay_steps"]["why"]
    # and the job agrees on it again once, so the scheduler knows it (a joiner's step)
    again.run(2)
    assert [m.client.barriers for m in again.machines] == [[auto.encode_choice(
        k, False, "none")]] * 2
    assert [m.schedule.delay_steps for m in again.machines] == [k] * 2


def test_no_warmup_and_k_auto_takes_the_fallback_on_every_worker_agreed_at_one_barrier():
    """Nothing to time, so k is the fallback; the workers still agree on it once, at the
    barrier the scheduler keeps, so a join's step can be known (stage.join_boundary)."""
    job = Job(2, algorithm="ssd", warmup_steps=0, delay_steps="auto", local_rule="sgd")
    job.run(6)
    assert [m.schedule.delay_steps for m in job.machines] == [auto.K_UNTIMED] * 2
    fallback = auto.encode_choice(auto.K_UNTIMED, False, "none")
    assert [m.client.barriers for m in job.machines] == [[fallback]] * 2


# ---- a real job ---------------------------------------------------------------------------
@pytest.mark.system
def test_a_job_with_the_defaults_says_and_records_what_it_chose(tmp_path):
    """The digits demo with sync.warmup_steps and sync.delay_steps at auto: rank 0 says
    both choices, every worker runs the same k, and the summary records why."""
    p = dist(["configs/digits.yaml", *sets(sync__warmup_steps="auto", sync__delay_steps="auto",
                                           train__epochs=3, output__plots="false",
                                           output__dir=tmp_path)], timeout=150)
    assert p.returncode == 0, p.stderr[-3000:]
    run = run_dir_of(tmp_path)
    summary = json.loads((run / "summary.json").read_text())
    total = summary["steps"]
    assert summary["warmup_steps"] == max(auto.WARMUP_MIN, math.ceil(0.05 * total))
    assert K_MIN <= summary["delay_steps"] <= K_MAX
    assert "SSDSGD_TOTAL_STEPS" in summary["choices"]["warmup_steps"]["why"]
    assert summary["choices"]["delay_steps"]["why"].startswith("auto: compute")
    assert summary["delay_steps"] <= 5        # the demo's sgd at lr 0.1 (auto.K_CAP_BY_LR)
    assert "at most 5 at sgd lr 0.1" in summary["choices"]["delay_steps"]["why"]
    ends = [records(run, rank, "end")[-1] for rank in (0, 1)]
    assert [e["kv"]["delay_steps"] for e in ends] == [summary["delay_steps"]] * 2
    text = p.stdout + p.stderr
    assert f"ssdsgd: warm-up {summary['warmup_steps']} steps (auto" in text
    assert f"ssdsgd: k = {summary['delay_steps']} (auto: compute" in text


@pytest.mark.system
def test_a_three_worker_job_times_the_relay_in_its_warmup_and_says_what_it_measured(tmp_path):
    """Three workers, the relay at auto: the warm-up's steps T_w - 4 .. T_w - 2 are relayed
    (every worker passes pieces on), rank 0 chooses from what they measured, and the
    summary says so."""
    p = dist(["configs/digits.yaml", *sets(cluster__workers=3, sync__warmup_steps=9,
                                           train__epochs=1, output__plots="false",
                                           output__dir=tmp_path)], timeout=150)
    assert p.returncode == 0, p.stderr[-3000:]
    run = run_dir_of(tmp_path)
    summary = json.loads((run / "summary.json").read_text())
    why = summary["choices"]["pull_relay"]["why"]
    assert "(measured: relayed rounds " in why, why
    relayed = summary["choices"]["pull_relay"]["value"] == "chain"
    ends = [records(run, rank, "end")[-1]["kv"] for rank in range(3)]
    # the trial's 3 replies (and, if chosen, the steps-delay pulls) came through worker 0
    assert all(e["replies_relayed_in"] >= 3 for e in ends[1:]), ends
    assert ends[0]["replies_relayed_out"] >= 3 and ends[2]["replies_relayed_out"] == 0
    assert f"pull relay {'chain' if relayed else 'off'} (auto: compute" in p.stderr
