"""Every setting of a job, defined once: the sync knobs and each process's SSDSGD_* variable.

One row per setting: its name (the attribute of ``NodeEnv``), its config key (``path``,
e.g. ``sync.delay_steps``; None: environment only), its variable (``env``; None: config
only), type, choices, default, bounds and doc. The config validator (``ssdsgd.config``),
the environment reader (``ssdsgd.kvstore.env.NodeEnv``), the launchers and the local rules
all read this table, so a value one of them accepts the others accept too; the settings
table in ``docs/training.md`` is generated from it (``markdown()``; a test compares).

Adding a setting is one row in SETTINGS (and a cross-field rule in CROSS_CHECKS if it
constrains another; if it turns a feature on, a feature of ssdsgd/sync/registry.py, whose
table of algorithms decides which combinations are refused): the config key, the NodeEnv
attribute, the variable the launcher writes and the documentation follow. This module
imports nothing from ssdsgd but that registry (itself a leaf): the transport (low) and
the config (high) both read it.

    values = read_env(os.environ)                     # {"delay_steps": "5", ...}
    to_env(num_workers=2, start_step=40)              # {"SSDSGD_NUM_WORKERS": "2", ...}
    BY_NAME["delay_steps"].check(0)         # SettingError: expected auto or an integer >= 1
"""
from __future__ import annotations

import difflib
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

from .sync.registry import join_refusal, quorum_members, quorum_rounds as _rounds, refusal

PREFIX = "SSDSGD_"


class SettingError(ValueError):
    """A value outside what its setting allows. The message is one line."""


class _Required:
    def __repr__(self):
        return "required"


REQUIRED = _Required()      # the default of a setting that has none
YAML_WORDS = {False: "off", True: "on"}   # what a bare off / on in a config file became


@dataclass(frozen=True)
class Setting:
    name: str
    type: type                          # int, float, str or bool
    default: Any
    doc: str
    env: Optional[str] = None           # the SSDSGD_* variable; None: config only
    path: Optional[str] = None          # the config key; None: environment only
    choices: tuple = ()
    min: Optional[float] = None         # inclusive
    max: Optional[float] = None         # inclusive
    above: Optional[float] = None       # exclusive lower bound
    optional: bool = False              # None (unset) is allowed
    launcher: Optional[str] = None      # set by the launcher: the option that decides it
    validate: Optional[Callable[[Any], Optional[str]]] = None  # a str's form: error or None
    int_text: bool = False              # a str setting that also takes an integer
    form: Optional[str] = None          # what a validated str accepts, for the docs

    def expects(self) -> str:
        """What the setting accepts, as the end of "expected ..."."""
        if self.choices:
            return "one of " + ", ".join(map(str, self.choices))
        if self.form:
            return self.form
        what = {int: "an integer", float: "a number", str: "a non-empty string",
                bool: "true or false"}[self.type]
        bounds = " and ".join(f"{op} {bound!r}" for op, bound in (
            (">=", self.min), (">", self.above), ("<=", self.max)) if bound is not None)
        return f"{what} {bounds}" if bounds else what

    def check(self, value):
        """``value`` as the setting's type if it is allowed, else SettingError. Floats may
        be given as strings (PyYAML reads 1e-4 as one); ints must be ints."""
        if value is None and self.optional:
            return None
        wrong = SettingError(f"expected {self.expects()}")
        if self.choices:
            # YAML 1.1 (PyYAML) reads a bare off/on/no/yes as false/true: `pull_relay: off`
            # means the choice the user wrote, where the setting has it
            said = YAML_WORDS.get(value) if isinstance(value, bool) else value
            if said not in self.choices or isinstance(said, bool):
                raise wrong
            return said
        if self.int_text and isinstance(value, int) and not isinstance(value, bool):
            value = str(value)          # YAML's `quorum: 3` is the text "3"
        if self.type in (str, bool):
            if not isinstance(value, self.type) or value == "":
                raise wrong
            error = self.validate(value) if self.validate else None
            if error:
                raise SettingError(error)
            return value
        if isinstance(value, bool):
            raise wrong
        if self.type is float and isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                raise wrong from None
        if not isinstance(value, (int, float) if self.type is float else int):
            raise wrong
        if self.type is float:
            value = float(value)
            if not math.isfinite(value):
                raise SettingError("expected a finite number")
        if ((self.min is not None and value < self.min)
                or (self.above is not None and value <= self.above)
                or (self.max is not None and value > self.max)):
            raise wrong
        return value

    def parse(self, text: str):
        """The value of an environment variable. An integer may be written as an integral
        number (``500.0``: what a launcher that writes floats produces); a boolean as
        1/0, true/false or yes/no."""
        if self.type is bool:
            words = {"1": True, "true": True, "yes": True, "0": False, "false": False,
                     "no": False}
            if text.strip().lower() not in words:
                raise SettingError(f"expected {self.expects()} (or 1 or 0)")
            return words[text.strip().lower()]
        if self.type is int:
            try:
                value = int(text)
            except ValueError:
                try:
                    number = float(text)
                except ValueError:
                    raise SettingError(f"expected {self.expects()}") from None
                if not number.is_integer():
                    raise SettingError(f"expected {self.expects()}") from None
                value = int(number)
            return self.check(value)
        if self.int_text:
            try:
                number = float(text)
            except ValueError:
                pass
            else:
                if number.is_integer():         # "500.0", as for an int setting
                    text = str(int(number))
        return self.check(text)

    def format(self, value) -> str:
        """The environment text of ``value`` (parse(format(v)) == v)."""
        if self.type is float:
            return repr(float(value))
        if self.type is bool:
            return "1" if value else "0"
        return str(value)

    @property
    def section(self) -> Optional[str]:
        return self.path.split(".")[0] if self.path else None

    @property
    def key(self) -> Optional[str]:
        return self.path.split(".")[-1] if self.path else None


