"""The worker's stage machine alone, in process, in seconds.

``FakeClient`` implements the worker client's API (init, push(pull=, state=), pull) over
``FakeServer``, a tiny in-memory server that sums the N workers' gradients of a step in
rank order and applies MXNet's optimizer rebuilt from its description, as ssdsgd's servers
do; a reply "as of step t" is a copy taken when step t is applied. The fake logs every
push and every wait, so the tests check the schedule the spec fixes; and the workers'
weights are compared with the spec's simulator (ssdsgd/glu/simulate.py). The system tests
(test_ssd_oracle.py, test_cluster.py) check the same on real processes and sockets.
"""
import threading
from concurrent.futures import ThreadPoolExecutor

import mxnet as mx
import numpy as np
import pytest

from ssdsgd.glu.simulate import simulate
from ssdsgd.mxglue import hostcopy
from ssdsgd.kvstore.client import KeyReply
from ssdsgd.kvstore.env import NodeEnv
from ssdsgd.mxglue.optimizer_spec import build, describe, flatten_state
from ssdsgd.worker.machine import StageMachine
from ssdsgd.sync.stage import Stage

SHAPES = {0: (3, 4), 1: (5,), 2: (2, 3)}
OPTIMIZERS = {"sgd": dict(learning_rate=0.1, momentum=0.9, wd=1e-4, rescale_grad=0.5),
              "adam": dict(learning_rate=0.01, rescale_grad=0.5)}


class FakeServer:
    def __init__(self, num_workers, spec):
        self.num_workers = num_workers
        self.opt = build(spec)
        self.updater = mx.optimizer.get_updater(self.opt)
        self.weights, self.applied = {}, {}      # key -> NDArray, steps applied
        self.pushed = {}                         # (key, step) -> {rank: NDArray}
        self.waiting = {}                        # (key, step) -> [(FakeRequest, with_state)]
        self.cond = threading.Condition()
        self.barrier_values, self.barriers_done, self.barrier_result = [], 0, None

    def reply(self, key, with_state):
        w = self.weights[key]
        state = []
        if with_state:
            if key not in self.updater.states:
                self.updater.states[key] = self.opt.create_state_multi_precision(key, w)
                self.updater.states_synced[key] = True
            state = [s.asnumpy().reshape(-1) for s in flatten_state(self.updater.states[key])]
        return KeyReply(w.asnumpy().reshape(-1), state,
                        self.opt._index_update_count.get(key, 0), self.opt.learning_rate)

    def push(self, rank, key, step, grad, request, with_state):
        self.pushed.setdefault((key, step), {})[rank] = grad
        if request is not None:
            self.waiting.setdefault((key, step), []).append((request, with_state))
        while len(self.pushed.get((key, self.applied[key]), ())) == self.num_workers:
            grads = self.pushed.pop((key, self.applied[key]))
            acc = grads[0].copy()
            for r in range(1, self.num_workers):
                acc += grads[r]
            self.updater(key, acc, self.weights[key])
            self.applied[key] += 1
            for req, state in self.waiting.pop((key, self.applied[key] - 1), ()):
                req.fill(key, self.reply(key, state))
        self.cond.notify_all()


class FakeRequest:
    """The fake's Gather: ``wait()`` returns {key: KeyReply} once every key is answered."""

    def __init__(self, client, step, keys):
        self.client, self.step, self.missing, self.replies = client, step, set(keys), {}

    def fill(self, key, reply):
        self.replies[key] = reply
        self.missing.discard(key)

    def wait(self):
        client = self.client
        client.log.append(("wait", client.last_push, self.step))
        with client.server.cond:
            assert client.server.cond.wait_for(lambda: not self.missing, timeout=20), \
                f"worker {client.rank} waits forever for the reply as of step {self.step}"
        client.received = max(client.received, self.step)
        return self.replies


