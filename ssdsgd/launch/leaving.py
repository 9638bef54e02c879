"""Workers that leave a running job (docs/spec/membership.md): the launcher's half.

``launch/dist.py --leave RUN_DIR --rank R`` (and the host-discovery script, for a
removed host's workers) asks the job's scheduler for worker R to leave. It dials the
scheduler with worker R's own key (``join.json`` lists the key file of every rank, 0
too), so only who may act as worker R can make it go. The scheduler decides the step as
for a join, the worker pushes the steps before it and ends its part, and the others
go on with its chunks (rule 7). Nothing here signals a process: the worker ends itself.
"""
import sys
import time

import zmq

from ..kvstore import protocol as P, sealing
from ..kvstore.env import NodeEnv
from ..kvstore.security import ENV_VAR, Guard
from ..settings import to_env
from .joining import JoinRefused, read

WAIT_S = 60.0      # for the decision: every server answers within a step or two


class LeaveRefused(JoinRefused):
    """A departure this job cannot take (one line)."""


def leave(run_dir, rank, wait_s=WAIT_S):
    """Ask the job of ``run_dir`` for worker ``rank`` to leave; the step from which it
    pushes no more. LeaveRefused in one line: no such job or rank, refused by the
    scheduler (its reason), or no answer within ``wait_s``."""
    data = read(run_dir)
    key_file = data["workers"].get(str(rank))
    if key_file is None:
        why = (f"the job has no worker {rank} (ranks {min(map(int, data['workers']))}.."
               f"{max(map(int, data['workers']))})")
        raise LeaveRefused(f"--leave {run_dir} --rank {rank}: {why}")
    env = NodeEnv.from_environ(dict(data["env"], **to_env(role="worker", rank=rank),
                                **{ENV_VAR: key_file}))
    guard = Guard.from_env(env, lambda text: print(f"ssdsgd leave: {text}", file=sys.stderr,
                                                   flush=True))
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        guard.client(sock)
        where = f"{env.scheduler_host}:{env.scheduler_port}"
        sock.connect(f"tcp://{where}")
        channel = sealing.of(sock)
        sock.send_multipart(channel.seal(P.control(P.Kind.LEAVE, {"leaving": rank})))
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if not sock.poll(200):
                continue
            try:
                msg = P.receive(channel.open(sock.recv_multipart(copy=False)), max_bytes=0)
            except (P.ProtocolError, sealing.SealError) as e:
                raise LeaveRefused(f"--leave {run_dir}: the scheduler at {where} sent a "
                                   f"malformed message ({e})") from None
            if msg.kind == P.Kind.ERROR:
                raise LeaveRefused(f"--leave {run_dir}: {msg.meta['error']}")
            if (msg.kind == P.Kind.LEAVE and msg.meta.get("leaving") == rank
                    and "from_step" in msg.meta):
                return msg.meta["from_step"]
        raise LeaveRefused(f"--leave {run_dir} --rank {rank}: no decision from the scheduler "
                           f"at {where} within {wait_s:g} s (the job ended, or it does not "
                           "run)")
    finally:
        sock.close(0)
        guard.close()


def leave_form(args):
    """``--leave RUN_DIR --rank R``: exit 0 once the job decided, 2 with one line if not."""
    try:
        step = leave(args.leave, args.rank)
    except JoinRefused as e:
        print(f"launch/dist.py: error: {e}", file=sys.stderr)
        return 2
    print(f"[launcher] worker {args.rank} leaves the job of {args.leave} at step {step}; "
          "the others go on", file=sys.stderr, flush=True)
    return 0


def worker_keys(key_files, max_workers):
    """What ``join.json`` lists for ``--leave``: every worker rank's key file."""
    return {str(r): key_files[f"worker {r}"] for r in range(max_workers)}

