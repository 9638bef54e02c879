"""The global model of a digits job, tested by the benchmark after the job, off every
worker's path: each row's accuracy curve on the job's own clock (seconds from its launch).

Where the global model is (per row):
- ssd_sync with servers that hold it (ssgd, ssd, quorums): the servers' snapshots
  (``ssdsgd/kvstore/snapshots.py``: every few updates, time-stamped, the pushes applied);
  nothing is tested or copied on a worker;
- MXNet's dist_sync: rank 0's weights after each step *are* the global model (every step
  waits for every worker), copied every ``--eval-every`` steps (a 70 KB copy) and tested
  after its training (``cluster_worker.py --deferred-eval``);
- preduce: no process holds a global model before the last group of all; the curve is
  rank 0's own model (copied and tested as above), the last point the average of all.
"""
from __future__ import annotations

from ssdsgd.kvstore.snapshots import read_model


def from_servers(system):
    """Do the servers of ``system``'s jobs hold its global model?"""
    return system.kind == 'ssd' and system.mode != 'preduce'


class DigitsTester:
    """The digits demo's model (``digits_mlp``) and its validation set, in this process."""

    def __init__(self):
        import mxnet as mx
        from ssdsgd.data.digits import DigitsDataset
        from ssdsgd.models import digits_mlp, initializer
        self.mx, self.ds = mx, DigitsDataset()
        self.net = digits_mlp(10)
        self.net.initialize(initializer('digits_mlp'))
        self.net(mx.nd.zeros((1, 64)))
        # the Trainer's keys are the parameters' places in collect_params (cluster_worker)
        self.params = list(self.net.collect_params().values())

    def accuracy(self, model):
        """Top-1 on the validation set of ``model`` ({trainer key: flat array})."""
        if sorted(model) != list(range(len(self.params))):
            raise ValueError(f'a snapshot holds keys {sorted(model)}; the digits model has '
                             f'{len(self.params)} parameters')
        for key, p in enumerate(self.params):
            p.set_data(self.mx.nd.array(model[key].reshape(p.shape)))
        correct = 0
        for x, y in self.ds.val_batches(120):
            out = self.net(self.mx.nd.array(x)).asnumpy()
            correct += int((out.argmax(axis=1) == y).sum())
        return correct / self.ds.n_val


_TESTER = None


def tester():
    global _TESTER
    if _TESTER is None:
        _TESTER = DigitsTester()
    return _TESTER


def server_curve(snapshot_dir, num_servers, num_workers, launched):
    """(curve, final meta) of a job's server snapshots: the curve's points are (global
    batches applied = pushes / N, seconds from the job's launch, accuracy), the final
    model last; meta is the final snapshot's (``pushes``: the pushes the servers applied)."""
    models = read_model(snapshot_dir, num_servers)
    if not models or models[-1][0]['tag'] != 'final':
        raise RuntimeError(f'{snapshot_dir}: the servers wrote no final snapshot')
    t = tester()
    curve = [(meta['pushes'] / num_workers, meta['time'] - launched, t.accuracy(model))
             for meta, model in models]
    return curve, models[-1][0]


def rank0_curve(result, launched):
    """Rank 0's tested copies (``evals``: step, seconds from its start, accuracy) on the
    job's clock."""
    return sorted((step, result['t_start'] + t - launched, acc)
                  for step, t, acc in result['evals'])