class FakeClient:
    """The worker client's API, in memory. ``log``: ("push", step, pull, state, keys) and
    ("wait", step of the last push, the step the awaited reply is as of)."""

    def __init__(self, rank, server):
        self.rank, self.num_workers, self.server = rank, server.num_workers, server
        self.stats = {"time_blocked": 0.0}
        self.left = []      # workers that left the job (none here)
        self.pushes, self.log = {}, []
        self.last_push, self.received = None, -1
        self.ahead = []     # per push: steps beyond the last global weights received
        self.codes_pushes = False   # pushes are kept, uncompressed, until the server reads them
        self.barriers = []          # what each barrier returned

    def init(self, keys, values=None):
        with self.server.cond:
            for i, (key, size, dtype) in enumerate(keys):
                self.pushes.setdefault(key, 0)
                if key not in self.server.weights:
                    assert values is not None, "rank 0 initializes first in these tests"
                    self.server.weights[key] = mx.nd.array(values[i], dtype=dtype)
                    self.server.applied[key] = 0
            request = FakeRequest(self, -1, [key for key, _, _ in keys])
            for key, _, _ in keys:
                request.fill(key, self.server.reply(key, False))
        return request

    def push(self, step, grads, *, pull=False, state=False):
        self.log.append(("push", step, pull, state, [key for key, _ in grads]))
        self.last_push = step
        self.ahead.append(step - self.received)
        request = FakeRequest(self, step, [key for key, _ in grads]) if pull else None
        with self.server.cond:
            for key, flat in grads:
                grad = mx.nd.array(flat.reshape(self.server.weights[key].shape), dtype=flat.dtype)
                self.server.push(self.rank, key, self.pushes[key], grad, request, state)
                self.pushes[key] += 1
        return request

    def residuals(self):            # no compression here: no error feedback to save
        return {}

    def load_residuals(self, residuals):
        assert residuals == {}

    def barrier(self, value=0, agreement=None):
        """The scheduler's barrier: returns once every worker is in, with the largest
        value any passed (how rank 0 tells the others a decision)."""
        server = self.server
        with server.cond:
            done = server.barriers_done
            server.barrier_values.append(value)
            if len(server.barrier_values) == self.num_workers:
                server.barrier_result = max(server.barrier_values)
                server.barrier_values, server.barriers_done = [], done + 1
                server.cond.notify_all()
            assert server.cond.wait_for(lambda: server.barriers_done > done, timeout=60)
            self.barriers.append(server.barrier_result)
            return server.barrier_result

    def pull(self, keys, *, latest=False, state=False):
        as_of = -1 if latest or self.last_push is None else self.last_push
        request = FakeRequest(self, as_of, keys)
        with self.server.cond:
            for key in keys:
                step = -1 if latest else self.pushes[key] - 1
                if step >= self.server.applied[key]:
                    self.server.waiting.setdefault((key, step), []).append((request, state))
                else:
                    request.fill(key, self.server.reply(key, state))
        return request


def _env(**settings):
    env = {"SSDSGD_SCHEDULER_PORT": "1", "SSDSGD_ROLE": "worker"}
    env.update({f"SSDSGD_{name.upper()}": str(value) for name, value in settings.items()})
    return NodeEnv.from_environ(env)


def _init():
    rng = np.random.RandomState(0)
    return {key: mx.nd.array(rng.uniform(-1, 1, shape)) for key, shape in SHAPES.items()}


def _grad_fn(worker, step, weights):
    """A deterministic gradient that depends on the weights, the worker and the step."""
    return {key: mx.nd.sin(w * (1.0 + 0.5 * worker)) + 0.01 * (step + 1)
            for key, w in weights.items()}


class Job:
    """N stage machines (one per worker) on one FakeServer, stepped in lockstep."""

    def __init__(self, num_workers=1, optimizer="sgd", start_step=0, **settings):
        self.make_optimizer = lambda: mx.optimizer.create(optimizer, **OPTIMIZERS[optimizer])
        spec = describe(self.make_optimizer())
        self.server = FakeServer(num_workers, spec)
        self.t = start_step
        init = _init()
        self.clients, self.machines, self.weights = [], [], []
        for rank in range(num_workers):
            client = FakeClient(rank, self.server)
            machine = StageMachine(client, _env(num_workers=num_workers, start_step=start_step,
                                                **settings))
            machine.set_optimizer(spec)
            weights = {key: mx.nd.zeros(shape) for key, shape in SHAPES.items()}
            machine.init_keys([(key, init[key], [weights[key]]) for key in SHAPES])
            self.clients.append(client)
            self.machines.append(machine)
            self.weights.append(weights)

    def step(self):
        grads = [_grad_fn(i, self.t, w) for i, w in enumerate(self.weights)]

        def one(i):
            self.machines[i].step([(key, [grads[i][key]], [self.weights[i][key]])
                                   for key in SHAPES])
        if len(self.machines) == 1:
            one(0)
        else:   # a synchronous step returns only once every worker has pushed
            with ThreadPoolExecutor(len(self.machines)) as pool:
                list(pool.map(one, range(len(self.machines))))
        self.t += 1

    def run(self, steps):
        for _ in range(steps):
            self.step()
        return self


