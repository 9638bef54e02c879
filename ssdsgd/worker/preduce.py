"""Partial reduce's worker side (``algorithm: preduce``, docs/spec/preduce.md): the local
step with the Trainer's own optimizer, then ready, then the average of the group the
scheduler forms; at the end, the last group, of every worker.

Apart from the stage machine because preduce shares none of its stage schedule: no
warm-up, no steps delay, no pulls and no local rule. It shares only the keys' records
(where each key's weights live) and the machine's counters.
"""
from ..mxglue import hostcopy
from ..sync.stage import Stage
from .deferred import device_sum


class PreduceSteps:
    def __init__(self, client, keys, counts):
        self.client, self.keys, self.counts = client, keys, counts   # the machine's
        self.updater = None          # the Trainer's optimizer (MXNet's updater), run here
        self.groups = []             # (group number, members) of every group joined
        self.done = False            # the final group (of every worker) is done

    def step(self, entries):
        """The local step with the Trainer's optimizer (key by key, in the Trainer's
        order), then ready, then the group's average."""
        if self.updater is None or any(outs is None for _, _, outs in entries):
            raise RuntimeError("algorithm preduce runs the Trainer's optimizer inside the "
                               "store: create the Trainer with update_on_kvstore left at its "
                               "default (True)")
        for key, grad_list, outs in entries:
            self.keys[key].outs = outs
            self.updater(key, device_sum(grad_list), outs[0])
        self.counts[Stage.PREDUCE] += 1
        self._average([(key, outs) for key, _, outs in entries], final=False)

    def finish(self):
        """The last group, of every worker, averages all their models (once)."""
        local = [(key, r.outs) for key, r in self.keys.items() if r.outs is not None]
        if local and not self.done:
            self.done = True
            self._average(local, final=True)

    def _average(self, keys_outs, final):
        """Report ready, wait for the group, and replace the weights by its average."""
        group, members = self.client.ready(final=final)
        self.groups.append((group, members))
        if len(members) > 1:
            flats = hostcopy.read([outs[0] for _, outs in keys_outs])
            reply = self.client.average(group, members,
                                        [(key, flat) for (key, _), flat in
                                         zip(keys_outs, flats)])
            self.counts["pushes"] += 1
            replies = reply.wait()
            hostcopy.write((outs[0], replies[key].value) for key, outs in keys_outs)
        for _, outs in keys_outs:
            for out in outs[1:]:
                outs[0].copyto(out)
