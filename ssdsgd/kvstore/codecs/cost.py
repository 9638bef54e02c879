"""What coding a push costs on this machine, measured (``sync.compression: auto``): each
codec, at its default parameters, codes a probe of the push's size and the seconds and
wire bytes are scaled to the whole push. The probe is capped (PROBE_MAX_ELEMENTS), so
the measurement takes a fraction of a second whatever the model; coding is linear in
the elements (docs/spec/compression.md, "Codec cost")."""
import time

import numpy as np

from . import CODECS

PROBE_MAX_ELEMENTS = 1 << 22     # 16 MB of float32
REPEATS = 2                      # the first codes into fresh residuals; the second is timed


def measure(nbytes: float, seed: int = 0) -> dict:
    """{codec name: (seconds, wire bytes per float32 byte)} of coding a push of ``nbytes``
    of float32 gradient with each codec at its defaults, error feedback included."""
    n = int(min(max(nbytes // 4, 1024), PROBE_MAX_ELEMENTS))
    grad = np.random.default_rng(seed).standard_normal(n).astype(np.float32)
    scale = max(nbytes / 4, 1) / n
    costs = {}
    for codec in CODECS:
        residuals = codec().residuals()
        for _ in range(REPEATS):
            t0 = time.perf_counter()
            payloads = residuals.encode(0, grad)
            seconds = time.perf_counter() - t0
        wire = sum(p.nbytes for p in payloads) / (4 * n)
        costs[codec.type] = (seconds * scale, wire)
    return costs
