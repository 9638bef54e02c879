"""Which keys share one of MXNet's multi-tensor optimizer calls.

MXNet 1.9.1's multi-tensor kernels (``multi_sgd_mom_update`` and its kin,
src/operator/optimizer_op-inl.h ``MultiSGDKernel``) run one loop over max(size) elements,
and every iteration visits every tensor of the call: a call costs about max(size) x count
element visits, not sum(size). A 4.2 M-element layer in one call with five small keys
costs six times its own update; ResNet-50's 161 keys in calls of 45 cost more than ten
times theirs. So keys go into calls of similar sizes: sorted by size, largest first, a
call takes the next key while its visits stay within ``SLACK`` times its elements. Per
element the arithmetic is the same kernel's, so the weights are bit for bit the same
(tests/test_update_groups.py).

``sgd_call`` runs such a call for MXNet's ``SGD`` without the ``Updater``'s checks of every
array (the servers' update and the worker's local rule both use it).
"""
import mxnet as mx
import numpy as np

SLACK = 1.25


def size_groups(sizes, limit):
    """Lists of indices into ``sizes``, each at most ``limit`` long, whose largest size
    times their count is at most SLACK times their total."""
    order = sorted(range(len(sizes)), key=lambda i: -sizes[i])
    groups, group, total = [], [], 0
    for i in order:
        n = sizes[i]
        if group and (len(group) >= limit or
                      sizes[group[0]] * (len(group) + 1) > SLACK * (total + n)):
            groups.append(group)
            group, total = [], 0
        group.append(i)
        total += n
    if group:
        groups.append(group)
    return groups


def sgd_call(opt, updater, keys, grads, weights, seen):
    """MXNet's ``updater(keys, grads, weights)`` for ``SGD`` on dense float32 arrays whose
    state exists, without its checks of every array's storage type, dtype and device
    (ctypes calls that release the GIL: in a worker the busy I/O thread then takes it;
    ~40 % of the update's time on ResNet-20's 65 keys). The same bookkeeping
    (``_update_count``, ``_get_lrs``, ``_get_wds``) and the same operator with the same
    arguments as ``SGD._update_impl``'s aggregated path, so the same weights bit for bit
    (tests/test_glu_rules.py, tests/test_update_groups.py). ``seen``: the caller's dict,
    key -> what was learnt of its arrays (while they are the same objects). False: not
    this case, call the Updater."""
    if type(opt) is not mx.optimizer.SGD:
        return False
    states, device = [], None
    for key, grad, weight in zip(keys, grads, weights):
        state = updater.states.get(key)
        if (opt.momentum > 0 and state is None) or not updater.states_synced.get(key):
            return False
        plain = seen.get(key)
        if plain is None or plain[0] is not weight or plain[1] is not grad:
            plain = seen[key] = (
                weight, grad, weight.stype == "default" and grad.stype == "default"
                and weight.dtype == np.float32 and grad.dtype == np.float32,
                weight.context.device_id)
        if not plain[2] or (device is not None and plain[3] != device):
            return False
        device = plain[3]
        states.append(state)
    opt._set_current_context(device)          # noqa: SLF001 - as the Updater does
    opt._update_count(keys)                   # noqa: SLF001
    kwargs = {"rescale_grad": opt.rescale_grad}
    if opt.clip_gradient:
        kwargs["clip_gradient"] = opt.clip_gradient
    lrs, wds = opt._get_lrs(keys), opt._get_wds(keys)   # noqa: SLF001
    if opt.momentum > 0:
        mx.nd.multi_sgd_mom_update(
            *[a for trio in zip(weights, grads, states) for a in trio], out=weights,
            num_weights=len(weights), lrs=lrs, wds=wds, momentum=opt.momentum, **kwargs)
    else:
        mx.nd.multi_sgd_update(
            *[a for pair in zip(weights, grads) for a in pair], out=weights,
            num_weights=len(weights), lrs=lrs, wds=wds, **kwargs)
    return True
