"""The benchmark's rows: a name plus overrides of real settings, read from rows.yaml.

    ssd-k5-2bit: {sync.delay_steps: 5, sync.compression: 2bit}

Each key is a setting of ``ssdsgd.settings`` as the settings table of docs/training.md
spells it (its config key, or its variable if it has none: SSDSGD_PIPELINE_PIECES) or
``kvstore`` (dist_sync, dist_async: MXNet's own parameter server; none: compute
alone) or ``security`` (an ssd_sync row's connections: curve, the default, or plain, as
``--insecure`` makes every row); each value is checked by its setting, and the row's
values together by the
settings' cross-field rules. A bad row is a one-line RowError naming the row and the key.
A new setting needs no new row grammar: a row names it.
"""
from __future__ import annotations

import difflib
from dataclasses import replace
from pathlib import Path

import yaml

from ssdsgd import settings as table
from ssdsgd.sync.auto import K_MAX

from .plan import System

ROWS_FILE = Path(__file__).with_name('rows.yaml')
KVSTORES = ('ssd_sync', 'dist_sync', 'dist_async', 'none')
SECURITY = ('curve', 'aesgcm', 'plain')   # --secure --cipher C, --insecure (docs/reliability.md)
#: settings a row may not set: the experiment decides them, or a launcher does
NOT_A_ROW_SETTING = ('num_workers', 'num_servers', 'launcher', 'hosts', 'max_restarts',
                     'on_worker_failure', 'warmup_epochs', 'checkpoint_every_s', 'start_step',
                     'tamper_relay')


class RowError(ValueError):
    """A row that names an unknown setting or gives a value its setting refuses."""


def spelled(s):
    """How the settings table spells a setting: its config key, else its variable."""
    return s.path or s.env


_SPELLED = {spelled(s): s for s in table.SETTINGS}


def _setting(name, key):
    s = _SPELLED.get(key)
    if s is None:
        close = difflib.get_close_matches(key, list(_SPELLED) + ['kvstore', 'security'], n=1)
        hint = f' (did you mean {close[0]}?)' if close else ''
        raise RowError(f'row {name}: unknown setting {key!r}{hint}; the settings are those '
                       'of docs/training.md, by config key (or variable if it has none)')
    if s.name in NOT_A_ROW_SETTING or s.launcher is not None or \
            (s.env is None and s.name != 'compression'):
        raise RowError(f'row {name}: {key} is not a row setting (the benchmark, its '
                       'experiment or the launcher decides it)')
    return s


def parse_row(name, overrides):
    """The System of row ``name`` with ``overrides`` ({config key: value}); RowError if
    a key is no setting or a value is refused."""
    if not isinstance(overrides, dict):
        raise RowError(f'row {name}: expected a mapping of settings, got {overrides!r}')
    overrides = dict(overrides)
    kvstore = overrides.pop('kvstore', 'ssd_sync')
    if kvstore not in KVSTORES:
        raise RowError(f'row {name}: kvstore: expected one of {", ".join(KVSTORES)}, '
                       f'got {kvstore!r}')
    security = overrides.pop('security', '')
    if security and (security not in SECURITY or kvstore != 'ssd_sync'):
        raise RowError(f'row {name}: security: expected one of {", ".join(SECURITY)} for an '
                       f'ssd_sync row, got {security!r}' + (
                           '' if kvstore == 'ssd_sync' else f' (kvstore {kvstore} cannot be '
                           'secured: MXNet\'s ps-lite has no authentication)'))
    values = {}
    for key, value in overrides.items():
        s = _setting(name, key)
        try:
            values[s.name] = s.check(value)
        except table.SettingError as e:
            raise RowError(f'row {name}: {key}: {e}, got {value!r}') from None
    if kvstore != 'ssd_sync' and set(values) - ({'compression'} if kvstore != 'none'
                                                else set()):
        raise RowError(f'row {name}: a kvstore {kvstore} row takes '
                       f'{"sync.compression only" if kvstore != "none" else "no settings"}, '
                       f'got {", ".join(spelled(table.BY_NAME[n]) for n in values)}')
    try:
        table.cross_check({**_defaults(), **values}, lambda n: spelled(table.BY_NAME[n]))
    except table.SettingError as e:
        raise RowError(f'row {name}: {e}') from None
    return replace(_system(name, kvstore, values), security=security)


def _defaults():
    """Every setting's default but the cluster's size, which the experiment chooses."""
    return {s.name: s.default for s in table.SETTINGS
            if s.default is not table.REQUIRED and s.default is not None
            and s.name not in ('num_workers', 'num_servers')}