# sync.compression's codecs: name -> (its parameter, the test of the number after
# 'NAME:', what to say otherwise). The codecs are transport (ssdsgd/kvstore/codecs/, whose
# parse_setting reads the text), which this leaf cannot import: tests/test_codecs.py checks
# that this table names every registered codec and its parameter, and
# tests/test_compression.py that the two read every probe alike.
COMPRESSION_FORMS = {
    "2bit": ("threshold", lambda v: 5e-7 <= v < 3.4e38,
             "expected a 2bit threshold >= 5e-7 (MXNet's servers round it to 6 decimals) "
             "and below 3.4e38"),
    "topk": ("ratio", lambda v: 0 < v <= 1, "expected a topk ratio in (0, 1]"),
}


def _compression(text: str) -> Optional[str]:
    """sync.compression's form: none, or NAME[:X] for a codec of COMPRESSION_FORMS."""
    kind, sep, arg = text.partition(":")
    if (kind in ("none", "auto") or kind in COMPRESSION_FORMS) and not sep:
        return None
    if kind not in COMPRESSION_FORMS:
        forms = ["none", "auto"] + [f"{k}[:{p}]" for k, (p, _, _) in COMPRESSION_FORMS.items()]
        return f"expected {', '.join(forms[:-1])} or {forms[-1]}"
    try:
        value = float(arg)
    except ValueError:
        return f"expected a number after '{kind}:'"
    _, valid, message = COMPRESSION_FORMS[kind]
    return None if valid(value) else message


def parse_slowdown(text: str) -> dict:
    """debug.slowdown's form, checked (``ssdsgd.slowdown`` acts on it): ``none``;
    ``factor:R=F[,R=F...]`` (rank R's compute takes F >= 1 times as long);
    ``delay:R=S[,R=S...]`` (rank R sleeps S seconds per step before its push); or
    eager-SGD's ``random:D:R[:SEED]`` (each step, R ranks drawn with SEED sleep D s).
    Returns {"kind", "per_rank", "delay", "count", "seed"}; SettingError if malformed."""
    kind, sep, arg = text.partition(":")
    out = {"kind": kind, "per_rank": {}, "delay": 0.0, "count": 0, "seed": 0}
    if kind == "none" and not sep:
        return out
    if kind in ("factor", "delay") and arg:
        for item in arg.split(","):
            rank, eq, value = item.partition("=")
            try:
                r, v = int(rank), float(value)
            except ValueError:
                raise SettingError(f"expected {kind}:RANK=VALUE[,...]") from None
            low = 1.0 if kind == "factor" else 0.0
            if not eq or r < 0 or not low <= v <= 3600 or r in out["per_rank"]:
                raise SettingError(f"{kind}: expected distinct ranks >= 0 and values in "
                                   f"[{low:g}, 3600]")
            out["per_rank"][r] = v
        return out
    if kind == "random" and arg:
        parts = arg.split(":")
        try:
            delay, count = float(parts[0]), int(parts[1])
            seed = int(parts[2]) if len(parts) == 3 else 0
        except (ValueError, IndexError):
            raise SettingError("expected random:DELAY_S:RANKS[:SEED]") from None
        if len(parts) > 3 or not 0 <= delay <= 3600 or count < 1 or seed < 0:
            raise SettingError("random: expected a delay in [0, 3600] s, ranks >= 1 and a "
                               "seed >= 0")
        out.update(delay=delay, count=count, seed=seed)
        return out
    raise SettingError("expected none, factor:RANK=F[,...], delay:RANK=SECONDS[,...] or "
                       "random:DELAY_S:RANKS[:SEED]")


def _slowdown(text: str) -> Optional[str]:
    try:
        parse_slowdown(text)
    except SettingError as e:
        return str(e)
    return None


def _quorum(text: str) -> Optional[str]:
    """sync.quorum's form: all, majority, solo, auto or a positive integer Q."""
    if text in ("all", "majority", "solo", "auto") or (text.isdigit() and int(text) >= 1):
        return None
    return "expected all, majority, solo, auto or an integer >= 1"


def _ranks(text):
    """None, or why ``text`` is not comma-separated ranks."""
    if all(part.isdigit() and int(part) < (1 << 20) for part in text.split(",")):
        return None
    return f"expected comma-separated ranks, got {text!r}"


