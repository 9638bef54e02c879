"""What the benchmark runs: systems, workloads, bounds and step counts (no side effects).

A *system* is one row of a table: MXNet's native ps-lite (dist_sync, dist_async) or
ssd_sync with some settings (``bench.cluster.rows`` makes it from rows.yaml). A
*workload* is what every worker does per step. Bounds:

* compute alone: N * batch / compute time per step (emulated: the configured time; real
  compute: measured by a row with no kvstore, every worker computing at once);
* link alone: every algorithm here pushes every worker's whole gradient every step, so
  the busiest link is a server's downlink, which carries N * P / S bytes per step (P: the
  model's bytes), or a worker's uplink (P bytes) when S > N; pulls (at most as many bytes,
  fewer for ssd) travel the other direction of the full-duplex links. Link time per step
  = max(N / S, 1) * P * 8 / rate, at the nominal rate (Ethernet/IP/TCP headers, ~4.6 % at
  MTU 1500, are part of the gap);
* the bound = N * batch / max(compute time, link time): the throughput the compute alone,
  or the link alone, would allow, whichever is lower.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class System:
    """What a row of the tables runs, as ``bench.cluster.rows`` reads it from rows.yaml."""
    key: str              # the row's name: native-sync, ssd-k5-2bit, defaults, ...
    label: str            # the table's row name
    kind: str             # 'native', 'ssd' or 'none'
    mode: str = ''        # native: dist_sync | dist_async; ssd: sync.algorithm
    k: int = 0            # ssd: sync.delay_steps (0 for the other algorithms; auto: K_MAX)
    p: int = 0            # preduce: sync.group_size
    period: int = 0       # localsgd, diloco: sync.sync_period H (one model sync in H steps)
    compression: str = ''  # push compression type ('2bit', 'topk') or '' for none
    quorum: str = ''      # sync.quorum if the row sets it
    threshold: float = 0.0  # 2bit threshold of this row (0: the benchmark's --threshold)
    ratio: float = 0.0    # topk ratio of this row (0: the benchmark's --topk-ratio)
    warmup: int = -1      # the row's sync.warmup_steps (-1: the experiment's)
    glu_state: str = ''   # the row's sync.glu_state, or '' for --glu-state / the default
    staggered: bool = False  # sync.pull_schedule staggered (docs/spec/staggered_pulls.md)
    state_pulls: bool = False  # ssd: pulls carry the momentum too (glu_state exact; resolved)
    relay: bool = False   # sync.pull_relay chain (docs/spec/pull_relay.md)
    k_auto: bool = False  # ssd: k is the job's choice (sync.delay_steps auto)
    settings: tuple = ()  # ssd_sync: the row's (setting name, value) pairs, for the job
    defaults: bool = False  # a user's defaults (at most sync.compression set): given nothing
    security: str = ''    # ssd_sync: the row's own 'curve' or 'plain' ('': the run's, curve)

    @property
    def synchronous(self):
        """The worker waits for the global weights every step."""
        return (self.kind == 'native' and self.mode == 'dist_sync') or \
            (self.kind == 'ssd' and self.mode == 'ssgd')

    @property
    def pulls_per_step(self):
        if self.period:
            return 1.0 / self.period
        return 1.0 / self.k if self.kind == 'ssd' and self.mode == 'ssd' else 1.0

    @property
    def pushes_per_step(self):
        """localsgd and diloco push a model delta once in H steps; the others every step."""
        return 1.0 / self.period if self.period else 1.0

    @property
    def pull_fraction(self):
        """Bytes pulled per step per model byte: an exact glu_state pull carries the
        momentum SGD's state beside the weights (twice the bytes)."""
        return self.pulls_per_step * (2.0 if self.state_pulls else 1.0)

    def resolved(self, default_glu_state):
        """This system with ``state_pulls`` set from its glu_state (or, if it has none,
        the job's: ``--glu-state`` or the code's default)."""
        exact = self.kind == 'ssd' and self.mode == 'ssd' and \
            (self.glu_state or default_glu_state) == 'exact'
        return replace(self, state_pulls=exact)

    @property
    def push_fraction(self):
        """Bytes a push carries per float32 byte of gradient (2bit: 2 bits of 32; topk:
        8 bytes per sent element at the default ratio 0.1; auto: the job chooses at the
        end of its warm-up, so the bound is the smallest codec's, 2bit's)."""
        return {'': 1.0, '2bit': 1 / 16, 'topk': 0.2, 'auto': 1 / 16}[self.compression]

    def warmup_or(self, default):
        """The warm-up steps this row runs: its own, else ``default``."""
        return default if self.warmup < 0 else self.warmup

    @property
    def straggler_tolerant(self):
        """Does not wait for the slowest worker (issue 11's tolerant rows)."""
        return self.mode == 'preduce' or self.quorum not in ('', 'all')


