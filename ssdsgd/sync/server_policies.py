"""Which server policy a job's settings choose. The node wiring (``ssdsgd.node``) hands
``make_server_policy`` to the server, which calls it once it knows its rank: the
transport names no policy."""
from ..settings import count_or_auto, quorum_rounds
from .auto import K_MAX
from .averaging import GroupAverages
from .dense import Async, DenseSync
from .quorum import QuorumRounds
from .quorum_rules import quorum_rule
from .stage import steps_ahead_bound


def make_server_policy(env, rank):
    """The policy of server ``rank`` for the job ``env`` describes (a NodeEnv)."""
    # k auto is chosen by the workers at the end of the warm-up, at most K_MAX
    k = count_or_auto(env.delay_steps) or K_MAX
    n, steps_ahead = env.num_workers, steps_ahead_bound(env.algorithm, k)
    averaging = GroupAverages(n) if env.algorithm == "preduce" else None
    if env.algorithm == "asgd":
        return Async(n, steps_ahead, env.algorithm, averaging)
    if quorum_rounds(env.quorum, n):      # only the leader's rule decides (rounds.py)
        return QuorumRounds(n, steps_ahead, env.algorithm, averaging,
                            quorum=quorum_rule(env.quorum, n),
                            max_staleness=env.max_staleness, leader=rank == 0,
                            replicate=env.num_servers > 1)
    return DenseSync(n, steps_ahead, env.algorithm, averaging,
                     joins=(env.max_workers or 0) > n)