def _count(low: int, high: Optional[int] = None) -> Callable[[str], Optional[str]]:
    """The form of a count a job may choose itself: auto or an integer >= low (and <=
    high, if given)."""
    def check(text: str) -> Optional[str]:
        if text == "auto" or (text.isdigit() and low <= int(text)
                              and (high is None or int(text) <= high)):
            return None
        return f"expected auto or an integer >= {low}" + (
            f" and <= {high}" if high is not None else "")
    return check


def count_or_auto(text: str) -> Optional[int]:
    """A count setting's value (pipeline_pieces, delay_steps, ...): the integer, or None
    for auto."""
    return None if text == "auto" else int(text)


def quorum_size(text: str, num_workers: int) -> int:
    """Q, the distinct workers that close a round (docs/spec/quorum.md): N for all,
    floor(N/2) + 1 for majority, 1 for solo, min(Q, N) for an integer, N for auto (less
    the workers its rule excuses as the job goes)."""
    error = _quorum(text)
    if error:
        raise SettingError(f"sync.quorum: {error}")
    return quorum_members(text, num_workers)


def quorum_rounds(text: str, num_workers: int) -> bool:
    """Whether the job's pushes go into quorum rounds: auto, or a Q below N."""
    quorum_size(text, num_workers)
    return _rounds(text, num_workers)


