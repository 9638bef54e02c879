"""Several seeds per row (``--seeds``) and the MLPerf aggregate over them.

One seed's time to accuracy moves a lot between seeds (initial weights, data order), so a
comparison on one seed can be luck. The measuring rules ask for 5 seeds reported as MLPerf
does: drop the fastest and the slowest run, take the mean of the rest, and show the
spread. A seed that never reached the target is the slowest; when the runs kept after
dropping are not all ones that reached it (or fewer than 3 reached it), there is no mean:
the row says "not reached in n of N". The checks and the "x sooner" ratios are judged on
these aggregates, never on one seed.

    parse_seeds('0-4')              # [0, 1, 2, 3, 4]
    olympic([12.0, None, 10.0, 11.0, 13.0])['mean']    # 12.0 (10 and "never" dropped)
"""
from __future__ import annotations

import argparse
import re

#: figures whose None means "never reached the target" (the slowest run)
TIME_KEYS = ('time_to_target_s', 'steps_to_target')
#: figures aggregated over the runs that have them (None: not measured)
VALUE_KEYS = ('final_accuracy', 'best_accuracy', 'samples_per_s', 'wall_s', 'startup_s',
              'train_s', 'steps', 'step_s', 'worker_cpu_per_step_s', 'server_cpu_per_step_s',
              'moved_mb_per_worker')
MIN_REACHED = 3         # fewer runs than this at the target: no mean
_PART = re.compile(r'(\d+)(?:-(\d+))?')


def parse_seeds(text):
    """--seeds: a comma list of seeds and ranges ('0-4', '0,3,7', '0-2,9'); a bad one is
    a one-line ArgumentTypeError (argparse prints it as the option's error)."""
    if not str(text).strip():
        raise argparse.ArgumentTypeError('no seed given')
    found = []
    for part in str(text).split(','):
        m = _PART.fullmatch(part.strip())
        if not m:
            raise argparse.ArgumentTypeError(
                f"expected seeds as 0-4 or 0,3,7 (integers >= 0), got {part.strip()!r} "
                f"in {text!r}")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if hi < lo:
            raise argparse.ArgumentTypeError(f'the range {part.strip()} runs backwards')
        for seed in range(lo, hi + 1):
            if seed in found:
                raise argparse.ArgumentTypeError(f'seed {seed} is given twice in {text!r}')
            found.append(seed)
    return found


def seeds_of(args, experiment):
    """The seeds an experiment runs: --seeds, else the one it ran before there was
    --seeds (tta-comm: --tta-comm-seed; tta and hetero: the worker's default, 0)."""
    if getattr(args, 'seeds', None):
        return list(args.seeds)
    if experiment == 'tta-comm' and args.tta_comm_seed is not None:
        return [args.tta_comm_seed]
    return [0]


def olympic(values):
    """The MLPerf aggregate of one row's per-seed figures (None: never reached, the
    slowest): with >= 3 runs the lowest and the highest are dropped and the rest
    averaged, with fewer all are; no mean when a kept run never reached the target or
    fewer than 3 (or than all, below 3 runs) reached it. min and max span every run
    (max None when a run never reached it)."""
    n = len(values)
    got = sorted(v for v in values if v is not None)
    ordered = got + [None] * (n - len(got))
    kept = ordered[1:-1] if n >= 3 else ordered
    enough = len(got) >= min(MIN_REACHED, n)
    mean = sum(kept) / len(kept) if kept and enough and None not in kept else None
    return {'mean': mean, 'min': got[0] if got else None,
            'max': got[-1] if got and len(got) == n else None, 'n': n, 'reached': len(got)}


def aggregate(rows, seeds):
    """One aggregate row per system (in the order the rows first ran) over the runs that
    did not fail: each figure's MLPerf mean, and KEY_spread = [min, max] beside it."""
    out = []
    for system in dict.fromkeys(r['system'] for r in rows):
        runs = [r for r in rows if r['system'] == system]
        ok = [r for r in runs if r.get('status') == 'ok']
        failed = len(runs) - len(ok)
        label = runs[0]['label'] + (f' ({failed} of {len(runs)} seeds failed)'
                                    if failed and ok else '')
        agg = {'system': system, 'label': label, 'all_seeds': list(seeds),
               'seeds': [r.get('seed') for r in ok], 'runs': len(ok), 'failed': failed,
               'status': 'ok' if ok else runs[0].get('status')}
        for key in TIME_KEYS + VALUE_KEYS:
            values = [r.get(key) for r in ok]
            if key in VALUE_KEYS:
                values = [v for v in values if v is not None]
            if key not in TIME_KEYS and not values:
                continue
            a = olympic(values)
            agg[key], agg[f'{key}_spread'] = a['mean'], [a['min'], a['max']]
            if key == 'time_to_target_s':
                agg['reached'] = a['reached']
        out.append(agg)
    return out


def judged(part):
    """The rows a table shows and the checks judge: the aggregates when the part ran
    over several seeds, else its rows (one seed, or a JSON from before --seeds)."""
    if several(part) and part.get('aggregate'):
        return part['aggregate']
    return part.get('rows', [])


def several(part):
    """True when the part's rows ran over more than one seed."""
    return len(part.get('seeds') or ()) > 1


def _num(x, spec):
    return format(int(round(x)) if spec == 'd' else x, spec)


def cell(row, key, spec, none='-', never='not reached', spread=True):
    """A table cell: the figure, and for an aggregate of several runs (unless not
    ``spread``) its spread '[min-max]' ('never' as the max when a run never reached the
    target); a time with no mean says in how many runs it was not reached."""
    v = row.get(key)
    n = row.get('runs', 1)
    if v is not None:
        text = _num(v, '.1f' if n > 1 and spec == 'd' else spec)     # a mean of counts
    elif n > 1 and key in TIME_KEYS:
        text = f"{never} in {n - row.get('reached', 0)} of {n}"
    else:
        text = none
    lo, hi = row.get(f'{key}_spread') or (None, None)
    if n <= 1 or not spread or lo is None:
        return text
    return f"{text} [{_num(lo, spec)}-{'never' if hi is None else _num(hi, spec)}]"


def rule_text(part):
    """One line saying which seeds ran and how the figures are aggregated."""
    seeds = part.get('seeds') or []
    return (f"seeds {', '.join(map(str, seeds))}: every row ran once per seed, the rows of "
            f"a seed one after another; each figure is the MLPerf aggregate (with >= 3 "
            f"seeds the fastest and the slowest run dropped, the mean of the rest), "
            f"[min-max] over all seeds beside it; a seed that never reached the target "
            f"counts as the slowest, and with fewer than {MIN_REACHED} seeds at the target "
            f"(or one of the kept never there) there is no mean")
