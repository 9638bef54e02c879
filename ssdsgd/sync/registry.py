"""Every algorithm once: its server policy, its worker stage rule and the features it takes.

A feature (compression, relay, quorum, staggered pulls, the recovery modes restart and
continue, resume, checkpoints) is either taken by an algorithm, with the test that runs
the two together, or refused, with the reason; a pair of features likewise. The config
check, the environment check of every process and the kvstore's
``set_gradient_compression`` ask ``refusal``; nothing else polices a combination, and
``tests/test_combinations.py`` walks every algorithm x feature and checks that each named
test exists.

Pure data and small lookups over settings values by name (the rows of
``ssdsgd.settings``); this module imports nothing from ssdsgd, so the settings table
itself can ask it.

    refusal({"algorithm": "asgd", "quorum": "majority", "num_workers": 4}, label)
    # "sync.algorithm: asgd works with sync.quorum: all only, got 'majority' (...)"
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Optional


def quorum_members(text: str, num_workers: int) -> int:
    """Q for a well-formed sync.quorum (settings.quorum_size checks the form first); auto's
    is N, less the workers its rule excuses as it goes (sync/quorum_rules.py)."""
    if text in ("all", "auto"):
        return num_workers
    if text == "majority":
        return num_workers // 2 + 1
    return 1 if text == "solo" else min(int(text), num_workers)


def quorum_rounds(text: str, num_workers: int) -> bool:
    """Whether a job's pushes go into quorum rounds (docs/spec/quorum.md): auto, or a Q
    below N (all, and a Q of N, are dist_sync's steps)."""
    return text == "auto" or quorum_members(text, num_workers) < num_workers


# ---- features: when a job uses one ------------------------------------------------------
# on(values) -> (setting name, its value, what it must be instead) if the feature is on.

def _equals(setting, value, instead):
    def on(values):
        return (setting, value, instead) if values.get(setting) == value else None
    return on


def _compression(values):
    value = values.get("compression")
    return ("compression", value, "none") if value not in (None, "none") else None


def _quorum(values):
    text, n = values.get("quorum"), values.get("num_workers")
    if text in (None, "all") or not (text in ("majority", "solo", "auto")
                                      or str(text).isdigit()):
        return None
    if n is None:       # N not chosen yet (a benchmark row): a quorum for some N
        return ("quorum", text, "all")
    return ("quorum", text, "all") if quorum_rounds(str(text), n) else None


def _restart(values):
    if values.get("on_worker_failure") == "restart":
        return ("on_worker_failure", "restart", "abort or continue")
    if (values.get("max_restarts") or 0) > 0:
        return ("max_restarts", values["max_restarts"], "0")
    return None


def _positive(setting):
    def on(values):
        value = values.get(setting) or 0
        return (setting, value, "0") if value > 0 else None
    return on


@dataclass(frozen=True)
class Feature:
    name: str
    doc: str
    on: Callable[[Mapping], Optional[tuple]]


FEATURES = {f.name: f for f in (
    Feature("compression", "pushes compressed (sync.compression, or the Trainer's "
            "compression_params)", _compression),
    Feature("relay", "pulled weights passed on from worker to worker (sync.pull_relay: "
            "chain)", _equals("pull_relay", "chain", "off")),
    Feature("quorum", "rounds that close on fewer than N workers (sync.quorum below N, or "
            "auto)", _quorum),
    Feature("staggered", "pulls spread over each period (sync.pull_schedule: staggered)",
            _equals("pull_schedule", "staggered", "aligned")),
    Feature("restart", "a failed job restarted from its last checkpoint "
            "(cluster.on_worker_failure: restart, cluster.max_restarts)", _restart),
    Feature("continue", "the job goes on without a dead worker "
            "(cluster.on_worker_failure: continue)",
            _equals("on_worker_failure", "continue", "abort or restart")),
    Feature("scheduler_restart", "a dead scheduler restarted in place; the nodes "
            "re-register and go on (cluster.scheduler_restarts)",
            _positive("scheduler_restarts")),
    Feature("resume", "a job continued from a checkpoint (launch/dist.py --resume; "
            "SSDSGD_START_STEP > 0)", _positive("start_step")),
    Feature("checkpoint", "checkpoints written during the run (train.checkpoint_every)",
            _positive("checkpoint_every")),
    Feature("replicas", "each server's keys backed up on another server, which takes "
            "them over when it dies (cluster.server_replicas: 1)", _positive("server_replicas")),
)}


# ---- algorithms ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Algorithm:
    name: str
    server: str       # the server's policy: "sum" (a step's N pushes, then one update),
    #                   "each" (every push is an update) or "average" (groups' models)
    stage: str        # the worker's stage rule (ssdsgd.sync.stage.RULES)
    tested: Mapping[str, str]     # feature -> the test that runs it (file::name)
    refused: Mapping[str, str]    # feature -> why it is refused
    doc: str = ""
    outer: str = ""   # "periodic" stage: the servers' outer step on the mean model delta,
    #                   "average" (SGD lr 1: the mean model) or "nesterov" (DiLoCo's NAG)


_ORACLE = "tests/test_ssd_oracle.py::"
_RELAYED = _ORACLE + "test_relayed_pulls_equal_the_simulation"
_QUORUM = "tests/test_quorum.py::test_stragglers_end_with_the_simulators_weights"
_RESTART = ("tests/test_recovery.py::"
            "test_a_killed_process_is_restarted_and_the_job_ends_as_if_uninterrupted")
_CONTINUE = "tests/test_recovery.py::test_with_continue_a_killed_worker_leaves_and_the_job_finishes"
_SCHED = "tests/test_scheduler_restart.py::"
_SCHED_RESTART = _SCHED + "test_a_killed_scheduler_is_restarted_and_the_job_ends_as_if_uninterrupted"
_SCHED_COMPRESSED = _SCHED + "test_a_compressed_staggered_job_survives_its_schedulers_death"
_SCHED_RESUMED = _SCHED + "test_a_job_restarted_from_its_checkpoint_survives_its_schedulers_death"
_SCHED_PERIODIC = _SCHED + "test_a_model_averaging_job_survives_its_schedulers_death"
_REPLICAS = ("tests/test_replicas.py::"
             "test_a_killed_server_is_replaced_by_its_backup_and_the_job_ends_as_if_uninterrupted")
_ASGD_DIVERGES = ("a digits job resumed while its workers ran at different speeds "
                  "diverged; not supported until that is mended")
_NO_PERIOD = "every step waits for its weights: there is no pull period to stagger"
_PERIODIC = "tests/test_periodic_oracle.py::"
# localsgd and diloco (docs/spec/localsgd_diloco.md): what they refuse, and why
_PERIODIC_REFUSED = {
    "compression": "one codec setting would code the warm-up's gradients and the model "
                   "deltas, which differ in units (a 2bit threshold fit for one is not for "
                   "the other) and share one residual; no test runs it",
    "relay": "no test relays the replies of a model average",
    "quorum": "an average of fewer than N models has no rule in docs/spec/localsgd_diloco.md",
    "staggered": "every worker syncs at the same step: the average needs all N deltas",
    "restart": "a worker's own optimizer state is not in a checkpoint yet",
    "continue": "no test runs a model average without a dead worker; use abort",
    "resume": "a worker's own optimizer state and local weights are not in a checkpoint "
              "yet (docs/spec/localsgd_diloco.md)",
    "replicas": "the switch to the outer optimizer is not sent to a backup",
}

ALGORITHMS = {a.name: a for a in (
    Algorithm("ssd", "sum", "steps_delay", doc="SSD-SGD: synchronous warm-up, then a pull "
              "every k steps and the local rule in between (docs/spec/ssd-sgd.md)", tested={
                  "compression": _ORACLE + "test_distributed_run_equals_the_simulation",
                  "relay": _RELAYED, "quorum": _QUORUM,
                  "staggered": _ORACLE + "test_staggered_pulls_equal_the_simulation",
                  "restart": _RESTART, "continue": _CONTINUE,
                  "scheduler_restart": _SCHED_RESTART,
                  "resume": "tests/test_resume.py::test_killed_ssd_job_resumes_to_the_same_weights",
                  "checkpoint": "tests/test_resume.py::test_killed_ssd_job_resumes_from_a_"
                                "mid_epoch_checkpoint_to_the_same_weights",
                  "replicas": _REPLICAS},
              refused={}),
    Algorithm("ssgd", "sum", "synchronous", doc="synchronous SGD, like dist_sync", tested={
        "compression": "tests/test_compression_oracle.py::"
                       "test_ssd_sync_ssgd_2bit_equals_native_dist_sync_2bit",
        "relay": _RELAYED, "quorum": _QUORUM, "restart": _RESTART, "continue": _CONTINUE,
        "scheduler_restart": _SCHED_RESTART,
        "resume": "tests/test_resume.py::test_killed_ssgd_job_resumes_to_the_same_weights",
        "checkpoint": "tests/test_resume.py::test_killed_ssgd_job_resumes_to_the_same_weights",
        "replicas": _REPLICAS},
        refused={"staggered": _NO_PERIOD}),
    Algorithm("asgd", "each", "synchronous", doc="asynchronous SGD, like dist_async", tested={
        "compression": "tests/test_compression_oracle.py::"
                       "test_asgd_with_one_worker_and_compression_is_ssgd",
        "checkpoint": "tests/test_combination_jobs.py::"
                      "test_an_asgd_job_writes_its_checkpoints_and_finishes",
        "scheduler_restart": _SCHED + "test_an_asynchronous_job_survives_its_schedulers_death"},
        refused={
            "restart": _ASGD_DIVERGES, "resume": _ASGD_DIVERGES,
            "relay": "each push is answered on its own: no reply is shared by workers to "
                     "relay",
            "quorum": "every push is applied as it arrives: there are no rounds to close",
            "staggered": _NO_PERIOD,
            "continue": "no test runs it; use abort",
            "replicas": "each push is applied on arrival, and a backup's arrival order is "
                        "not its owner's: the two would hold different weights"}),
    Algorithm("preduce", "average", "local", doc="Prague's partial reduce: groups of ready "
              "workers average their models (docs/spec/preduce.md)", tested={
                  "checkpoint": "tests/test_preduce_cluster.py::"
                                "test_preduce_with_per_epoch_checkpoints_finishes",
                  "scheduler_restart": "tests/test_preduce_cluster.py::test_a_restarted_"
                                       "scheduler_rebuilds_the_groups_and_the_weights_are_"
                                       "the_simulators"},
              refused={
                  "compression": "it averages weights and pushes no gradients",
                  "relay": "no test runs a relayed partial reduce",
                  "quorum": "its groups already form without slow workers; there are no "
                            "rounds",
                  "staggered": "it never pulls: there is no pull period to stagger",
                  "restart": "no test restarts a partial reduce, where each worker "
                             "keeps a model of its own",
                  "continue": "a group could wait for the dead worker; no test runs it",
                  "resume": "no test resumes a partial reduce, where each worker keeps a "
                            "model of its own",
                  "replicas": "a group's average is not sent to a backup"}),
    Algorithm("localsgd", "sum", "periodic", outer="average", doc="post-local SGD: SSD's "
              "synchronous warm-up, then the workers' own optimizer steps and their models "
              "averaged on the servers every H steps (docs/spec/localsgd_diloco.md)",
              tested={"checkpoint": _PERIODIC + "test_localsgd_and_diloco_configs_train_"
                                                "with_checkpoints",
                      "scheduler_restart": _SCHED_PERIODIC},
              refused=_PERIODIC_REFUSED),
    Algorithm("diloco", "sum", "periodic", outer="nesterov", doc="DiLoCo: SSD's synchronous "
              "warm-up, then H steps of the workers' own optimizer, and the servers' Nesterov "
              "step on the mean model delta (docs/spec/localsgd_diloco.md)",
              tested={"checkpoint": _PERIODIC + "test_localsgd_and_diloco_configs_train_"
                                                "with_checkpoints",
                      "scheduler_restart": _SCHED_PERIODIC},
              refused=_PERIODIC_REFUSED),
)}


# ---- pairs of features ------------------------------------------------------------------
# (a, b): the message names a's setting, then says what b's must be instead.
CONFLICTS = {
    ("continue", "quorum"): "a dead worker leaves by the servers' all-workers count, which "
                            "quorum rounds do not take; use abort or restart with a quorum",
    ("staggered", "quorum"): "a quorum dates pulls by the rounds closed, not by each "
                             "worker's steps (docs/spec/staggered_pulls.md)",
    ("relay", "continue"): "a dead worker would break the chain of the others",
    ("relay", "quorum"): "a quorum's replies go to each worker on its own",
    ("quorum", "compression"): "no test or simulator runs compressed pushes in quorum "
                               "rounds",
    ("relay", "staggered"): "staggered pulls never arrive together, so after the warm-up "
                            "there is no reply to relay; the two are alternative cures for "
                            "the same pull burst (docs/spec/pull_relay.md)",
    ("replicas", "relay"): "a relayed reply is not sent to a backup",
    ("replicas", "quorum"): "a backup does not replay the leader's rounds",
}
# Every other pair of features is run together by a named test (tests/test_combinations.py
# checks that each of the 45 pairs is here or in CONFLICTS, and that each test exists).
_MANY = ("tests/test_combination_jobs.py::"
         "test_a_compressed_staggered_continue_job_is_restarted_as_if_uninterrupted")
_RELAY_RESTART = ("tests/test_combination_jobs.py::"
                  "test_a_killed_worker_of_a_relayed_job_is_restarted_as_if_uninterrupted")
_QUORUM_RESTART = "tests/test_resume.py::test_a_killed_quorum_job_is_restarted_and_finishes"
_REPLICAS_RESTART = ("tests/test_replicas.py::"
                     "test_a_replicas_job_is_restarted_from_its_checkpoint_as_if_uninterrupted")
_REPLICAS_CODED = ("tests/test_replicas.py::test_a_killed_server_of_a_compressed_or_"
                   "staggered_job_is_replaced_as_if_uninterrupted")
TESTED_PAIRS = {
    ("compression", "staggered"): _MANY, ("compression", "restart"): _MANY,
    ("compression", "continue"): _MANY, ("compression", "resume"): _MANY,
    ("compression", "checkpoint"): _MANY, ("staggered", "restart"): _MANY,
    ("staggered", "continue"): _MANY, ("staggered", "resume"): _MANY,
    ("staggered", "checkpoint"): _MANY, ("restart", "continue"): _MANY,
    ("restart", "resume"): _MANY, ("restart", "checkpoint"): _MANY,
    ("continue", "resume"): _MANY, ("continue", "checkpoint"): _MANY,
    ("resume", "checkpoint"): _MANY,
    ("relay", "compression"): _RELAYED, ("relay", "restart"): _RELAY_RESTART,
    ("relay", "resume"): _RELAY_RESTART, ("relay", "checkpoint"): _RELAY_RESTART,
    ("quorum", "restart"): _QUORUM_RESTART, ("quorum", "resume"): _QUORUM_RESTART,
    ("quorum", "checkpoint"): _QUORUM_RESTART,
    ("scheduler_restart", "checkpoint"): _SCHED_RESTART,
    ("scheduler_restart", "continue"): _SCHED + "test_after_a_scheduler_restart_a_"
                                                "killed_worker_leaves_with_continue",
    ("scheduler_restart", "restart"): _SCHED_RESUMED, ("scheduler_restart", "resume"): _SCHED_RESUMED,
    ("scheduler_restart", "relay"): _SCHED_RESTART,
    ("scheduler_restart", "compression"): _SCHED_COMPRESSED,
    ("scheduler_restart", "staggered"): _SCHED_COMPRESSED,
    ("scheduler_restart", "quorum"): "tests/test_quorum.py::test_a_restarted_scheduler_"
                                     "loses_no_round_decision",
    ("scheduler_restart", "replicas"): _SCHED + "test_after_a_server_was_replaced_by_its_"
                                                "backup_a_killed_scheduler_is_restarted",
    ("replicas", "checkpoint"): _REPLICAS,
    ("replicas", "restart"): _REPLICAS_RESTART, ("replicas", "resume"): _REPLICAS_RESTART,
    ("replicas", "compression"): _REPLICAS_CODED, ("replicas", "staggered"): _REPLICAS_CODED,
    ("replicas", "continue"): "tests/test_replicas.py::test_a_dead_worker_then_a_dead_"
                              "server_end_as_the_worker_alone_would",
}


def algorithm(name: str) -> Algorithm:
    return ALGORITHMS[name]


def features_on(values: Mapping) -> dict:
    """feature name -> (setting, value, instead) for every feature ``values`` turn on."""
    return {name: on for name, f in FEATURES.items() if (on := f.on(values)) is not None}


def _line(label, a, b, reason):
    (setting_a, value_a, _), (setting_b, value_b, instead) = a, b
    return (f"{label(setting_a)}: {value_a} works with {label(setting_b)}: {instead} only, "
            f"got {value_b!r} ({reason})")


def refusal(values: Mapping, label: Callable[[str], str]) -> Optional[str]:
    """The one-line refusal of the first combination ``values`` (settings by name) use
    that the registry does not take, naming both sides by ``label(setting name)``; None
    if it takes them all. An unknown algorithm is the settings row's to refuse."""
    on = features_on(values)
    entry = ALGORITHMS.get(values.get("algorithm"))
    if entry is not None:
        for name in on:
            if name in entry.refused:
                return _line(label, ("algorithm", entry.name, None), on[name],
                             entry.refused[name])
    for (a, b), reason in CONFLICTS.items():
        if a in on and b in on:
            return _line(label, on[a], on[b], reason)
    return None


def markdown() -> str:
    """The combinations table of docs/training.md (a test compares)."""
    names = list(ALGORITHMS)
    lines = ["| feature | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for f in FEATURES.values():
        cells = ["yes" if f.name in ALGORITHMS[a].tested else
                 "refused: " + ALGORITHMS[a].refused[f.name] for a in names]
        lines.append(f"| {f.name}: {f.doc} | " + " | ".join(cells) + " |")
    lines += ["", "Refused together, whatever the algorithm:", ""]
    lines += [f"- {a} and {b}: {reason}" for (a, b), reason in CONFLICTS.items()]
    lines += ["", "Every other pair of features is taken, and run together by the test "
              "`TESTED_PAIRS` names in `ssdsgd/sync/registry.py`."]
    return "\n".join(lines) + "\n"


# ---- joiners: cluster.max_workers above cluster.workers (docs/spec/membership.md) -----------
# The algorithms whose server policy holds and admits a joiner (``ServerPolicy.hold``):
# every member pushes every step, and the step a joiner comes in at has a rule
# (``stage.join_boundary``).
JOINERS = ("ssd", "ssgd")
JOIN_TEST = "tests/test_join_jobs.py"
# what a job that takes joiners may not use, and why: no test runs the two together.
# (resume and restarts are taken: the job starts again from its last checkpoint with its
# first workers, who may be joined again, docs/spec/membership.md rule 11)
JOIN_REFUSED = {
    "quorum": "a quorum's rounds have no rule for a joiner (docs/spec/membership.md rule 9)",
}


def join_refusal(values: Mapping, label: Callable[[str], str]) -> Optional[str]:
    """Why a job with ``values`` (cluster.max_workers above the workers) cannot take
    joiners, in one line naming the setting; None if it can."""
    most = label("max_workers")
    name = values.get("algorithm")
    if name is not None and name not in JOINERS:
        return (f"{most}: {values.get('max_workers')} (workers joining) works with "
                f"{label('algorithm')}: {' or '.join(JOINERS)} only, got {name!r} (its "
                "server policy takes no joiner)")
    on = features_on(values)
    for feature, reason in JOIN_REFUSED.items():
        if feature in on:
            setting, value, instead = on[feature]
            return (f"{most}: {values.get('max_workers')} (workers joining) works with "
                    f"{label(setting)}: {instead} only, got {value!r} ({reason})")
    # sync.pull_relay auto never relays in a job that takes joiners (auto.relay_listens),
    # and k auto is agreed at a barrier the scheduler keeps (stage.join_boundary)
    return None
