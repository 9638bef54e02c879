"""A request's entries cut into messages: each server gets the slices it owns of every
key (sharding's placement), in messages of about ``SSDSGD_CHUNK_BYTES``, or in P pieces
of a small part (``SSDSGD_PIPELINE_PIECES``) so that a server answers the first while the
rest are still arriving. Pure functions: the records and tensors, no sockets."""
import dataclasses

import numpy as np

PIECE_MIN = 128 << 10      # a pipelined piece is about this big or more (Python per message)


@dataclasses.dataclass
class Coded:
    """An entry's compressed gradient: one payload per slice of the key's placement."""
    encoding: str
    payloads: list


def cut(items, chunk_bytes, pieces=1):
    """items: (record, tensors, bytes) -> [[records, tensors, bytes], ...] of about
    ``chunk_bytes``, or of 1/pieces of the part if that is smaller (not below PIECE_MIN)."""
    if chunk_bytes:
        total = sum(nbytes for _, _, nbytes in items)
        chunk_bytes = min(chunk_bytes, max(PIECE_MIN, -(-total // pieces)))
    chunks = [[[], [], 0]]
    for rec, tensors, nbytes in items:
        if chunk_bytes and chunks[-1][0] and chunks[-1][2] + nbytes > chunk_bytes:
            chunks.append([[], [], 0])
        chunk = chunks[-1]
        chunk[0].append(rec)
        chunk[1].append(tensors)
        chunk[2] += nbytes
    return chunks


def _tensors(arrays):
    """An entry's tensors: None (none, e.g. a pull), one flat array, or a list of them."""
    if arrays is None:
        return []
    return list(arrays) if isinstance(arrays, (list, tuple)) else [arrays]


def split(placement, entries, chunk_bytes, pieces=1):
    """{server: [[records, tensors, bytes], ...]}: each server's slices of the entries
    ((key, per-key step, tensors or a ``Coded`` gradient, dtype)), cut into messages of
    about ``chunk_bytes`` (None: one message per server). With pieces P > 1 a part
    smaller than P chunks is still cut into P messages, of about PIECE_MIN bytes or more:
    the server answers the first while the rest arrive, so a small model's pushes and
    replies overlap on the link as ps-lite's per-key messages do. It pays on slow links
    and costs the server's CPU per message on fast ones, so by default each worker picks
    P by timing its steps (piece_tuner)."""
    per_server = {}
    for key, kstep, arrays, dtype in entries:
        coded = arrays if isinstance(arrays, Coded) else None
        arrays, itemsize = ([] if coded else _tensors(arrays)), np.dtype(dtype).itemsize
        for i, sl in enumerate(placement[key]):
            items = per_server.setdefault(sl.server, [])
            if coded:
                items.append(((key, kstep, sl.offset, sl.count, dtype, 1, coded.encoding),
                              [coded.payloads[i]], coded.payloads[i].nbytes))
                continue
            items.append(((key, kstep, sl.offset, sl.count, dtype, len(arrays)),
                          [a[sl.offset:sl.offset + sl.count] for a in arrays],
                          sl.count * itemsize))
    return {server: cut(items, chunk_bytes, pieces) for server, items in per_server.items()}
