"""``bench/transport.py --cipher-time FILE``: each process of the job imports this first
(its directory is put on PYTHONPATH) and, at its exit, appends to FILE the time it spent
in aesgcm's ``Channel.seal`` and ``Channel.open`` and how many messages each handled, so
the cipher's share of a step can be told from the rest (docs/reliability.md, the small
Trainer.step row)."""
import atexit
import os
import time

LOG = os.environ.get("BENCH_CIPHER_TIME_LOG")

if LOG:
    from ssdsgd.kvstore import sealing

    SPENT = {"seal": [0.0, 0], "open": [0.0, 0]}

    def _timed(name):
        inner = getattr(sealing.Channel, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                SPENT[name][0] += time.perf_counter() - start
                SPENT[name][1] += 1
        setattr(sealing.Channel, name, timed)

    for _name in SPENT:
        _timed(_name)

    def _report():
        with open(LOG, "a") as f:
            f.write(f"{os.environ.get('SSDSGD_ROLE', 'launcher')} "
                    f"{os.environ.get('SSDSGD_RANK', '-')} "
                    + " ".join(f"{k} {v[0] * 1e3:.1f} ms / {v[1]} messages"
                               for k, v in SPENT.items()) + "\n")
    atexit.register(_report)
