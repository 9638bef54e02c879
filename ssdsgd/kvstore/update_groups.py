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
"""
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
