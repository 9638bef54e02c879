"""Which server owns which elements of which key: pure functions, same on every worker.

Small keys go whole to the server with the fewest bytes so far (ties: lowest rank), in the
order keys are initialized, so the placement is balanced by bytes and identical on every
worker that initializes keys in the same order (the Trainer does). Keys with more elements
than ``bigarray_bound`` (MXNET_KVSTORE_BIGARRAY_BOUND's role) are cut into one contiguous
slice per server, so a big layer's traffic and update work is spread over all servers.
"""
import dataclasses


@dataclasses.dataclass(frozen=True)
class Slice:
    server: int
    offset: int   # first element in the flattened key
    count: int    # number of elements


def split_evenly(size, parts):
    """Contiguous (offset, count) pieces; the first ``size % parts`` get one more."""
    base, extra = divmod(size, parts)
    out, offset = [], 0
    for i in range(parts):
        count = base + (1 if i < extra else 0)
        out.append((offset, count))
        offset += count
    return out


class Placement:
    """Remembers where each key lives; ``place`` is called once per key, in init order."""

    def __init__(self, num_servers, bigarray_bound):
        if num_servers < 1:
            raise ValueError("num_servers must be >= 1")
        self.num_servers = num_servers
        self.bigarray_bound = bigarray_bound
        self.load = [0] * num_servers
        self.slices = {}

    def place(self, key, size, itemsize=4):
        if key in self.slices:
            return self.slices[key]
        if size > self.bigarray_bound and self.num_servers > 1:
            slices = [Slice(s, off, n) for s, (off, n) in
                      enumerate(split_evenly(size, self.num_servers))]
        else:
            server = min(range(self.num_servers), key=lambda s: (self.load[s], s))
            slices = [Slice(server, 0, size)]
        for sl in slices:
            self.load[sl.server] += sl.count * itemsize
        self.slices[key] = slices
        return slices

    def __getitem__(self, key):
        return self.slices[key]

    def __contains__(self, key):
        return key in self.slices