SETTINGS = (
    # --- who is who: set by the launcher for every process
    Setting("role", str, "worker", "this process's part in the job", env="SSDSGD_ROLE",
            choices=("scheduler", "server", "worker"), launcher="for each process"),
    Setting("scheduler_host", str, "127.0.0.1", "where the scheduler listens",
            env="SSDSGD_SCHEDULER_HOST", launcher="its host"),
    Setting("scheduler_port", int, REQUIRED, "the scheduler's TCP port",
            env="SSDSGD_SCHEDULER_PORT", min=1, max=65535, launcher="--port"),
    Setting("rank", int, -1, "rank a worker or server asks for (-1: assigned in registration "
            "order; the local launcher sets it so log prefixes match)", env="SSDSGD_RANK",
            min=-1, launcher="for each process"),
    Setting("joining", bool, False, "this worker joins a running job at a step the "
            "servers decide (docs/spec/membership.md)", env="SSDSGD_JOINING",
            launcher="launch/dist.py --join"),
    Setting("node_host", str, "127.0.0.1", "address a server binds and advertises",
            env="SSDSGD_NODE_HOST", launcher="for each process"),
    # --- the cluster
    Setting("num_workers", int, 1, "number of worker processes N", env="SSDSGD_NUM_WORKERS",
            path="cluster.workers", min=1, launcher="-n"),
    Setting("num_servers", int, 1, "number of server processes S", env="SSDSGD_NUM_SERVERS",
            path="cluster.servers", min=1, launcher="-s"),
    Setting("launcher", str, "local", "how the processes are started (docs/launch.md); "
            "launch/dist.py --launcher overrides it", path="cluster.launcher",
            choices=("local", "ssh", "mpi", "slurm")),
    Setting("hosts", str, None, "hosts of the ssh and mpi launchers, Horovod's host[:slots] "
            "list, e.g. node1:2,node2:2 (or -H/--hostfile, --hosts)", path="cluster.hosts",
            optional=True),
    Setting("interface", str, None, "network interface whose address each process "
            "advertises (multi-host launchers); unset: the route to the scheduler",
            env="SSDSGD_INTERFACE", optional=True, launcher="--interface"),
    Setting("heartbeat_interval", float, 1.0, "seconds between a node's heartbeats",
            env="SSDSGD_HEARTBEAT_INTERVAL", path="cluster.heartbeat_interval",
            min=0.01, max=3600.0),
    Setting("heartbeat_timeout", float, 30.0, "seconds without a heartbeat before a node is "
            "presumed dead (at least twice the interval)", env="SSDSGD_HEARTBEAT_TIMEOUT",
            path="cluster.heartbeat_timeout", min=0.1, max=86400.0),
    Setting("stall_timeout", float, 300.0, "seconds a worker may go without a step while "
            "another worker is ahead of it (its heartbeats going) before it is treated as "
            "failed, so cluster.on_worker_failure applies; rank 0's validation does not "
            "count; and seconds every worker may stand still while one waits for a "
            "server's reply before that server is treated as failed; 0: never "
            "(docs/reliability.md)", env="SSDSGD_STALL_TIMEOUT",
            path="cluster.stall_timeout", min=0.0, max=86400.0),
    Setting("max_restarts", int, 0, "times the launcher restarts a job from its last "
            "checkpoint when a process dies (launch/dist.py --max-restarts overrides it; 0: "
            "the job fails)", path="cluster.max_restarts", min=0, max=1000),
    Setting("scheduler_restarts", int, 0, "times the launcher restarts a dead scheduler "
            "in place (same address, port and keys); the servers and workers reconnect, "
            "re-register and go on, none restarted (local and ssh launchers; 0: a dead "
            "scheduler ends the job; docs/reliability.md)", env="SSDSGD_SCHEDULER_RESTARTS",
            path="cluster.scheduler_restarts", min=0, max=100),
    Setting("scheduler_restart", int, 0, "which restart of the scheduler this process is "
            "(0: the first start); a restarted scheduler rebuilds the job from the nodes "
            "that re-register", env="SSDSGD_SCHEDULER_RESTART", min=0, max=100,
            launcher="when it restarts the scheduler"),
    Setting("servers_lost", str, None, "the servers (comma-separated ranks) the launcher "
            "saw die before it restarted the scheduler: with cluster.server_replicas the "
            "restarted scheduler does not wait for them and hands their keys to their "
            "backups", env="SSDSGD_SERVERS_LOST", optional=True, validate=_ranks,
            form="comma-separated ranks", launcher="when it restarts the scheduler"),
    Setting("on_worker_failure", str, "abort", "when a worker dies: abort the job, restart "
            "it from the last checkpoint (cluster.max_restarts times, 3 if that is 0) or "
            "continue without it (rank 0 too: the lowest rank left takes the chief's part; "
            "docs/reliability.md)",
            env="SSDSGD_ON_WORKER_FAILURE", path="cluster.on_worker_failure",
            choices=("abort", "restart", "continue")),
    Setting("max_workers", int, None, "the most workers the job may have had: spare ranks "
            "N..max_workers-1 that workers started later with launch/dist.py --join RUN_DIR "
            "take, and workers may leave with --leave RUN_DIR --rank R (ssgd, ssd; "
            "docs/spec/membership.md); unset: cluster.workers, no joining or leaving",
            env="SSDSGD_MAX_WORKERS", path="cluster.max_workers", min=1, optional=True),
    Setting("server_replicas", int, 0, "backups of each server's keys on another server "
            "(0 or 1; 1 needs 2 or more servers): a key's owner hands each update's sum to "
            "its backup before it answers the pulls of it (chain replication; the workers "
            "copy their requests to the backup, a push without its tensors), so a dead "
            "server's backup takes over its keys and the job goes on with no process "
            "restarted, then without replicas (docs/reliability.md)",
            env="SSDSGD_SERVER_REPLICAS", path="cluster.server_replicas", min=0, max=1),
    # --- the synchronization (docs/spec)
    Setting("algorithm", str, "ssd", "ssd (SSD-SGD), ssgd (like dist_sync), asgd (like "
            "dist_async), preduce (Prague's partial reduce: groups of sync.group_size "
            "ready workers average their models; docs/spec/preduce.md), localsgd (post-local "
            "SGD: after the warm-up the workers' own optimizer steps, their models averaged "
            "every sync.sync_period steps) or diloco (DiLoCo: the same, with the servers' "
            "Nesterov outer step on the mean model delta; docs/spec/localsgd_diloco.md)",
            env="SSDSGD_ALGORITHM", path="sync.algorithm",
            choices=("ssd", "ssgd", "asgd", "preduce", "localsgd", "diloco")),
    Setting("group_size", int, 2, "P: workers whose models one partial reduce averages "
            "(algorithm preduce; 2 <= P <= N)", env="SSDSGD_GROUP_SIZE",
            path="sync.group_size", min=2),
    Setting("sync_period", int, 4, "H: local steps between two model syncs after the "
            "warm-up (algorithms localsgd and diloco; docs/spec/localsgd_diloco.md)",
            env="SSDSGD_SYNC_PERIOD", path="sync.sync_period", min=1, max=1 << 20),
    Setting("outer_lr", float, 0.7, "diloco: the learning rate of the servers' outer "
            "Nesterov step on the mean model delta (DiLoCo's published value)",
            env="SSDSGD_OUTER_LR", path="sync.outer_lr", above=0.0, max=100.0),
    Setting("outer_momentum", float, 0.9, "diloco: the momentum of the servers' outer "
            "Nesterov step (DiLoCo's published value)", env="SSDSGD_OUTER_MOMENTUM",
            path="sync.outer_momentum", min=0.0, max=0.999),
    Setting("warmup_steps", str, "auto", "T_w: synchronous warm-up steps; auto: 5 % of the "
            "run (SSDSGD_TOTAL_STEPS), at least 4 and at most 500, or 100 if the run's length "
            "is unknown (docs/auto.md)", env="SSDSGD_WARMUP_STEPS", path="sync.warmup_steps",
            validate=_count(0), int_text=True, form="auto or an integer >= 0"),
    Setting("warmup_epochs", float, None, "if set, overrides warmup_steps: round(epochs x steps "
            "per epoch)", path="sync.warmup_epochs", min=0.0, optional=True),
    Setting("delay_steps", str, "auto", "k: pull period in steps; auto: rank 0 times the "
            "warm-up's steps and picks the smallest k from 2 to a cap set by the optimizer and lr "
            "(10, 5 or 2) whose pulls cost at most 10 % of a step (5 if the warm-up is too "
            "short to time, within the cap; docs/auto.md)",
            env="SSDSGD_DELAY_STEPS", path="sync.delay_steps", validate=_count(1),
            int_text=True, form="auto or an integer >= 1"),
    Setting("total_steps", int, None, "the run's length in steps, if known (ssdsgd's "
            "training program sets it; a script may): the auto warm-up is a share of it",
            env="SSDSGD_TOTAL_STEPS", min=1, optional=True),
    Setting("pull_schedule", str, "aligned", "when in each period of k steps a worker pulls "
            "(ssd): aligned (the spec: every worker at the same step) or staggered (worker i "
            "floor(i k / N) steps earlier, so the N pulls do not cross the servers' links as "
            "one burst; docs/spec/staggered_pulls.md)", env="SSDSGD_PULL_SCHEDULE",
            path="sync.pull_schedule", choices=("aligned", "staggered")),
    Setting("pull_relay", str, "auto", "how the weights that several workers pull at the "
            "same step reach them: off (every worker gets its copy from the servers, as "
            "ps-lite does), chain (a server sends one copy, to the lowest rank; each worker "
            "passes it on to the next, so a server's link carries one copy instead of N; same "
            "bytes, same results; docs/spec/pull_relay.md) or auto (chain where rank 0's "
            "warm-up timings show the pulls are not hidden behind compute, in an ssd job of "
            ">= 3 workers with aligned pulls, no quorum and no continue; docs/auto.md)",
            env="SSDSGD_PULL_RELAY", path="sync.pull_relay", choices=("auto", "off", "chain")),
    Setting("local_rule", str, "glu", "the worker's local update between pulls (docs/glu.md)",
            env="SSDSGD_LOCAL_RULE", path="sync.local_rule", choices=("glu", "sgd", "none")),
    Setting("glu_state", str, "exact", "glu's optimizer state at a reset: the servers' exact "
            "state (default: keeps SSGD's per-step progress, any optimizer, costs pull bytes "
            "only), estimated from the last two pulls, or the worker's own momentum corrected "
            "by the gap to the pulled weights (no extra bytes; estimate and corrected need "
            "sgd/nag with momentum > 0; measured in docs/glu.md)", env="SSDSGD_GLU_STATE", path="sync.glu_state",
            choices=("estimate", "exact", "corrected")),
    Setting("lr_local", float, None, "the local rule's lr; unset: the servers' lr",
            env="SSDSGD_LR_LOCAL", path="sync.lr_local", above=0.0, max=10.0, optional=True),
    Setting("compression", str, "none", "push compression, the Trainer's compression_params "
            "(docs/spec/compression.md): none, 2bit[:threshold] (MXNet's; default 0.5), "
            "topk[:ratio] (default 0.1) or auto (ssd: none, topk or 2bit, by the warm-up's "
            "timings and what coding costs; docs/auto.md)", path="sync.compression",
            validate=_compression),
    Setting("quorum", str, "all", "a round closes once this many distinct workers pushed "
            "to it (docs/spec/quorum.md): all (dist_sync), majority, solo, an integer Q, or "
            "auto (every worker but those server 0 measured persistently late, until they "
            "are on time again)",
            env="SSDSGD_QUORUM", path="sync.quorum", validate=_quorum,
            form="all, majority, solo, auto or an integer >= 1",
            int_text=True),
    Setting("max_staleness", int, 4, "with a quorum: a round closes only if every worker "
            "not in it holds weights at most this many of its pull periods old (rounds in "
            "ssgd, k rounds in ssd's steps delay; docs/spec/quorum.md)",
            env="SSDSGD_MAX_STALENESS", path="sync.max_staleness", min=1, max=1 << 20),
    # --- the data (docs/spec/dynamic_data.md)
    Setting("assignment", str, "auto", "who trains which batch of an epoch: static (each "
            "worker its own fixed shard, the same number of steps each), dynamic (the "
            "scheduler hands the epoch's batches to whichever worker asks next, so a fast "
            "worker trains more; needs a quorum below N, quorum auto or preduce) or auto "
            "(dynamic exactly then; docs/spec/dynamic_data.md)",
            path="data.assignment", choices=("auto", "static", "dynamic")),
    # --- checkpoints (docs/training.md)
    Setting("checkpoint_every_s", float, None, "also checkpoint mid-epoch once this many "
            "seconds have passed since the last checkpoint (rank 0's clock, looked at every "
            "train.log_interval steps); unset: at epoch ends only (train.checkpoint_every)",
            path="train.checkpoint_every_s", min=1.0, max=604800.0, optional=True),
    # --- the timeline (docs/training.md#the-timeline)
    Setting("timeline", bool, True, "every worker and server records its spans (worker: "
            "compute, step, push, pull, reset, local update, blocked, barrier, data; server: each "
            "message, apply, send, queue) into RUN_DIR/timeline/; the launcher merges them "
            "into timeline.json (Chrome trace) and timeline.png at the end and names the "
            "slowest rank (python -m ssdsgd.report RUN_DIR --timeline does it again); on: "
            "it costs well under 1 % of a step (docs/training.md#the-timeline)",
            env="SSDSGD_TIMELINE", path="train.timeline"),
    Setting("timeline_dir", str, None, "where a process writes its timeline; the launcher "
            "of a configured job sets it to RUN_DIR/timeline (with --, give it with --env, "
            "or nothing is recorded)", env="SSDSGD_TIMELINE_DIR", optional=True),
    # --- the servers' snapshots of the global model (ssdsgd/kvstore/snapshots.py)
    Setting("snapshot_every", int, 0, "every server copies its weights every this many "
            "updates into SSDSGD_SNAPSHOT_DIR (with the time and the pushes applied), so "
            "the global model can be tested off the workers' path (the benchmark's time "
            "to accuracy); 0: never", env="SSDSGD_SNAPSHOT_EVERY", min=0, max=1 << 30),
    Setting("snapshot_dir", str, None, "where the servers write SSDSGD_SNAPSHOT_EVERY's "
            "snapshots (unset: nowhere)", env="SSDSGD_SNAPSHOT_DIR", optional=True),
    # --- the machine's, not the job's (ssdsgd/mxglue/op_code_cache.py)
    Setting("cache_dir", str, None, "where a process keeps MXNet's compiled operator code "
            "between imports (docs/design.md, \"Start-up\"); unset: "
            "$XDG_CACHE_HOME/ssdsgd, else ~/.cache/ssdsgd; off: compiled in every process",
            env="SSDSGD_CACHE_DIR", optional=True),
    Setting("mxnet_import", str, "trimmed", "trimmed: while MXNet is imported, scikit-learn "
            "is left out (MXNet's deprecated FeedForward then derives from object), "
            "scipy.stats, scipy.sparse, OpenCV and requests load at their first use and "
            "distutils is the standard library's, about 0.9 CPU s less in every process "
            "(docs/design.md, \"Start-up\"); full: MXNet's own import",
            env="SSDSGD_MXNET_IMPORT", choices=("trimmed", "full")),
    # --- the transport
    Setting("bigarray_bound", int, 1_000_000, "arrays with more elements are split over all "
            "servers", env="SSDSGD_BIGARRAY_BOUND", min=1),
    Setting("max_message_bytes", int, 1 << 34, "the most data bytes a message to a server "
            "may carry; below it, the job's limit is what worker 0's model needs (8 x its "
            "bytes) once its store is given the model (by a Trainer or Module, before its "
            "first message to a server; the servers bind their ports with it, and a bigger "
            "frame is refused unbuffered, at its size header); a worker's pull relay takes "
            "pieces of at most 2 MiB whatever this is (docs/reliability.md)",
            env="SSDSGD_MAX_MESSAGE_BYTES", min=1, max=1 << 62),
    Setting("chunk_bytes", int, 4 << 20, "a server's part of a step is sent in messages of "
            "about this size (pipelining)", env="SSDSGD_CHUNK_BYTES", min=1),
    Setting("pipeline_pieces", str, "auto", "a server's part of a step smaller than "
            "chunk_bytes is still cut into this many messages (of >= 128 KB), so the server "
            "answers the first while the rest arrive: pays on slow links, costs server CPU per "
            "message on fast ones; auto: each worker times its first steps with 1, 4 and 8 "
            "and keeps the fastest (docs/benchmarks/small_steps.md)",
            env="SSDSGD_PIPELINE_PIECES", validate=_count(1, 64), int_text=True,
            form="auto or an integer >= 1 and <= 64"),
    Setting("start_step", int, 0, "the worker's first global step (a resumed job continues "
            "the stage schedule; the launcher sets it from the checkpoint)",
            env="SSDSGD_START_STEP", min=0),
    Setting("secret_file", str, None, "this process's keys, a 0600 file the launcher "
            "makes for each process of a job (its own secret, the others' public halves); "
            "only the job's processes can connect, each as its own role and rank (unset: "
            "anyone can; docs/reliability.md)", env="SSDSGD_SECRET_FILE", optional=True,
            launcher="a fresh file per process and job, CURVE keys with --secure"),
    Setting("status_file", str, None, "where the scheduler records who registered, who "
            "finished and why it aborted, for the launcher's exit code (unset: nowhere)",
            env="SSDSGD_STATUS_FILE", optional=True,
            launcher="a file beside the job's keys"),
    # --- debugging
    Setting("slowdown", str, "none", "straggler injection, off by default (none): "
            "factor:RANK=F[,...] (compute F times as long), delay:RANK=SECONDS[,...] or "
            "eager-SGD's random:DELAY_S:RANKS[:SEED] (docs/training.md); the run's summary "
            "names it", env="SSDSGD_SLOWDOWN", path="debug.slowdown", validate=_slowdown),
    Setting("tamper_relay", int, None, "TEST ONLY, never for a real job: the worker of "
            "this rank alters every piece of a relayed reply it passes on (a forged relay), "
            "so a test can check that the next worker refuses it and names the sender "
            "(docs/spec/pull_relay.md); unset: nobody does", env="SSDSGD_TAMPER_RELAY",
            min=0, optional=True),
    Setting("drop_relay", int, None, "TEST ONLY, never for a real job: the worker of this "
            "rank passes on no piece of a relayed reply (a relay that holds the chain up), "
            "so a test can check that the next worker names it within "
            "cluster.heartbeat_timeout (docs/spec/pull_relay.md); unset: nobody does",
            env="SSDSGD_DROP_RELAY", min=0, optional=True),
)
BY_NAME = {s.name: s for s in SETTINGS}
BY_ENV = {s.env: s for s in SETTINGS if s.env}
BY_PATH = {s.path: s for s in SETTINGS if s.path}