#: emulated workloads: the gluoncv model whose trainable parameter shapes are exchanged,
#: and the nominal per-worker batch (only to state throughput in samples/s)
EMULATED_MODELS = {
    'resnet20': ('cifar_resnet20_v1', (1, 3, 32, 32), 128),
    'resnet50': ('resnet50_v1', (1, 3, 224, 224), 32),
    'vgg16': ('vgg16', (1, 3, 224, 224), 32),
}


@dataclass
class Workload:
    name: str             # table title part, e.g. 'emulated ResNet-50'
    kind: str             # 'emulated' or 'real'
    model: str            # EMULATED_MODELS key (emulated) or gluoncv name (real)
    batch: int
    compute_s: float = 0.0          # emulated: per step; real: measured (compute-only row)
    image_size: int = 32            # real
    param_bytes: int = 0            # P, filled from the shapes / the model
    num_keys: int = 0
    notes: list = field(default_factory=list)

    def describe(self):
        if self.kind == 'emulated':
            return (f'{self.name}: {self.num_keys} tensors, {self.param_bytes / 1e6:.1f} MB, '
                    f'batch {self.batch}/worker (nominal), compute {self.compute_s * 1e3:.1f} '
                    f'ms/step (sleep)')
        return (f'{self.name}: gluoncv {self.model}, synthetic {self.image_size}x'
                f'{self.image_size}, batch {self.batch}/worker, '
                f'{self.param_bytes / 1e6:.1f} MB of gradients')


def push_time(param_bytes, rate_bits):
    """Seconds one worker's gradient takes over one link at the nominal rate."""
    return param_bytes * 8 / rate_bits


def link_time(param_bytes, rate_bits, num_workers, num_servers, system=None):
    """Seconds per step on the busiest link: the pushes (push_fraction of the model with
    compression) or the pulls, which travel the other way (pull_fraction of the model:
    pulls_per_step, twice that when they carry the momentum), whichever is more. Pulls
    are averaged over the period (the bound of staggered pulls; aligned pulls come as
    one burst per period, docs/spec/staggered_pulls.md). Relayed pulls (docs/spec/
    pull_relay.md) leave a server once, and each worker's uplink carries them on beside
    its own pushes."""
    fan = max(num_workers / num_servers, 1.0)
    scale = fan
    if system is not None and system.relay:
        scale = max(fan * system.push_fraction, system.push_fraction + system.pull_fraction)
    elif system is not None:
        scale = fan * max(system.push_fraction * system.pushes_per_step, system.pull_fraction)
    return push_time(param_bytes, rate_bits) * scale


def bound(workload, rate_bits, num_workers, num_servers, compute_s=None, system=None):
    """(samples/s the bound allows, which side binds: 'compute' or 'link')."""
    c = workload.compute_s if compute_s is None else compute_s
    link = link_time(workload.param_bytes, rate_bits, num_workers, num_servers, system)
    t = max(c, link)
    if t <= 0:
        return None, None
    return num_workers * workload.batch / t, ('link' if link >= c else 'compute')


#: aggregate bytes/s this machine's CPUs are assumed to move through the servers (a rough
#: figure, only to predict step times and so choose step counts and timeouts)
CPU_BYTES_PER_S = 400e6
#: the same for coding compressed pushes (docs/spec/compression.md)
CODEC_BYTES_PER_S = 200e6


def predict_step(system, workload, rate_bits, num_workers, num_servers):
    """A rough step time in seconds (for step counts and timeouts, never for results)."""
    c = workload.compute_s
    link = link_time(workload.param_bytes, rate_bits, num_workers, num_servers, system)
    cpu = 2 * num_workers * workload.param_bytes / CPU_BYTES_PER_S
    if system.compression:      # coding: MXNet's kernel can be ~10x slower than the link
        cpu += num_workers * workload.param_bytes / (
            CODEC_BYTES_PER_S / 10 if system.kind == 'native' else CODEC_BYTES_PER_S)
    if system.kind == 'none':
        return max(c, 1e-3)
    if system.kind == 'ssd' and system.mode == 'ssd':
        t = max(c, link * (1 + system.pulls_per_step), cpu)
    else:
        t = max(c + 2 * link, cpu + c)
    return t + 0.005       # per-step software overhead


def choose_steps(system, predicted_s, target_s, min_steps=5, max_steps=300, min_periods=3):
    """Timed steps so a row takes about target_s; ssd gets at least min_periods pull
    periods (k steps each), so its final drain is spread over several periods, and
    localsgd and diloco as many sync periods (H steps each)."""
    period = system.k or system.period
    lo = max(min_steps, min_periods * period) if period else min_steps
    n = int(round(target_s / max(predicted_s, 1e-3)))
    return max(lo, min(max_steps, n))


def memory_needed(system, workload, num_workers, num_servers):
    """Worst-case bytes a row may hold (gradients queued in flight, server buffers)."""
    p = workload.param_bytes
    per_worker = 4 * p                           # weights, gradients, pull buffer, copy
    if system.kind == 'ssd' and system.mode == 'ssd':
        per_worker += (system.k + 2) * p         # up to k + 1 pushes in flight, a reply
    server = 4 * p / num_servers + 2 * num_workers * p / num_servers
    return num_workers * per_worker + num_servers * server
