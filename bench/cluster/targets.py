"""The issues' targets, read from docs/benchmarks/targets.md (the one place they live).

    at_least('comm.ssd_k5_vs_native')     # 2.0
"""
from __future__ import annotations

import functools
import re
from pathlib import Path

TARGETS_FILE = Path(__file__).resolve().parents[2] / 'docs' / 'benchmarks' / 'targets.md'
_ROW = re.compile(r'^\|\s*`([\w.]+)`\s*\|\s*(-?[\d.]+)\s*\|')


@functools.lru_cache(maxsize=None)
def table(path=TARGETS_FILE):
    """{id: the least value that meets it} of every target row of ``path``."""
    found = {}
    for line in Path(path).read_text().splitlines():
        m = _ROW.match(line)
        if m:
            found[m.group(1)] = float(m.group(2))
    return found


def at_least(target_id):
    try:
        return table()[target_id]
    except KeyError:
        raise KeyError(f'target {target_id!r} is not in {TARGETS_FILE}') from None


def check(what, target_id, measured, fmt='.2f', none='-'):
    """One check: ``measured`` (a number or None) against the target; met None if not
    measured."""
    want = at_least(target_id)
    return {'what': what, 'target': f'>= {want:g}', 'id': target_id,
            'measured': none if measured is None else format(measured, fmt),
            'met': None if measured is None else measured >= want}