def dynamic_data(assignment: str, algorithm: str, quorum: str, num_workers: int) -> bool:
    """Does data.assignment hand out batches dynamically (docs/spec/dynamic_data.md)?
    auto: exactly when rounds may close without some workers (Q < N, or quorum auto)
    or the algorithm is preduce, the modes in which a worker's steps need not match the
    others'."""
    if assignment == "static":
        return False
    if assignment == "dynamic":
        return True
    return algorithm == "preduce" or quorum_rounds(quorum, num_workers)


def _dynamic_needs_uneven_steps(values: Mapping, label: Callable[[str], str]) -> Optional[str]:
    """dynamic data gives workers different numbers of steps: only quorum rounds (rule 4:
    a worker's end) and preduce's groups take that; ssgd/ssd with every worker in every
    step would wait for the step a worker never takes, and asgd is not tested with it.
    Its checkpoints are at epoch ends and at the dealer's pauses (the chunk cursor at a
    barrier all reach)."""
    algorithm, quorum, n = (values.get("algorithm"), values.get("quorum"),
                            values.get("num_workers"))
    if (algorithm == "preduce" and values.get("checkpoint_every_s")
            and values.get("assignment") in ("dynamic", "auto")):
        return (f"{label('algorithm')}: preduce takes checkpoints at epoch ends only; unset "
                f"{label('checkpoint_every_s')} (its jobs are not resumed, and its groups do "
                "not meet the dealer's pause: docs/spec/dynamic_data.md)")
    if values.get("assignment") != "dynamic":
        return None
    if algorithm != "preduce" and quorum is not None and n is not None and not _quorum(
            str(quorum)) and not quorum_rounds(str(quorum), n):
        return (f"{label('assignment')}: dynamic works with {label('quorum')} below the "
                f"{n} workers or {label('algorithm')}: preduce only, got {algorithm} with "
                f"quorum {quorum} (every step waits for every worker, and dynamic data "
                "gives them different numbers of steps)")
    return None


