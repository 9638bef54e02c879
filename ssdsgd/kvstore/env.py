"""How a process learns its part in the job: SSDSGD_* environment variables.

MXNet's own launcher configures ps-lite nodes through DMLC_*; ssdsgd does the same with its
own names (docs/design.md), so a worker can be started by any launcher, and ``DMLC_ROLE``
is never needed (it would turn the process into a ps-lite node at ``import mxnet``).
"""
import dataclasses
import os

ALGORITHMS = ("ssd", "ssgd", "asgd")
LOCAL_RULES = ("glu", "sgd", "none")
GLU_STATES = ("estimate", "exact")
ROLES = ("scheduler", "server", "worker")


class EnvError(ValueError):
    """A missing or malformed SSDSGD_* variable."""


def _get(env, name, cast, default, check=None, what=None):
    raw = env.get(name)
    if raw is None or raw == "":
        if default is _REQUIRED:
            raise EnvError(f"{name} is not set; it is required ({what})")
        return default
    try:
        value = cast(raw)
    except ValueError:
        raise EnvError(f"{name}={raw!r}: expected {what or cast.__name__}") from None
    if check is not None and not check(value):
        raise EnvError(f"{name}={raw!r}: expected {what}")
    return value


_REQUIRED = object()


@dataclasses.dataclass(frozen=True)
class NodeEnv:
    role: str
    scheduler_host: str
    scheduler_port: int
    num_workers: int
    num_servers: int
    rank: int            # -1: let the scheduler assign one
    node_host: str
    algorithm: str
    warmup_steps: int
    delay_steps: int
    local_rule: str
    glu_state: str
    lr_local: float | None
    heartbeat_interval: float
    heartbeat_timeout: float
    bigarray_bound: int
    max_message_bytes: int
    start_step: int
    chunk_bytes: int
    secret_file: str | None = None   # the job's keys (0600 file; kvstore/security.py)

    @classmethod
    def from_environ(cls, env=None):
        env = os.environ if env is None else env
        def choice(name, options, default):
            return _get(env, name, str, default, lambda v: v in options,
                        "one of " + ", ".join(options))
        def positive(name, cast, default, minimum=1):
            return _get(env, name, cast, default, lambda v: v >= minimum,
                        f"{'an integer' if cast is int else 'a number'} >= {minimum}")
        return cls(
            role=choice("SSDSGD_ROLE", ROLES, "worker"),
            scheduler_host=_get(env, "SSDSGD_SCHEDULER_HOST", str, "127.0.0.1"),
            scheduler_port=_get(env, "SSDSGD_SCHEDULER_PORT", int, _REQUIRED,
                                lambda v: 0 < v < 65536, "a TCP port 1-65535"),
            num_workers=positive("SSDSGD_NUM_WORKERS", int, 1),
            num_servers=positive("SSDSGD_NUM_SERVERS", int, 1),
            rank=_get(env, "SSDSGD_RANK", int, -1, lambda v: v >= 0, "an integer >= 0"),
            node_host=_get(env, "SSDSGD_NODE_HOST", str, "127.0.0.1"),
            algorithm=choice("SSDSGD_ALGORITHM", ALGORITHMS, "ssd"),
            warmup_steps=positive("SSDSGD_WARMUP_STEPS", int, 500, 0),
            delay_steps=positive("SSDSGD_DELAY_STEPS", int, 5),
            local_rule=choice("SSDSGD_LOCAL_RULE", LOCAL_RULES, "glu"),
            glu_state=choice("SSDSGD_GLU_STATE", GLU_STATES, "estimate"),
            lr_local=_get(env, "SSDSGD_LR_LOCAL", float, None, lambda v: v > 0, "a number > 0"),
            heartbeat_interval=positive("SSDSGD_HEARTBEAT_INTERVAL", float, 1.0, 0.01),
            heartbeat_timeout=positive("SSDSGD_HEARTBEAT_TIMEOUT", float, 30.0, 0.1),
            bigarray_bound=positive("SSDSGD_BIGARRAY_BOUND", int, 1_000_000),
            max_message_bytes=positive("SSDSGD_MAX_MESSAGE_BYTES", int, 1 << 34),
            start_step=positive("SSDSGD_START_STEP", int, 0, 0),
            chunk_bytes=positive("SSDSGD_CHUNK_BYTES", int, 4 << 20),
            secret_file=_get(env, "SSDSGD_SECRET_FILE", str, None),
        )