# ---- the schedule ------------------------------------------------------------------------
def test_which_steps_request_pulls_and_which_wait():
    T_w, k, steps = 2, 3, 11
    job = Job(algorithm="ssd", warmup_steps=T_w, delay_steps=k, local_rule="glu",
              glu_state="exact").run(steps)
    log = job.clients[0].log
    pushes = [e for e in log if e[0] == "push"]
    assert [e[1] for e in pushes] == list(range(steps))
    requested = [t for _, t, pull, _, _ in pushes if pull]
    assert requested == [0, 1, 4, 7, 10]           # warm-up, then (t - T_w) mod k = k - 1
    # the exact glu state travels with the pulls that reset the rule: the last warm-up one
    # (the first reset) and every steps-delay one
    assert [t for _, t, _, state, _ in pushes if state] == [1, 4, 7, 10]
    # after the init, warm-up steps wait for their own step; a steps-delay pull is waited
    # for one step later
    waits = [(during, asof) for _, during, asof in (e for e in log if e[0] == "wait")]
    assert waits == [(None, -1), (0, 0), (1, 1), (5, 4), (8, 7)]
    job.machines[0].finish()                        # the last pull is waited for at the end
    assert [e for e in job.clients[0].log if e[0] == "wait"][-2:] == [("wait", 10, 10),
                                                                      ("wait", 10, 10)]


def test_the_local_weights_are_reset_to_the_global_weights_one_step_after_the_pull():
    # the 'none' rule never moves the local weights: they change only at a reset
    job = Job(algorithm="ssd", warmup_steps=1, delay_steps=2, local_rule="none")

    def w_G(t):
        return simulate(_init(), _grad_fn, job.make_optimizer, 1, t + 1, algorithm="ssd",
                        warmup_steps=1, delay_steps=2, local_rule="none").global_weights
    job.run(3)      # steps 0-2 run on w_G(0), the last warm-up weights; step 2 pulls w_G(2)
    for key in SHAPES:
        np.testing.assert_array_equal(job.weights[0][key].asnumpy(), w_G(0)[key].asnumpy())
    job.step()      # step 3 resets to w_G(2) before its (null) local update
    for key in SHAPES:
        np.testing.assert_array_equal(job.weights[0][key].asnumpy(), w_G(2)[key].asnumpy())


@pytest.mark.parametrize("k", [1, 2, 5])
def test_back_pressure_at_most_k_plus_one_pushes_beyond_the_last_global_weights(k):
    job = Job(algorithm="ssd", warmup_steps=2, delay_steps=k, local_rule="sgd").run(4 * k + 3)
    assert max(job.clients[0].ahead) == k + 1


def test_metrics_count_steps_per_stage():
    job = Job(algorithm="ssd", warmup_steps=3, delay_steps=2, local_rule="glu").run(10)
    m = job.machines[0].metrics()
    assert m[Stage.WARMUP] == 3 and m[Stage.STEPS_DELAY] == 7
    assert m[Stage.SSGD] == m[Stage.ASGD] == 0
    assert m["pushes"] == 10 and m["pulls"] == 3 + 3      # pulls at t = 4, 6, 8
    assert m["stage"] is Stage.STEPS_DELAY and m["step"] == 10
    ssgd = Job(algorithm="ssgd").run(4).machines[0].metrics()
    assert ssgd[Stage.SSGD] == ssgd["pushes"] == ssgd["pulls"] == 4
    assert ssgd["stage"] is Stage.SSGD


def test_a_resumed_job_continues_the_stage_schedule():
    job = Job(algorithm="ssd", warmup_steps=2, delay_steps=3, start_step=5,
              local_rule="glu").run(3)
    pushes = [e for e in job.clients[0].log if e[0] == "push"]
    assert [(t, pull) for _, t, pull, _, _ in pushes] == [(5, False), (6, False), (7, True)]
    assert job.machines[0].metrics()[Stage.STEPS_DELAY] == 3


