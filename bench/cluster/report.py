"""Tables (plain text and markdown) and PNG plots of the emulated-cluster results."""
from __future__ import annotations

from pathlib import Path

from ssdsgd.report import text_table

from . import seeds
from .netns import rate_label

REPO = Path(__file__).resolve().parents[2]


def source_hash():
    """A hash of ssdsgd's Python sources (the editable install every job imports), to
    notice when they change in the middle of a run."""
    import hashlib
    h = hashlib.sha1()
    for path in sorted((REPO / 'ssdsgd').rglob('*.py')):
        h.update(str(path.relative_to(REPO)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:12]


# ---- formatting -----------------------------------------------------------------------
def _f(x, spec, none='-'):
    return none if x is None else format(x, spec)


def _mb(x):
    return None if x is None else x / 1e6


MATRIX_COLS = [
    ('system', 'label', 's'),
    ('samples/s', 'samples_per_s', '.1f'),
    ('vs dist_sync', 'speedup', '.2f'),
    ('s/step', 'step_s', '.3f'),
    ('blocked s/step', 'blocked_per_step_s', '.3f'),
    ('CPU s/step worker', 'worker_cpu_per_step_s', '.2f'),
    ('CPU s/step server', 'server_cpu_per_step_s', '.2f'),
    ('MB/step (wire)', 'wire_mb_per_step', '.1f'),
    ('bound samples/s', 'bound_samples_per_s', '.1f'),
    ('of bound', 'fraction_of_bound', '.2f'),
    ('steady of bound', 'steady_fraction_of_bound', '.2f'),
]


def _cells(row, cols):
    out = []
    for _, key, spec in cols:
        if key == 'label' and row.get('status', 'ok') != 'ok':
            out.append(f"{row['label']} ({row['status']})")
            continue
        if key == 'wire_mb_per_step':
            v = _mb(row.get('wire_bytes_per_step'))
        else:
            v = row.get(key)
        out.append(v if spec == 's' else _f(v, spec))
    return out


def group_title(g):
    return (f"{g['workload_desc']} | {rate_label(g['rate_bits'])} per link | "
            f"{g['workers']} workers, {g['servers']} server(s) | bound "
            f"{_f(g.get('bound_samples_per_s'), '.1f')} samples/s ({g.get('bound_by', '-')} "
            f"bound: compute {_f(g.get('compute_s'), '.3f')} s/step, link "
            f"{_f(g.get('link_s'), '.3f')} s/step)")


def md_table(headers, rows):
    lines = ['| ' + ' | '.join(headers) + ' |',
             '|' + '|'.join(['---'] + ['---:'] * (len(headers) - 1)) + '|']
    for r in rows:
        lines.append('| ' + ' | '.join(str(c) for c in r) + ' |')
    return '\n'.join(lines)


def matrix_tables(groups, md=False):
    out = []
    headers = [c[0] for c in MATRIX_COLS]
    for g in groups:
        rows = [_cells(r, MATRIX_COLS) for r in g['rows']]
        if md:
            out.append(f"**{group_title(g)}**\n\n{md_table(headers, rows)}\n")
        else:
            out.append(f"{group_title(g)}\n{text_table(headers, rows)}\n")
    return '\n'.join(out)


SCALING_COLS = [('N', 'workers', 'd'), ('system', 'label', 's'),
                ('samples/s', 'samples_per_s', '.1f'),
                ('ideal N x single', 'ideal_samples_per_s', '.1f'),
                ('efficiency', 'efficiency', '.2f'), ('s/step', 'step_s', '.3f'),
                ('blocked s/step', 'blocked_per_step_s', '.3f'),
                ('bound samples/s', 'bound_samples_per_s', '.1f')]


def scaling_table(scaling, md=False):
    if not scaling.get('rows'):
        return ''
    headers = [c[0] for c in SCALING_COLS]
    rows = []
    for r in scaling['rows']:
        cells = []
        for _, key, spec in SCALING_COLS:
            v = r.get(key)
            if key == 'label' and r.get('status', 'ok') != 'ok':
                v = f"{r['label']} ({r['status']})"
            cells.append(v if spec == 's' else _f(v, spec))
        rows.append(cells)
    title = (f"Scaling: {scaling['workload_desc']} | {rate_label(scaling['rate_bits'])} per "
             f"link | {scaling['servers']} server(s); efficiency = samples/s / (N x "
             f"{scaling['single_samples_per_s']:.1f}, one worker's no-communication "
             f"throughput)")
    return (f"**{title}**\n\n{md_table(headers, rows)}\n" if md
            else f"{title}\n{text_table(headers, rows)}\n")


#: the figures shown with their spread over the seeds (the others: the aggregate alone)
SPREAD = ('time_to_target_s', 'final_accuracy', 'wall_s', 'samples_per_s')


def _pct(target):
    return f'{target:.0%}' if round(target * 100, 6) == round(target * 100) else f'{target:.2%}'


def tta_table(tta, md=False):
    """The time-to-accuracy table: one row per run, or with several seeds one per row of
    the experiment (the MLPerf aggregate with its spread), then each seed's figures."""
    if not tta.get('rows'):
        return ''
    many = seeds.several(tta)
    headers = ['system', f"time to {tta['target']:.0%} (s)"] + (['reached'] if many else []) + [
        'steps to target', 'final accuracy', 'best accuracy', 'whole run (s)', 'steps',
        's/step', 'CPU s/step worker', 'CPU s/step server', 'MB moved per worker']
    rows = []
    for r in seeds.judged(tta):
        label = r['label'] if r.get('status', 'ok') == 'ok' else f"{r['label']} ({r['status']})"
        reached = [f"{r.get('reached', 0)} of {r.get('runs', 0)}"] if many else []
        rows.append([label, seeds.cell(r, 'time_to_target_s', '.2f', 'not reached')] +
                    reached + [seeds.cell(r, key, spec, spread=key in SPREAD) for key, spec in (
                        ('steps_to_target', 'd'), ('final_accuracy', '.4f'),
                        ('best_accuracy', '.4f'), ('wall_s', '.1f'), ('steps', 'd'),
                        ('step_s', '.3f'), ('worker_cpu_per_step_s', '.3f'),
                        ('server_cpu_per_step_s', '.3f'), ('moved_mb_per_worker', '.1f'))])
    title = (f"Time to accuracy: {tta['desc']} | {rate_label(tta['rate_bits'])} per link | "
             f"{tta['workers']} workers, {tta['servers']} server(s)")
    text = (f"**{title}**\n\n{md_table(headers, rows)}\n" if md
            else f"{title}\n{text_table(headers, rows)}\n")
    return text + (per_seed_table(tta, md) if many else '')


def per_seed_table(part, md=False):
    """Every seed's time to the target and final accuracy, one column per seed."""
    order = part.get('seeds') or []
    headers = ['system'] + [f'seed {s}' for s in order]
    rows = []
    for system in dict.fromkeys(r['system'] for r in part['rows']):
        runs = {r.get('seed'): r for r in part['rows'] if r['system'] == system}
        cells = []
        for seed in order:
            r = runs.get(seed)
            if r is None or r.get('status', 'ok') != 'ok':
                cells.append('-' if r is None else r['status'])
                continue
            cells.append(f"{_f(r.get('time_to_target_s'), '.2f', 'not reached')} / "
                         f"{_f(r.get('final_accuracy'), '.4f')}")
        rows.append([next(iter(runs.values()))['label']] + cells)
    title = (f"Each seed: time to {_pct(part['target'])} (s) / final accuracy"
             if isinstance(part.get('target'), float) else
             'Each seed: time to the target (s) / final accuracy')
    intro = f"- {seeds.rule_text(part)}\n"
    return (f"\n{intro}\n**{title}**\n\n{md_table(headers, rows)}\n" if md
            else f"\n{intro}\n{title}\n{text_table(headers, rows)}\n")


def hetero_tables(het, md=False):
    """One table per straggler case, by the wall clock: samples applied per second of
    the job, time from the job's launch until the global model reached the target,
    final accuracy, the job's wall time (with several seeds each row's aggregate with its
    spread, then each seed's figures)."""
    out = []
    for case in het.get('cases', []):
        if not case['rows']:
            continue
        many = seeds.several(case)
        shown = seeds.judged(case)
        base = {key: next((r for r in shown if r['system'] == key and r.get('samples_per_s')),
                          None) for key in ('native-sync', 'ssgd')}
        target = case.get('target', het['target'])
        headers = ['system', 'samples/s applied', 'x native',
                   f"time to {target:.2%} (s)" if isinstance(target, float)
                   else 'time to target (s)'] + (['reached'] if many else []) + [
            'global batches to it', 'x native (sooner)', 'x ssgd (sooner)',
            'final accuracy', 'best accuracy', 'job (s)', 'start-up (s)', 'training (s)',
            'batches per worker']
        rows = [_hetero_cells(r, base, many) for r in shown]
        title = (f"{case['title']} (debug.slowdown {case['slowdown']}): {het['desc']} | "
                 f"{rate_label(het['rate_bits'])} per link | {het['workers']} workers, "
                 f"{het['servers']} server(s)")
        table = md_table(headers, rows) if md else text_table(headers, rows)
        out.append(f"**{title}**\n\n{table}\n" if md else f"{title}\n{table}\n")
        if many:
            out.append(per_seed_table(case, md))
        if case.get('target_rule'):
            out.append(f"- target accuracy: {case['target_rule']}\n")
        if case.get('checks'):
            out.append(checks_text(case['checks']) + '\n')
    return '\n'.join(out)


def _ratio(a, b):
    return _f(a / b if a and b else None, '.2f')


def _hetero_cells(r, base, many):
    """One row of a straggler case's table; the ratios to native dist_sync and ssgd are
    of the figures shown (with several seeds, the aggregates)."""
    ok = r.get('status', 'ok') == 'ok'
    label = r['label'] if ok else f"{r['label']} ({r['status']})"
    native, ssgd = base['native-sync'] or {}, base['ssgd'] or {}
    tt = r.get('time_to_target_s')
    reached = [f"{r.get('reached', 0)} of {r.get('runs', 0)}"] if many else []
    return [label, seeds.cell(r, 'samples_per_s', '.1f'),
            _ratio(r.get('samples_per_s'), native.get('samples_per_s')),
            seeds.cell(r, 'time_to_target_s', '.2f', 'not reached')] + reached + [
            seeds.cell(r, 'steps_to_target', '.1f', spread=False),
            _ratio(native.get('time_to_target_s'), tt),
            _ratio(ssgd.get('time_to_target_s'), tt),
            seeds.cell(r, 'final_accuracy', '.4f'),
            seeds.cell(r, 'best_accuracy', '.4f', spread=False),
            seeds.cell(r, 'wall_s', '.1f'), seeds.cell(r, 'startup_s', '.1f'),
            seeds.cell(r, 'train_s', '.1f'),
            '/'.join(str(x) for x in r.get('worker_steps', [])) or '-']


def checks_text(checks):
    lines = []
    for c in checks:
        mark = {True: 'MET', False: 'NOT MET', None: 'n/a'}[c['met']]
        lines.append(f"- {c['what']}: measured {c['measured']} (target {c['target']}): {mark}")
    return '\n'.join(lines)


# ---- plots ----------------------------------------------------------------------------
def plots(results, outdir, stem='cluster'):
    """The PNG plots of whatever parts ``results`` has (STEM_matrix.png, ...); returns
    their paths."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    outdir = Path(outdir)
    made = []
    groups = [g for g in results.get('matrix', []) if g['rows']]
    if groups:
        made.append(_save(plt, _matrix_plot(plt, groups), outdir / f'{stem}_matrix.png'))
    sc = results.get('scaling') or {}
    if sc.get('rows'):
        made.append(_save(plt, _scaling_plot(plt, sc), outdir / f'{stem}_scaling.png'))
    tta = results.get('tta') or {}
    if tta.get('rows'):
        made.append(_save(plt, _tta_plot(plt, tta, 'digits'), outdir / f'{stem}_tta.png'))
    tc = results.get('tta_comm') or {}
    if tc.get('rows'):
        made.append(_save(plt, _tta_plot(plt, tc, 'wide MLP, digits'),
                          outdir / f'{stem}_tta_comm.png'))
    return made


def _save(plt, fig, path):
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _matrix_plot(plt, groups):
    fig, axes = plt.subplots(len(groups), 1, figsize=(9, 2.6 * len(groups)), squeeze=False)
    for ax, g in zip(axes[:, 0], groups):
        rows = [r for r in g['rows'] if r.get('samples_per_s')]
        labels = [r['label'].replace('ssd_sync ', '').replace('native ', 'native\n')
                  for r in rows]
        vals = [r.get('speedup') or 0 for r in rows]
        frac = [r.get('fraction_of_bound') or 0 for r in rows]
        x = range(len(rows))
        ax.bar([i - 0.2 for i in x], vals, 0.4, label='speedup vs native dist_sync')
        ax.bar([i + 0.2 for i in x], frac, 0.4, label='fraction of the bound')
        ax.axhline(1.0, color='gray', lw=0.8, ls='--')
        ax.set_xticks(list(x))
        ax.set_xticklabels(labels, fontsize=7)
        ax.set_title(f"{g['workload']} @ {rate_label(g['rate_bits'])}, "
                     f"{g['workers']}w/{g['servers']}s", fontsize=9)
        ax.tick_params(axis='y', labelsize=8)
    axes[0, 0].legend(fontsize=7, loc='upper left')
    return fig


def _scaling_plot(plt, sc):
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for key in dict.fromkeys(r['system'] for r in sc['rows']):
        pts = [(r['workers'], r['efficiency']) for r in sc['rows']
               if r['system'] == key and r.get('efficiency') is not None]
        if pts:
            label = next(r['label'] for r in sc['rows'] if r['system'] == key)
            ax.plot(*zip(*pts), marker='o', label=label)
    ax.set_xlabel('workers N')
    ax.set_ylabel('efficiency (vs N x one worker, no comm.)')
    ax.set_ylim(0, 1.1)
    ax.set_xticks(sorted({r['workers'] for r in sc['rows']}))
    _finish_axes(ax, f"{sc['workload']} @ {rate_label(sc['rate_bits'])}")
    return fig


def _tta_plot(plt, tta, what):
    fig, ax = plt.subplots(figsize=(7, 4))
    colors = {key: f'C{i % 10}' for i, key in enumerate(dict.fromkeys(
        r['system'] for r in tta['rows']))}
    labelled = set()
    for r in tta['rows']:       # every seed's curve, one colour per row of the table
        if r.get('curve'):
            t, acc = zip(*[(e[1], e[2]) for e in r['curve']])
            ls = '--' if r['system'].startswith('native') else '-'
            ax.plot(t, acc, ls, color=colors[r['system']], lw=1 if seeds.several(tta) else 1.5,
                    label=None if r['system'] in labelled else r['label'])
            labelled.add(r['system'])
    ax.axhline(tta['target'], color='gray', lw=0.8, ls='--')
    ax.set_xlabel('wall-clock seconds')
    ax.set_ylabel('test accuracy (rank 0)')
    ax.set_ylim(0.5, 1.0)
    _finish_axes(ax, f"{what} @ {rate_label(tta['rate_bits'])}, {tta['workers']} workers")
    return fig


def _finish_axes(ax, title):
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title(title, fontsize=9)
