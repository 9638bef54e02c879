"""A worker's checkpoint of its stage machine: what the servers' checkpoint does not hold
(the step, each key's last global snapshots and local weights, the pending pull, the local
rule's state, the compression residuals), as arrays and a JSON-able record, and back.
Apart from the machine, which it reads and restores between two steps."""
from ..kvstore.client import KeyReply
from ..mxglue import hostcopy
from ..sync.auto import CODECS_BY_COST


def state_dict(machine):
    """Everything of this worker that the servers' checkpoint does not hold, as
    ({name: ndarray}, JSON-able meta): the step, each key's last two global snapshots
    with their steps, state, lr and version, its local weights w_i, the pull requested
    at t - 1 (waited for here: its reply is w_G(t - 1), and kept for step t) and the
    local rule's own state. Taken between two steps."""
    machine.settle()
    arrays, meta = {}, {"t": machine.t, "keys": {}, "pending": None,
                        "delay_steps": machine.schedule.delay_steps,
                        "relay": machine.schedule.relay,
                        "compression": machine.schedule.compression}
    if machine.pending is not None:
        replies = machine.pending.wait()
        machine.pending = _Done(replies)
        meta["pending"] = {str(k): _put_reply(arrays, f"p{k}", r) for k, r in replies.items()}
    for key, r in machine.keys.items():
        m = {"seeded": r.seeded, "pulled_at": r.pulled_at, "prev_pulled_at": r.prev_pulled_at,
             "lr": r.lr, "version": r.version, "outs": r.outs is not None,
             "state": _put_list(arrays, f"k{key}.state", r.state)}
        for name in ("value", "prev_value"):
            if getattr(r, name) is not None:
                arrays[f"k{key}.{name}"] = getattr(r, name)
        local = r.outs or r.params
        if local:
            arrays[f"k{key}.local"] = local[0].asnumpy()
        meta["keys"][str(key)] = m
    if machine.rule is not None:
        meta["rule"] = machine.rule.state_dict(arrays)
    residuals = machine.client.residuals()
    meta["residuals"] = sorted(residuals)
    arrays.update((f"c{key}", r) for key, r in residuals.items())
    return arrays, meta

def load_state_dict(machine, arrays, meta):
    """Continue exactly where ``state_dict`` was taken (after kv.init and the
    optimizer: the keys and the local rule exist). w_i goes into the parameters."""
    if int(meta["t"]) != machine.t:
        raise ValueError(f"the worker state is of step {meta['t']}, the job resumes at "
                         f"step {machine.t}")
    for skey, m in meta["keys"].items():
        key = int(skey)
        r = machine.keys.get(key)
        if r is None or r.params is None:
            raise ValueError(f"the worker state names key {key}, which this model lacks")
        r.value, r.prev_value = arrays.get(f"k{key}.value"), arrays.get(f"k{key}.prev_value")
        r.pulled_at, r.prev_pulled_at = m["pulled_at"], m["prev_pulled_at"]
        r.seeded, r.lr, r.version = bool(m["seeded"]), m["lr"], m["version"]
        r.state = _get_list(arrays, f"k{key}.state", m["state"])
        r.outs = r.params if m["outs"] else None
        if f"k{key}.local" in arrays:
            hostcopy.write((out, arrays[f"k{key}.local"].reshape(-1)) for out in r.params)
    if meta.get("delay_steps") is not None and machine.schedule.undecided:
        # what the job chose before the restart (sync/auto.py): every worker's checkpoint
        # holds rank 0's choice, so they agree again without timing anything
        machine.schedule.set_choice(int(meta["delay_steps"]), bool(meta.get("relay")),
                                    "auto, as chosen before the restart",
                                    _codec(meta.get("compression")))
    if meta["pending"] is not None:
        machine.pending = _Done({int(k): _get_reply(arrays, f"p{k}", m)
                              for k, m in meta["pending"].items()})
    if machine.rule is not None and meta.get("rule") is not None:
        machine.rule.load_state_dict(arrays, meta["rule"],
                                  {k: r.params[0] for k, r in machine.keys.items()})
    machine.client.load_residuals({key: arrays[f"c{key}"] for key in meta.get("residuals", [])})


def _codec(name):
    """A recorded compression choice, checked (the file is the job's own, but old)."""
    if name is None:
        return "none"
    if name not in CODECS_BY_COST:
        raise ValueError(f"the worker state's compression {name!r} is none of "
                         f"{', '.join(CODECS_BY_COST)}")
    return name


class _Done:
    """A pull already answered (saved with a checkpoint): ``wait`` returns its replies."""

    def __init__(self, replies):
        self.replies = replies

    def wait(self):
        return self.replies


def _put_list(arrays, prefix, values):
    if values is None:
        return None
    for j, a in enumerate(values):
        arrays[f"{prefix}{j}"] = a
    return len(values)


def _get_list(arrays, prefix, count):
    return None if count is None else [arrays[f"{prefix}{j}"] for j in range(count)]


def _put_reply(arrays, prefix, reply):
    arrays[f"{prefix}.value"] = reply.value
    return {"lr": reply.lr, "version": reply.version,
            "state": _put_list(arrays, f"{prefix}.state", reply.state)}


def _get_reply(arrays, prefix, m):
    return KeyReply(arrays[f"{prefix}.value"], _get_list(arrays, f"{prefix}.state", m["state"]) or [],
                    m["version"], m["lr"])