# ---- against the spec's simulator ------------------------------------------------------
CASES = [("glu", "estimate", 1, 1, "sgd"), ("glu", "estimate", 3, 2, "sgd"),
         ("glu", "exact", 2, 2, "adam"), ("glu", "exact", 3, 1, "sgd"),
         ("glu", "corrected", 1, 2, "sgd"), ("glu", "corrected", 3, 2, "sgd"),
         ("sgd", "estimate", 2, 2, "sgd"), ("none", "estimate", 3, 2, "adam")]


@pytest.mark.parametrize("rule,glu_state,k,n,optimizer", CASES,
                         ids=["-".join(map(str, c)) for c in CASES])
def test_weights_equal_the_simulation(rule, glu_state, k, n, optimizer):
    steps, T_w = 9, 2
    job = Job(n, optimizer, algorithm="ssd", warmup_steps=T_w, delay_steps=k,
              local_rule=rule, glu_state=glu_state).run(steps)
    ref = simulate(_init(), _grad_fn, job.make_optimizer, n, steps, algorithm="ssd",
                   warmup_steps=T_w, delay_steps=k, local_rule=rule, glu_state=glu_state)
    for i in range(n):
        for key in SHAPES:
            np.testing.assert_array_equal(job.weights[i][key].asnumpy(),
                                          ref.worker_weights[i][key].asnumpy(),
                                          err_msg=f"worker {i} local weights of key {key}")
    for i in range(n):
        job.machines[i].finish()
        for key in SHAPES:
            np.testing.assert_array_equal(job.weights[i][key].asnumpy(),
                                          ref.global_weights[key].asnumpy(),
                                          err_msg=f"worker {i} final weights of key {key}")


@pytest.mark.parametrize("glu_state", ["exact", "corrected", "estimate"])
def test_resets_rewrite_the_local_state_in_place(glu_state):
    """A reset writes the pulled (or estimated) state into the arrays the local optimizer
    already has: the same buffers from the first reset on, nothing made per key per
    reset (ResNet-50 shapes: 25.6 M floats every k steps, bench/reset_cost.py)."""
    job = Job(algorithm="ssd", warmup_steps=1, delay_steps=2, local_rule="glu",
              glu_state=glu_state).run(2)

    def buffers():
        return {key: [hostcopy.host_view(a).ctypes.data for a in flatten_state(state)]
                for key, state in job.machines[0].rule.updater.states.items()}
    first = buffers()
    assert sorted(first) == sorted(SHAPES) and all(first.values())
    job.run(5)                                  # resets at steps 3 and 5
    assert job.machines[0].metrics()["pulls"] == 1 + 3
    assert buffers() == first


@pytest.mark.parametrize("n", [1, 2])
def test_without_warmup_the_exact_state_is_as_of_the_weights_it_resets_to(n):
    """A job without warm-up (or a resumed one) fetches the servers' optimizer state for
    its first reset. Fetched after its own first push, the state could already include
    step t (that push may complete the step) while the weights are w_G(t - 1)."""
    steps = 5
    job = Job(n, algorithm="ssd", warmup_steps=0, delay_steps=2, local_rule="glu",
              glu_state="exact").run(steps)
    ref = simulate(_init(), _grad_fn, job.make_optimizer, n, steps, algorithm="ssd",
                   warmup_steps=0, delay_steps=2, local_rule="glu", glu_state="exact")
    for i in range(n):
        for key in SHAPES:
            np.testing.assert_array_equal(job.weights[i][key].asnumpy(),
                                          ref.worker_weights[i][key].asnumpy(),
                                          err_msg=f"worker {i} local weights of key {key}")


def test_ssgd_equals_the_simulation():
    job = Job(2, algorithm="ssgd").run(5)
    ref = simulate(_init(), _grad_fn, job.make_optimizer, 2, 5, algorithm="ssgd")
    for i in range(2):
        for key in SHAPES:
            np.testing.assert_array_equal(job.weights[i][key].asnumpy(),
                                          ref.global_weights[key].asnumpy())


# ---- misuse ----------------------------------------------------------------------------
def test_steps_delay_without_out_fails_before_pushing():
    job = Job(algorithm="ssd", warmup_steps=0, delay_steps=2, local_rule="sgd")
    grads = _grad_fn(0, 0, job.weights[0])
    with pytest.raises(RuntimeError, match="out="):
        job.machines[0].step([(key, [grads[key]], None) for key in SHAPES])
    assert not [e for e in job.clients[0].log if e[0] == "push"]