def _heartbeats(values: Mapping, label: Callable[[str], str]) -> Optional[str]:
    """A node sends a heartbeat every interval and looks every half interval, so a live
    node can be silent for 1.5 intervals: a shorter timeout declares it dead."""
    interval, timeout = values.get("heartbeat_interval"), values.get("heartbeat_timeout")
    if interval is not None and timeout is not None and timeout < 2 * interval:
        return (f"{label('heartbeat_timeout')}: expected at least twice "
                f"{label('heartbeat_interval')} ({interval:g} s), got {timeout:g} (a live "
                "node can be silent for 1.5 intervals)")
    return None


def _replicas(values: Mapping, label: Callable[[str], str]) -> Optional[str]:
    """A backup lives on another server: replicas need two servers or more."""
    replicas, servers = values.get("server_replicas"), values.get("num_servers")
    if replicas and servers is not None and servers < 2:
        return (f"{label('server_replicas')}: {replicas} needs {label('num_servers')} of "
                f"2 or more (a key's backup lives on another server), got {servers}")
    return None


def _joins(values: Mapping, label: Callable[[str], str]) -> Optional[str]:
    """cluster.max_workers above the workers takes joiners: at least N, and only where
    the registry of algorithms says a join is handled (ssdsgd/sync/registry.py)."""
    most, n = values.get("max_workers"), values.get("num_workers")
    if most is None or n is None or most == n:
        return None
    if most < n:
        return (f"{label('max_workers')}: expected at least {label('num_workers')} ({n}), "
                f"got {most}")
    return join_refusal(values, label)


