"""A worker of a job that workers join or leave (docs/spec/membership.md): tiny.py's
network on ssd_sync with the stock gluon.Trainer, each step's batch the chunk
``Membership`` gives this rank (rule 7: the members in rank order train the next global
chunks), the joins and departures read from the servers' replies (``kv.joins_before``,
``kv.leaves_before``); a worker that leaves stops at its step. Started as one of the first
workers, or by ``launch/dist.py --join`` (``kv.joined_from``: its first step). The first
workers wait before step ``--wait-at`` until the file ``--go`` exists (bounded), so a
test can have a joiner ask while the job runs; worker ``--die-rank`` SIGKILLs itself
before step ``--die-at`` once every step before it is applied (it writes nothing);
``--pace`` slows the steps from ``--wait-at`` on (timing only).
Writes the chunks it trained, the step it joined at, the T_w and k it ran with, the
removals it heard of, its local weights before its end and the final ones."""
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
from ssdsgd.data import epoch_permutation  # noqa: E402
from ssdsgd.sync.membership import Membership  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--per-epoch", type=int, required=True, help="chunks per epoch")
p.add_argument("--epochs", type=int, required=True)
p.add_argument("--wait-at", type=int, default=-1)
p.add_argument("--go", default=None)
p.add_argument("--wait-rank", type=int, default=None, help="only this first worker waits")
p.add_argument("--compression", default=None, help="JSON: the Trainer's compression_params")
p.add_argument("--die-at", type=int, default=-1)
p.add_argument("--die-rank", type=int, default=None)
p.add_argument("--seed", type=int, default=0)
p.add_argument("--pace", type=float, default=0.0, help="seconds to sleep after each step "
               "from --wait-at on (timing only: no weight depends on it)")
p.add_argument("--lr-step", type=int, default=0, help="halve the lr every this many "
               "global batches (0: a constant lr)")
args = p.parse_args()

rank = int(os.environ["SSDSGD_RANK"])
net = tiny.make_net()
kv = mx.kv.create("ssd_sync")
n = kv.num_workers
sched = (mx.lr_scheduler.FactorScheduler(step=args.lr_step, factor=0.5, base_lr=0.1)
         if args.lr_step else None)
trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1, "momentum": 0.9,
                                                      "lr_scheduler": sched}, kvstore=kv,
                        compression_params=json.loads(args.compression) if args.compression
                        else None)
trainer._optimizer.rescale_grad = 1.0 / 8
trainer._init_kvstore()
start = kv.joined_from
data = tiny.ChunkData(args.per_epoch * 8)
members = Membership(n, args.per_epoch, args.per_epoch * args.epochs)
if start is not None:
    for r, s in sorted(kv.joins_before(start).items()):
        if r not in members.changes and r != rank:
            members.join(r, s)
    members.join(rank, start)
    if members.chunk(rank, start) is None:     # the budget is spent before step s
        print(f"rank {rank} joined at step {start}, after the job's last step "
              f"({members.end() - 1}): nothing to train", flush=True)
        kv.close()
        with open(os.path.join(args.out, f"chunks-rank{rank}.json"), "w") as f:
            json.dump({"chunks": [], "joined_from": start, "end": start}, f)
        sys.exit(0)
trainer._init_params()    # now, not at the first step: a joiner's first gradient is at w_G(s - 1)
if start is None:
    kv.barrier()
perms = {}
trained, t = [], start or 0
while True:
    if t == args.wait_at and start is None and args.go and args.wait_rank in (None, rank):
        mx.nd.waitall()        # every step before it pushed
        print(f"rank {rank} waits before step {t}", flush=True)
        if not wait_for_file(args.go, 60):
            sys.exit(f"rank {rank}: no {args.go} within 60 s")
    if t == args.die_at and rank == args.die_rank:
        mx.nd.waitall()        # every step before it applied (ssgd, ssd's warm-up pull it)
        print(f"rank {rank} dies before step {t}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    for r, s in sorted(kv.joins_before(t).items()):
        if r not in members.changes:
            members.join(r, s)
    for r, s in sorted(kv.leaves_before(t).items()):
        if members.changes.get(r, (0, None))[1] is None:
            members.leave(r, s)
    where = members.chunk(rank, t)
    if where is None:
        break
    epoch, chunk = where
    perm = perms.setdefault(epoch, epoch_permutation(data.n_train, epoch, args.seed))
    x, y = data.train_batch(perm[chunk * 8:(chunk + 1) * 8])
    trained.append(epoch * args.per_epoch + chunk)
    tiny.forward_backward(net, x, y)
    trainer.step(8)
    if args.pace and t >= args.wait_at:
        time.sleep(args.pace)
    t += 1
mx.nd.waitall()
chosen = {name: kv.metrics().get(name) for name in ("warmup_steps", "delay_steps",
                                                  "replies_relayed_in", "replies_relayed_out")}
removed = {str(w["rank"]): w["from_step"] for w in kv.metrics().get("left", [])}
np.savez(os.path.join(args.out, f"local-rank{rank}.npz"),
         **{f"p{i}": q.data().asnumpy() for i, q in enumerate(tiny.params(net))})
kv.close()
np.savez(os.path.join(args.out, f"final-rank{rank}.npz"),
         **{f"p{i}": q.data().asnumpy() for i, q in enumerate(tiny.params(net))})
with open(os.path.join(args.out, f"chunks-rank{rank}.json"), "w") as f:
    json.dump({"chunks": trained, "joined_from": start, "end": t, **chosen,
               "joins": {str(r): s for r, (s, _) in members.changes.items() if s},
               "leaves": {str(r): e for r, (_, e) in members.changes.items()
                          if e is not None},
               "removed": removed}, f)
print(f"rank {rank} done: {len(trained)} chunks, steps {start or 0}..{t - 1}", flush=True)
