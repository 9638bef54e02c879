"""What the worker's reset (spec step 3) costs on ResNet-50 (or -20) shapes, in process.

Times ``StageMachine._reset_to_pulled`` -- the code a steps-delay step runs right after a
pull -- with the real local rule (GLURule through ``make_local_rule``) and real CPU
NDArrays as the parameters; the pull's reply is KeyReply objects built from numpy
arrays, as the client hands them over (the reset itself never talks to a peer). Each
glu_state is first reset once (the key's first reset makes the local state), then reset
``--repeats`` times; a figure is the median and includes the wait for MXNet's engine.
The floor printed with it is one numpy memcpy of the bytes a reset must write (w_G into
the parameters and the momentum into the local state), into existing arrays.

    nice -n 19 python -m bench.reset_cost [--model resnet50|resnet20] [--repeats 5]
        [--states exact,corrected,estimate]
"""
import argparse
import math
import statistics
import time

import mxnet as mx
import numpy as np

from ssdsgd.kvstore.client import KeyReply
from ssdsgd.kvstore.env import NodeEnv
from ssdsgd.mxglue.optimizer_spec import describe
from ssdsgd.worker.machine import KeyRecord, StageMachine

from .common import machine_info


MODELS = {'resnet50': ('resnet50_v1', (1, 3, 224, 224)),      # bench/cluster's emulated
          'resnet20': ('cifar_resnet20_v1', (1, 3, 32, 32))}   # workloads, same shapes


def model_shapes(model):
    """Trainable parameter shapes of the gluoncv model (resnet50: 193 arrays, 25.6 M
    floats; resnet20: 65 arrays, 0.27 M floats)."""
    from gluoncv import model_zoo
    name, data_shape = MODELS[model]
    net = model_zoo.get_model(name, pretrained=False)
    net.initialize(mx.init.Zero())
    net(mx.nd.zeros(data_shape))
    return [p.shape for p in net.collect_params().values() if p.grad_req != 'null']


class _Client:
    """What StageMachine reads of its client outside a push or pull."""
    rank, num_workers, quorum, codes_pushes = 0, 4, False, False
    stats = {"time_blocked": 0.0}


class _Pulled:
    """A pull already answered: ``wait`` returns its replies (the client's Gather)."""

    def __init__(self, replies):
        self.replies = replies

    def wait(self):
        return self.replies


def _machine(glu_state, shapes, rng):
    env = NodeEnv.from_environ({"SSDSGD_SCHEDULER_PORT": "1", "SSDSGD_ROLE": "worker",
                                "SSDSGD_ALGORITHM": "ssd", "SSDSGD_WARMUP_STEPS": "0",
                                "SSDSGD_DELAY_STEPS": "5", "SSDSGD_LOCAL_RULE": "glu",
                                "SSDSGD_GLU_STATE": glu_state, "SSDSGD_NUM_WORKERS": "4"})
    machine = StageMachine(_Client(), env)
    machine.set_optimizer(describe(mx.optimizer.SGD(learning_rate=0.1, momentum=0.9,
                                                    wd=1e-4, rescale_grad=1 / 32)))
    for key, shape in enumerate(shapes):
        w = rng.standard_normal(math.prod(shape), dtype=np.float32)
        record = machine.keys[key] = KeyRecord(shape)
        record.remember(_reply(w, glu_state, rng, 0), -1)
        record.params = record.outs = [mx.nd.array(w.reshape(shape))]
    return machine


def _reply(value, glu_state, rng, version):
    state = [rng.standard_normal(value.size, dtype=np.float32) * 1e-3] \
        if glu_state == 'exact' else []
    return KeyReply(value, state, version, 0.1)


def _replies(machine, glu_state, rng, version):
    """A pull's replies: new global weights near the old ones (and the state, exact)."""
    out = {}
    for key, record in machine.keys.items():
        value = record.value + rng.standard_normal(record.value.size, dtype=np.float32) * 1e-3
        out[key] = _reply(value, glu_state, rng, version)
    return out


def time_resets(glu_state, shapes, repeats, seed=0):
    """Seconds of each of ``repeats`` resets after the keys' first one."""
    rng = np.random.default_rng(seed)
    machine = _machine(glu_state, shapes, rng)
    keys = list(machine.keys)
    machine._reset(keys)                     # the first reset: the local state is made
    mx.nd.waitall()
    times = []
    for r in range(repeats + 1):
        machine.t = 5 * (r + 1) + 1          # the pull of step t - 1, k = 5 steps after the last
        machine.pending = _Pulled(_replies(machine, glu_state, rng, machine.t))
        start = time.perf_counter()
        machine._reset_to_pulled()
        mx.nd.waitall()
        times.append(time.perf_counter() - start)
    return times[1:]                         # the first of them warms allocator and caches


def time_floor(shapes, repeats):
    """One numpy memcpy of the weights and of the momentum into existing arrays."""
    size = sum(math.prod(s) for s in shapes)
    src = np.ones(2 * size, dtype=np.float32)
    dst = np.zeros(2 * size, dtype=np.float32)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - start)
    return times[1:]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--repeats', type=int, default=5)
    ap.add_argument('--model', default='resnet50', choices=sorted(MODELS))
    ap.add_argument('--states', default='exact,corrected,estimate',
                    help='comma-separated glu_state values')
    args = ap.parse_args(argv)
    info = machine_info()
    shapes = model_shapes(args.model)
    size = sum(math.prod(s) for s in shapes)
    print(f"reset cost, {args.model} shapes: {len(shapes)} keys, {size / 1e6:.1f} M floats "
          f"({size * 4 / 1e6:.1f} MB); git {info.get('git', '?')}, load "
          f"{info.get('loadavg_start')}, median of {args.repeats}")
    floor = statistics.median(time_floor(shapes, args.repeats))
    print(f"{'floor: memcpy of w_G and the momentum':<40}{floor * 1e3:>8.1f} ms")
    for glu_state in args.states.split(','):
        times = time_resets(glu_state, shapes, args.repeats)
        med = statistics.median(times)
        print(f"{'reset, glu_state ' + glu_state:<40}{med * 1e3:>8.1f} ms ({med / floor:.1f}x "
              f"floor; min {min(times) * 1e3:.1f}, max {max(times) * 1e3:.1f})")


if __name__ == '__main__':
    main()