def _group_size(values: Mapping, label: Callable[[str], str]) -> Optional[str]:
    """A partial reduce needs P workers that exist (docs/spec/preduce.md)."""
    size, workers = values.get("group_size"), values.get("num_workers")
    if (values.get("algorithm") == "preduce" and size is not None and workers is not None
            and size > workers):
        return (f"{label('group_size')}: expected at most {label('num_workers')} "
                f"({workers}) workers per group, got {size}")
    return None


# Rules over several settings: f(values by name, label) -> one-line error or None, where
# label(name) is how the caller names a setting (its config key or its variable).
def _slowdown_ranks(values: Mapping, label: Callable[[str], str]) -> Optional[str]:
    """debug.slowdown may only name the job's workers: its first ones and, with
    cluster.max_workers above them, the spare ranks joiners take."""
    text, n = values.get("slowdown"), values.get("num_workers")
    if not text or n is None:
        return None
    most = max(n, values.get("max_workers") or n)
    spec = parse_slowdown(text)
    if any(r >= most for r in spec["per_rank"]) or spec["count"] > most:
        which = "max_workers" if most > n else "num_workers"
        return (f"{label('slowdown')}: {text!r} names ranks beyond the job's {most} "
                f"workers ({label(which)})")
    return None


def _combinations(values: Mapping, label: Callable[[str], str]) -> Optional[str]:
    """An algorithm with a feature it does not take, or two features that do not go
    together: the registry of algorithms decides (ssdsgd/sync/registry.py)."""
    return refusal(values, label)


