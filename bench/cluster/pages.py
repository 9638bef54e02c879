"""The generated pages of docs/benchmarks (NAME.md from NAME.json) and their history line.

A page shows the figures and the command that makes them; when and at which commit a run
was made is the run's record (NAME.json's meta.machine) and one line of docs/history.md,
never the page (tests/test_docs.py). A page can be rewritten from its JSON without a
rerun, e.g. after a change of the tables' layout:

    .venv/bin/python -m bench.cluster.pages docs/benchmarks/cluster.json [...]
"""
from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

from . import seeds
from .report import (checks_text, hetero_tables, matrix_tables, scaling_table,
                     tta_table)

REPO = Path(__file__).resolve().parents[2]
HISTORY = REPO / 'docs' / 'history.md'
HISTORY_SECTION = '## Benchmark runs (written by bench/cluster)'
#: options whose value is a path of the machine the run was made on, not of the benchmark
LOCAL_OPTIONS = ('--out', '--raw')
PLOT_SUFFIXES = ('matrix', 'scaling', 'tta', 'tta_comm')


def command_of(meta):
    """The run's command as a user types it: without --out/--raw (paths of that run)."""
    words = shlex.split(meta['command'])
    keep, skip = [], False
    for w in words:
        if skip:
            skip = False
            continue
        if w in LOCAL_OPTIONS:
            skip = True
            continue
        if w.split('=')[0] in LOCAL_OPTIONS:
            continue
        keep.append(w)
    if keep[:3] == ['python', '-m', 'bench.cluster']:
        keep = ['sudo', '.venv/bin/python', '-m', 'bench.cluster'] + keep[3:]
    return ' '.join(shlex.quote(w) for w in keep)


def _made_by(meta, stem, about):
    return (f'_Made by `{command_of(meta)}` (about {meta.get("elapsed_s", 0) / 60:.0f} min); '
            f'rewritten from {stem}.json by `.venv/bin/python -m bench.cluster.pages '
            f'docs/benchmarks/{stem}.json`. Do not edit by hand ({about})._')


def _machine(meta):
    m = meta['machine']
    load = ', '.join(map(str, m.get('loadavg_start') or ())) or '-'
    return [f"- {m.get('cpus')} CPUs ({m.get('cpu')}), {m.get('memory_gib')} GiB, kernel "
            f"{m.get('kernel')}, load average at start ({load})",
            f"- Python {m.get('python')}, MXNet {m.get('mxnet')}, gluoncv {m.get('gluoncv')}, "
            f"pyzmq {m.get('zmq')}, numpy {m.get('numpy')}",
            f"- shaping: {meta.get('shaping')}"]


def _notes(meta):
    if not meta.get('notes'):
        return []
    return ['## Notes from the run', ''] + [f'- {n}' for n in meta['notes']] + ['']


def _judged_on(part):
    """With several seeds, the line that says the checks judge the aggregates."""
    if not seeds.several(part):
        return []
    return [f"The checks judge each row's MLPerf aggregate over seeds "
            f"{', '.join(map(str, part['seeds']))} (the table below), not one seed.", '']


def hetero_markdown(results, stem='hetero'):
    """STEM.md (hetero.md): the heterogeneity tables of one run (discussion:
    heterogeneity.md)."""
    meta = results['meta']
    return '\n'.join(
        ['# Emulated-cluster benchmark: slow workers', '',
         _made_by(meta, stem, 'settings, method and the published figures: '
                  '[heterogeneity.md](heterogeneity.md)'), '']
        + _machine(meta) + ['', hetero_tables(results['hetero'], md=True)] + _notes(meta))


def markdown(results, images, stem='cluster'):
    """NAME.md: the tables of one run, its settings and its plots."""
    meta = results['meta']
    lines = ['# Emulated-cluster benchmark: results', '',
             _made_by(meta, stem, 'method and discussion: [README.md](README.md)'), '',
             '## Machine and settings', ''] + _machine(meta) + ['']
    for key, val in meta.get('settings', {}).items():
        lines.append(f'- {key}: {val}')
    lines.append('')
    if results.get('checks'):
        lines += ['## The comm-bound point', '', checks_text(results['checks']), '']
    if results.get('matrix'):
        lines += ['## Side by side', '', matrix_tables(results['matrix'], md=True)]
    if results.get('scaling', {}).get('rows'):
        lines += ['## Scaling', '', scaling_table(results['scaling'], md=True)]
    if results.get('tta', {}).get('rows'):
        lines += ['## Time to accuracy', '', tta_table(results['tta'], md=True)]
    tc = results.get('tta_comm') or {}
    if tc.get('rows'):
        lines += ['## Time to accuracy at a comm-bound point', ''] + _judged_on(tc) + [
            checks_text(tc.get('checks', [])), '', tta_table(tc, md=True)]
    for img in images:
        lines += [f'![{img.stem}]({img.name})', '']
    return '\n'.join(lines + _notes(meta))


def history_line(results, stem):
    """docs/history.md's line for one run of a page: when, at which commit, how."""
    m = results['meta']['machine']
    dirty = ' (ssdsgd/ had uncommitted changes)' if m.get('ssdsgd_dirty') else ''
    return (f"- `docs/benchmarks/{stem}.md`: run {m.get('date')}, git {m.get('git')}{dirty}, "
            f"`{command_of(results['meta'])}`")


def record_run(results, stem, history=HISTORY):
    """Add the run's history line at the end of HISTORY_SECTION (made if missing)."""
    text = history.read_text() if history.exists() else '# History\n'
    if HISTORY_SECTION not in text:
        text = text.rstrip('\n') + f'\n\n{HISTORY_SECTION}\n'
    head, _, rest = text.partition(HISTORY_SECTION)
    nxt = rest.find('\n## ')
    body, after = (rest, '') if nxt < 0 else (rest[:nxt], rest[nxt:])
    body = body.rstrip('\n') + '\n' + history_line(results, stem) + '\n'
    history.write_text(head + HISTORY_SECTION + body + after)


def rewrite(json_path):
    """NAME.md beside NAME.json, from it and the plots already there."""
    path = Path(json_path)
    results = json.loads(path.read_text())
    if set(results) == {'meta', 'hetero'}:      # a hetero page (write_outputs)
        text = hetero_markdown(results, path.stem)
    else:
        images = [path.with_name(f'{path.stem}_{s}.png') for s in PLOT_SUFFIXES]
        text = markdown(results, [p for p in images if p.exists()], path.stem)
    path.with_suffix('.md').write_text(text)
    return path.with_suffix('.md')


if __name__ == '__main__':
    for arg in sys.argv[1:] or sys.exit(__doc__):
        print(f'wrote {rewrite(arg)}')