def test_steps_delay_without_the_optimizer_on_the_kvstore_fails():
    job = Job(algorithm="ssd", warmup_steps=0, delay_steps=2, local_rule="sgd")
    job.machines[0].rule = None       # what a Trainer with update_on_kvstore=False leaves
    with pytest.raises(RuntimeError, match="update_on_kvstore"):
        job.step()


# ---- staggered pulls (docs/spec/staggered_pulls.md) ---------------------------------------
def test_staggered_pulls_spread_each_period_over_the_workers():
    T_w, k, n, steps = 2, 5, 4, 12
    job = Job(n, algorithm="ssd", warmup_steps=T_w, delay_steps=k, local_rule="glu",
              glu_state="exact", pull_schedule="staggered").run(steps)
    requested = [[t for e in c.log if e[0] == "push" for t, pull in [(e[1], e[2])]
                  if pull and t >= T_w] for c in job.clients]
    # o_i = floor(i k / N) = 0, 1, 2, 3: worker i requests when (t - T_w + o_i) mod k = k - 1
    assert requested == [[6, 11], [5, 10], [4, 9], [3, 8]]
    steps_with_a_pull = [t for r in requested for t in r]
    assert len(steps_with_a_pull) == len(set(steps_with_a_pull))   # never two at one step
    # each worker still waits for its pull one step after requesting it
    for c, r in zip(job.clients, requested):
        assert [asof for _, during, asof in (e for e in c.log if e[0] == "wait")
                if asof is not None and asof >= T_w] == r[:-1] + ([r[-1]] if r[-1] < steps - 1
                                                                  else [])


@pytest.mark.parametrize("glu_state,k,n", [("exact", 3, 2), ("corrected", 5, 4),
                                           ("estimate", 2, 3)])
def test_staggered_weights_equal_the_simulation(glu_state, k, n):
    steps, T_w = 13, 2
    job = Job(n, algorithm="ssd", warmup_steps=T_w, delay_steps=k, local_rule="glu",
              glu_state=glu_state, pull_schedule="staggered").run(steps)
    ref = simulate(_init(), _grad_fn, job.make_optimizer, n, steps, algorithm="ssd",
                   warmup_steps=T_w, delay_steps=k, local_rule="glu", glu_state=glu_state,
                   pull_schedule="staggered")
    aligned = simulate(_init(), _grad_fn, job.make_optimizer, n, steps, algorithm="ssd",
                       warmup_steps=T_w, delay_steps=k, local_rule="glu", glu_state=glu_state)
    for i in range(n):
        for key in SHAPES:
            np.testing.assert_array_equal(job.weights[i][key].asnumpy(),
                                          ref.worker_weights[i][key].asnumpy(),
                                          err_msg=f"worker {i} local weights of key {key}")
    # the schedule matters: some worker's model differs from the aligned schedule's
    assert any(not np.array_equal(ref.worker_weights[i][key].asnumpy(),
                                  aligned.worker_weights[i][key].asnumpy())
               for i in range(1, n) for key in SHAPES)
    for i in range(n):
        job.machines[i].finish()
        for key in SHAPES:
            np.testing.assert_array_equal(job.weights[i][key].asnumpy(),
                                          ref.global_weights[key].asnumpy())


def test_staggered_pulls_refuse_a_quorum():
    from ssdsgd.settings import SettingError
    with pytest.raises(SettingError, match="staggered works with SSDSGD_QUORUM: all only"):
        _env(num_workers=3, pull_schedule="staggered", quorum="majority")


def test_a_resumed_staggered_job_keeps_each_workers_phase():
    """The offsets are a function of rank, N and k, so a job resumed at step 7 requests
    on the same steps as the uninterrupted one."""
    whole = Job(3, algorithm="ssd", warmup_steps=2, delay_steps=3, local_rule="glu",
                pull_schedule="staggered").run(12)
    resumed = Job(3, algorithm="ssd", warmup_steps=2, delay_steps=3, local_rule="glu",
                  pull_schedule="staggered", start_step=7).run(5)

    def requests(job):
        return [[e[1] for e in c.log if e[0] == "push" and e[2] and e[1] >= 7]
                for c in job.clients]
    assert requests(resumed) == requests(whole) == [[7, 10], [9], [8, 11]]
