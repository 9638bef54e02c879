"""The user documentation says what is true now and points at files that exist.

* README.md and docs/ (all but docs/history.md, where dated run logs go) carry no run-log
  marker: no numbered stop ("stop 12"), no narrative round ("round 3 of the benchmark"),
  no ISO date, no clock time, no commit hash, no "this session";
* every relative link and every backticked repository path (``bench/cluster/plan.py``,
  ``ssdsgd/settings.py::SETTINGS``) in them names a file or folder of the repository.
"""
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
HISTORY = REPO / 'docs' / 'history.md'
#: the top-level folders a backticked path must start with to count as a repository path
TOP = ('bench', 'configs', 'docs', 'launch', 'ssdsgd', 'tests', '.ci')
#: MXNet's own test tree, which docs/design.md names (its distributed kvstore tests run on
#: ssd_sync): paths of another repository, not of this one
ELSEWHERE = ('tests/nightly/', 'tests/python/')

MARKERS = {
    'a numbered stop': re.compile(r'\bstops? \d+\b', re.I),
    'a numbered round of work': re.compile(
        r'\b(?:in|at|since|after|before|of|from|until) (?:the )?round \d+\b', re.I),
    'an ISO date': re.compile(r'\b20\d\d-[01]\d-[0-3]\d\b'),
    'a clock time': re.compile(r'(?<![\w.:/])(?:[01]\d|2[0-3]):[0-5]\d(?::[0-5]\d)?'
                               r'(?![\w:.])'),
    'a commit hash': re.compile(r'(?<![\w./-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)'
                                r'[0-9a-f]{7,40}(?![\w/])'),
    'a session narrative': re.compile(r'\b(?:this|that|other|earlier|previous|last) '
                                      r'sessions?\b', re.I),
}
LINK = re.compile(r'\[[^\]]*\]\(([^)\s]+)\)')
BACKTICKED = re.compile(r'`([^`\s]+)`')


def user_docs():
    docs = [REPO / 'README.md'] + sorted((REPO / 'docs').rglob('*.md'))
    return [p for p in docs if p != HISTORY]


def _id(path):
    return str(path.relative_to(REPO))


def run_log_markers(text):
    """(line number, what, the text matched) of every run-log marker in ``text``."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for what, pattern in MARKERS.items():
            for m in pattern.finditer(line):
                if what == 'a commit hash' and re.fullmatch(r'\d+b', m.group(0)):
                    continue        # a size in bytes (tc's "burst 250000b")
                found.append((number, what, m.group(0)))
    return found


def missing_links(path, text):
    """Relative links and backticked repository paths in ``text`` (of ``path``) that name
    nothing in the repository."""
    missing = []
    for m in LINK.finditer(text):
        target = m.group(1).split('#')[0]
        if not target or re.match(r'^[a-z][a-z0-9+.-]*:', target):     # http:, mailto:
            continue
        if not (path.parent / target).exists():
            missing.append(target)
    for m in BACKTICKED.finditer(text):
        ref = re.split(r'::|:(?=[\w.]+$)|:\d', m.group(1))[0].rstrip('.,;')
        if ref.split('/')[0] not in TOP or '/' not in ref or any(c in ref for c in '*{<$') \
                or ref.startswith(ELSEWHERE):
            continue
        if not (REPO / ref).exists():
            missing.append(ref)
    return missing


@pytest.mark.parametrize('path', user_docs(), ids=_id)
def test_no_run_log_in_the_user_docs(path):
    found = run_log_markers(path.read_text())
    assert not found, (f'{_id(path)} quotes a run log (move it to docs/history.md): ' +
                       '; '.join(f'line {n}: {what} {text!r}' for n, what, text in found[:8]))


@pytest.mark.parametrize('path', user_docs(), ids=_id)
def test_the_docs_name_files_that_exist(path):
    missing = missing_links(path, path.read_text())
    assert not missing, f'{_id(path)} names files that do not exist: {", ".join(missing)}'


def test_the_markers_are_found_and_plain_text_passes():
    """The patterns catch each kind of run-log line and leave ordinary prose alone."""
    log = ('Measured at stop 15 (2026-12-02 00:32-01:42 UTC, git 41062bf); this session\n'
           'In round 3 the ssd row reached 0.95 at 09:22.\n')
    kinds = {what for _, what, _ in run_log_markers(log)}
    assert kinds == set(MARKERS), kinds
    prose = ('A round closes once Q workers pushed (docs/spec/quorum.md); k = 5, 1e-4, '
             'SSDSGD_MAX_MESSAGE_BYTES 2^34, 10.0.0.50:41231, node1:2, 0.33333334, '
             'runs/digits-20260101-120000, burst 250000b, doi 10.1145/3373376.3378499, '
             'a deadbeef1 key.')
    assert run_log_markers(prose) == [(1, 'a commit hash', 'deadbeef1')]
    here = REPO / 'docs' / 'x.md'
    assert missing_links(here, '[a](spec/quorum.md) `bench/cluster/plan.py` '
                         '`ssdsgd/settings.py::SETTINGS` `bench/nothing/here.py` '
                         '[b](gone.md) [c](https://example.org/x)') == [
        'gone.md', 'bench/nothing/here.py']
