"""A worker for the cluster tests: trains tests/scripts/tiny.py's network with the stock
gluon.Trainer on kvstore='ssd_sync' and writes what the tests check into --out."""
import argparse
import json
import os
import signal
import sys
import time

import mxnet as mx
import numpy as np
from mxnet import gluon

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ssdsgd  # noqa: E402,F401  (registers ssd_sync)
import tiny  # noqa: E402
from cues import wait_for_file  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--steps", type=int, default=10)
p.add_argument("--start-step", type=int, default=0)
p.add_argument("--net", default="mlp")
p.add_argument("--optimizer", default="sgd")
p.add_argument("--opt-params", default='{"learning_rate": 0.1, "momentum": 0.9}')
p.add_argument("--kv-instance", action="store_true", help="pass mx.kv.create('ssd_sync')")
p.add_argument("--save-at", type=int, default=-1, help="save params and trainer states after this step")
p.add_argument("--load", default=None, help="directory with params/states to resume from")
p.add_argument("--custom-optimizer", action="store_true")
p.add_argument("--stop-at", type=int, default=-1, help="rank 1 SIGSTOPs itself at this step")
p.add_argument("--compression", default=None, help="JSON: the Trainer's compression_params")
p.add_argument("--mark-at", type=int, default=-1, help="each worker writes the file "
               "at-step-T-rank<R> into --out before its step T (a test's cue)")
p.add_argument("--hold-at", type=int, default=-1, help="every worker waits before its step "
               "T until the file 'release' is in --out (at most 300 s): the job is still "
               "running while a test probes it")
p.add_argument("--delays", default="{}", help='JSON {rank: seconds}: sleep before each step '
               "(a straggler whose lateness fixes the arrival order)")
args = p.parse_args()

# Under launch/dist.py the scheduler grants each worker the rank the launcher asked for.
rank = int(os.environ["SSDSGD_RANK"])
os.makedirs(args.out, exist_ok=True)
with open(os.path.join(args.out, f"pid-rank{rank}"), "w") as f:
    f.write(str(os.getpid()))
net = tiny.make_net(args.net)
opt, opt_params = args.optimizer, json.loads(args.opt_params)
if args.custom_optimizer:
    @mx.optimizer.Optimizer.register
    class HomeMadeSGD(mx.optimizer.SGD):
        pass
    opt, opt_params = HomeMadeSGD(learning_rate=0.1), None
kv = mx.kv.create("ssd_sync") if args.kv_instance else "ssd_sync"
trainer = gluon.Trainer(net.collect_params(), opt, opt_params, kvstore=kv,
                        compression_params=json.loads(args.compression) if args.compression
                        else None)
if args.load:
    net.load_parameters(os.path.join(args.load, "params.bin"))
    trainer.load_states(os.path.join(args.load, f"states-rank{rank}.bin"))
losses = []
delay = json.loads(args.delays).get(str(rank), 0.0)
if args.delays != "{}":
    # The Trainer creates its store (set_optimizer ends in a barrier of all workers) at
    # its first step; done here, so a delayed rank is late from step 0 on. First the
    # gradient scale that step would set: on a distributed store MXNet's Trainer refuses
    # a step whose batch size differs from the one the optimizer was sent with.
    trainer._optimizer.rescale_grad = trainer._scale / tiny.batch(rank, 0)[0].shape[0]
    trainer._init_kvstore()
for t in range(args.start_step, args.start_step + args.steps):
    time.sleep(delay)
    if t == args.mark_at:
        open(os.path.join(args.out, f"at-step-{t}-rank{rank}"), "w").close()
    if t == args.hold_at and not wait_for_file(os.path.join(args.out, "release"), 300):
        sys.exit(f"rank {rank}: nobody released the hold at step {t} within 300 s")
    if t == args.stop_at and rank == 1:
        print("rank 1 stops (SIGSTOP): alive but silent, like a hung machine", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
    x, y = tiny.batch(rank, t)
    losses.append(tiny.forward_backward(net, x, y))
    trainer.step(x.shape[0])
    if t == args.save_at:
        trainer.save_states(os.path.join(args.out, f"states-rank{rank}.bin"))
        if rank == 0:
            net.save_parameters(os.path.join(args.out, "params.bin"))
store = trainer._kvstore
assert store.rank == rank, (store.rank, rank)
np.savez(os.path.join(args.out, f"local-rank{rank}.npz"),
         **{f"p{i}": q.data().asnumpy() for i, q in enumerate(tiny.params(net))})
metrics = store.metrics()
store.close()   # steps-delay stage: every worker ends on the global weights
np.savez(os.path.join(args.out, f"final-rank{rank}.npz"),
         **{f"p{i}": q.data().asnumpy() for i, q in enumerate(tiny.params(net))})
with open(os.path.join(args.out, f"info-rank{rank}.json"), "w") as f:
    json.dump({"kvstore_type": type(store).__name__, "update_on_kvstore": trainer._update_on_kvstore,
               "metrics": metrics, "losses": losses,
               "groups": [[g, list(m)] for g, m in store.groups]}, f)
print(f"rank {rank} done: loss {losses[0]:.4f} -> {losses[-1]:.4f}", flush=True)
