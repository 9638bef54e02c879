"""Entry point of the non-worker roles: ``python -m ssdsgd.node`` runs the scheduler or a
server, as SSDSGD_ROLE says (the launcher sets it; workers run the training script)."""
import os
import sys

from .kvstore.env import EnvError, NodeEnv
from .kvstore.scheduler import JobAborted, Scheduler
from .kvstore.security import SecurityError


def _scheduler(env):
    from .sync.scheduler_policies import make_scheduler_policy
    from .sync.stage import joins_boundary
    return Scheduler(env, make_scheduler_policy, join_boundary=joins_boundary(env))


def _server(env):
    from .kvstore.server_node import ServerNode   # MXNet (its optimizers): servers only
    from .sync.server_policies import make_server_policy
    return ServerNode(env, make_server_policy)


ROLES = {"scheduler": _scheduler, "server": _server}


def main():
    role = os.environ.get("SSDSGD_ROLE")
    if role not in ROLES:
        print(f"ssdsgd.node: SSDSGD_ROLE must be scheduler or server, not {role!r} "
              "(workers run the training script itself)", file=sys.stderr)
        return 2
    try:
        node = ROLES[role](NodeEnv.from_environ())
    except (EnvError, JobAborted, SecurityError) as e:
        print(f"ssdsgd {role}: {e}", file=sys.stderr)
        return 2
    try:
        return node.run()
    except JobAborted as e:     # the message names the cause (a dead peer, ...)
        if not e.said:
            node.log(str(e))
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        node.close()


if __name__ == "__main__":
    sys.exit(main())