CROSS_CHECKS = (_heartbeats, _group_size, _replicas, _slowdown_ranks, _combinations,
                _dynamic_needs_uneven_steps, _joins)


def cross_check(values: Mapping, label: Callable[[str], str]) -> None:
    for rule in CROSS_CHECKS:
        error = rule(values, label)
        if error:
            raise SettingError(error)


def env_value(row: Setting, env: Mapping[str, str]):
    """One variable's value: its row's default when it is unset or empty, else parsed
    against the row (an error names the variable and what it holds)."""
    raw = env.get(row.env)
    if raw is None or raw == "":
        return row.default
    try:
        return row.parse(raw)
    except SettingError as e:
        raise SettingError(f"{row.env}={raw!r}: {e}") from None


def read_env(env: Mapping[str, str], *, partial: bool = False) -> dict:
    """Every variable's value by setting name (defaults for unset or empty ones), checked
    against its row and the cross-field rules. ``partial``: a missing required variable is
    left out instead of an error (a launcher checking before it has chosen a port)."""
    values = {}
    for s in BY_ENV.values():
        if s.default is REQUIRED and not env.get(s.env):
            if partial:
                continue
            raise SettingError(f"{s.env} is not set; it is required ({s.doc})")
        values[s.name] = env_value(s, env)
    cross_check(values, lambda name: BY_NAME[name].env)
    return values


def to_env(**values) -> dict[str, str]:
    """The variables for settings given by name (checked; None values left out): the one
    way SSDSGD_* variables are written."""
    env = {}
    for name, value in values.items():
        s = BY_NAME[name]
        if value is None:
            continue
        if s.env is None:
            raise SettingError(f"{name} has no environment variable (config key {s.path})")
        try:
            value = s.check(value)
        except SettingError as e:
            raise SettingError(f"{s.env}={value!r}: {e}") from None
        env[s.env] = s.format(value)
    return env


def check_launch_env(extra: Mapping[str, str], owned: Mapping[str, str],
                     inherited: Optional[Mapping[str, str]] = None) -> None:
    """Before a launcher starts anything: ``extra`` (the user's ``--env``) may not name an
    unknown SSDSGD_* variable nor change one the launcher sets (``owned``, its own values),
    and what every process will read (inherited < extra < owned) must be valid."""
    for key, raw in extra.items():
        s = BY_ENV.get(key)
        if s is None and key.startswith(PREFIX):
            close = difflib.get_close_matches(key, list(BY_ENV), n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            raise SettingError(f"--env {key}={raw}: unknown setting ({hint}see "
                               "docs/training.md)")
        if s is None or s.launcher is None:
            continue
        if key not in owned:
            raise SettingError(f"--env {key}={raw}: the launcher sets {key} ({s.launcher}); "
                               "remove it")
        try:
            same = s.parse(raw) == s.parse(owned[key])
        except SettingError as e:
            raise SettingError(f"--env {key}={raw!r}: {e}") from None
        if not same:
            raise SettingError(f"--env {key}={raw}: conflicts with {s.launcher} {owned[key]} "
                               f"(the launcher sets {key}; use {s.launcher})")
    merged = {k: v for k, v in (inherited or {}).items()
              if k in BY_ENV and not BY_ENV[k].launcher}
    merged.update(extra)
    merged.update(owned)
    read_env(merged, partial=True)


def markdown() -> str:
    """The settings table of docs/training.md."""
    def cell(text):
        return str(text).replace("|", "\\|")

    def default(s):
        if s.default is None or s.default is REQUIRED:
            return "unset" if s.default is None else "required"
        if s.type is int and s.default >= 1024 and s.default & (s.default - 1) == 0:
            return f"2^{s.default.bit_length() - 1}"
        return f"`{s.default}`"
    lines = ["| config key | variable | default | allowed | meaning |", "|---|---|---|---|---|"]
    for s in SETTINGS:
        allowed = s.expects().removeprefix("an ").removeprefix("a ")
        meaning = s.doc + (f"; set by the launcher ({s.launcher})" if s.launcher else "")
        lines.append("| " + " | ".join(cell(c) for c in (
            f"`{s.path}`" if s.path else "-", f"`{s.env}`" if s.env else "-", default(s),
            allowed, meaning)) + " |")
    return "\n".join(lines) + "\n"