def _system(name, kvstore, values):
    kind, _, arg = values.get('compression', 'none').partition(':')
    kind = '' if kind == 'none' else kind
    number = float(arg) if arg else 0.0
    common = dict(compression=kind, threshold=number if kind == '2bit' else 0.0,
                  ratio=number if kind == 'topk' else 0.0)
    if kvstore == 'none':
        return System(name, 'compute only (no kvstore)', 'none')
    if kvstore != 'ssd_sync':
        how = f' + {kind} (push/pull)' if kind else ''
        return System(name, f'native {kvstore}{how}', 'native', kvstore, **common)
    algorithm = values.get('algorithm', table.BY_NAME['algorithm'].default)
    k_setting = values.get('delay_steps', table.BY_NAME['delay_steps'].default)
    # k auto is chosen by the job (ssdsgd/sync/auto.py): plan for the largest it may pick
    k = (table.count_or_auto(k_setting) or K_MAX) if algorithm == 'ssd' else 0
    p = values.get('group_size', table.BY_NAME['group_size'].default) \
        if algorithm == 'preduce' else 0
    period = values.get('sync_period', table.BY_NAME['sync_period'].default) \
        if algorithm in ('localsgd', 'diloco') else 0
    warmup = values.get('warmup_steps', 'auto')
    return System(name, label(values, algorithm, k_setting if k else 0, p), 'ssd', algorithm,
                  k, p, period, k_auto=bool(k) and k_setting == 'auto',
                  quorum=values.get('quorum', ''),
                  warmup=-1 if warmup == 'auto' else int(warmup),
                  glu_state=values.get('glu_state', ''),
                  staggered=values.get('pull_schedule') == 'staggered',
                  relay=values.get('pull_relay') == 'chain',
                  settings=tuple((n, v) for n, v in values.items() if n != 'compression'),
                  defaults=set(values) <= {'compression'}, **common)


#: how a label names a setting a row changes (others: "key value")
_SAID = {
    'compression': lambda v: f" + {v.replace(':', ' t=' if v.startswith('2bit') else ' r=')}",
    'quorum': lambda v: f' + {v}',
    'warmup_steps': lambda v: f', warm-up {v}',
    'glu_state': lambda v: f' ({v})',
    'pull_schedule': lambda v: ', staggered pulls' if v == 'staggered' else ', aligned pulls',
    'pull_relay': lambda v: ', relayed pulls' if v == 'chain' else ', pulls from the servers',
}


def label(values, algorithm, k, p):
    """The table's name of an ssd_sync row: the algorithm, then what the row changes."""
    if set(values) <= {'compression'}:          # a user's defaults, compressed or not
        return 'ssd_sync defaults' + ''.join(_SAID['compression'](str(v))
                                             for v in values.values())
    text = f'ssd_sync {algorithm}' + (f' k={k}' if k else '') + (f' P={p}' if p else '')
    for name, value in values.items():
        if name in ('algorithm', 'delay_steps', 'group_size'):
            continue
        said = _SAID.get(name)
        s = table.BY_NAME[name]
        text += said(str(value)) if said else f', {s.key or s.name} {value}'
    return text


class Catalog:
    """Every row of a rows file, and each experiment's default rows."""

    def __init__(self, path=ROWS_FILE):
        try:
            data = yaml.safe_load(Path(path).read_text())
        except (OSError, yaml.YAMLError) as e:
            raise RowError(f'{path}: cannot read the rows: {e}') from None
        if not isinstance(data, dict) or not isinstance(data.get('rows'), dict):
            raise RowError(f'{path}: expected a mapping with "rows" and "experiments"')
        self.systems = {name: parse_row(name, o or {}) for name, o in data['rows'].items()}
        self.experiments = dict(data.get('experiments') or {})
        for exp, names in self.experiments.items():
            for n in names:
                self.get(n, f'{path}: experiment {exp}')

    def get(self, name, where='--systems'):
        if name not in self.systems:
            close = difflib.get_close_matches(name, list(self.systems), n=1)
            hint = f' (did you mean {close[0]}?)' if close else ''
            raise RowError(f'{where}: unknown row {name!r}{hint}; rows are defined in '
                           f'{ROWS_FILE.relative_to(ROWS_FILE.parents[2])}')
        return self.systems[name]

    def add(self, spec):
        """A row from the command line: 'NAME:KEY=VALUE[,KEY=VALUE...]' (values as YAML)."""
        name, sep, body = spec.partition(':')
        if not sep or not name:
            raise RowError(f'--row {spec!r}: expected NAME:KEY=VALUE[,KEY=VALUE...]')
        overrides = {}
        for item in filter(None, body.split(',')):
            key, eq, value = item.partition('=')
            if not eq:
                raise RowError(f'--row {spec!r}: expected KEY=VALUE, got {item!r}')
            overrides[key.strip()] = yaml.safe_load(value)
        self.systems[name] = parse_row(name, overrides)
        return self.systems[name]

    def names(self, experiment, given=None):
        """The rows of ``experiment``: ``given`` (a comma list) or its default rows."""
        keys = [t.strip() for t in given.split(',') if t.strip()] if given else \
            self.experiments.get(experiment, [])
        return [self.get(k) for k in keys]


_CATALOG = None


def catalog():
    """The rows of rows.yaml (read once)."""
    global _CATALOG
    if _CATALOG is None:
        _CATALOG = Catalog()
    return _CATALOG


def system(name):
    return catalog().get(name)
