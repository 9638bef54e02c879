"""Accuracy cost and bytes of push compression schemes, in the simulator on digits.

    nice -n 19 python bench/compression_accuracy.py [--seeds 0,1,2] [--lr 0.05]
        [--schemes none,2bit:0.5,topk:0.1,fp16,sign] [--algos ssgd,ssd5,ssd10]
        [--glu-state exact] [--steps 150] [--json FILE]

The digits MLP of ``python -m ssdsgd.glu.simulate`` (4 workers, batch 16 each, sgd with
momentum 0.9, wd 1e-4, warm-up 10 for ssd), trained by ssdsgd.glu.simulate with each
push compression; prints the test accuracy of the global model (mean over seeds, and
each seed) and the bytes a worker pushes per step. Schemes:
  none          uncompressed float32
  2bit:T        MXNet's 2bit with threshold T (ssdsgd.kvstore.compression)
  topk:R        ssdsgd's topk with ratio R (ssdsgd.kvstore.compression)
  fp16          prototype: float16 pushes with error feedback
  sign          prototype: 1 bit per element, sign of residual + gradient times the
                key's mean |residual + gradient| (scaled sign with error feedback)
The two prototypes were measured when choosing ssdsgd's second scheme and are kept here
(not in ssdsgd) so that the choice can be re-run; docs/spec/compression.md has the table.
"""
import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import mxnet as mx  # noqa: E402

from ssdsgd.glu.simulate import _experiment, simulate  # noqa: E402


class _Residuals:
    def __init__(self, spec):
        self.spec, self.r = spec, {}

    def encode(self, key, grad, slices=None):
        r = self.r.setdefault(key, np.zeros(grad.size, np.float32))
        r += grad
        payload, sent = self.spec.encode(r)
        r -= sent
        return [payload]


class FP16:
    """float16 pushes with error feedback (2x fewer bytes)."""
    def residuals(self):
        return _Residuals(self)

    def encode(self, r):
        half = r.astype(np.float16)
        return half.view(np.uint8), half.astype(np.float32)

    def decode(self, payload, n):
        return payload.view(np.float16).astype(np.float32)


class Sign:
    """Scaled sign with error feedback: 1 bit per element plus one float32 per key."""
    def residuals(self):
        return _Residuals(self)

    def encode(self, r):
        scale = np.float32(np.abs(r).mean(dtype=np.float32))
        positive = r >= 0
        sent = np.where(positive, scale, -scale).astype(np.float32)
        return np.concatenate([np.array([scale], np.float32).view(np.uint8),
                               np.packbits(positive)]), sent

    def decode(self, payload, n):
        scale = payload[:4].view(np.float32)[0]
        positive = np.unpackbits(payload[4:])[:n].astype(bool)
        return np.where(positive, scale, -scale).astype(np.float32)


def scheme(name):
    if name == 'none':
        return None
    if name == 'fp16':
        return FP16()
    if name == 'sign':
        return Sign()
    kind, _, value = name.partition(':')
    if kind == '2bit':
        return {'type': '2bit', 'threshold': float(value)} if value else {'type': '2bit'}
    if kind == 'topk':
        return {'type': 'topk', 'ratio': float(value)} if value else {'type': 'topk'}
    raise SystemExit(f"unknown scheme {name!r}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--seeds', default='0,1,2')
    ap.add_argument('--steps', type=int, default=150)
    ap.add_argument('--lr', type=float, default=0.05)
    ap.add_argument('--momentum', type=float, default=0.9)
    ap.add_argument('--warmup', type=int, default=10)
    ap.add_argument('--glu-state', default='exact', choices=['estimate', 'exact'])
    ap.add_argument('--schemes', default='none,fp16,topk:0.03,topk:0.1,2bit:0.5,2bit:2,sign')
    ap.add_argument('--algos', default='ssgd,ssd5,ssd10', help='ssgd and/or ssdK')
    ap.add_argument('--json', help='append one JSON line per row here')
    args = ap.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(',')]
    print(f"digits MLP, 4 workers x batch 16, sgd lr {args.lr} momentum {args.momentum}, "
          f"{args.steps} steps, ssd: warm-up {args.warmup}, glu/{args.glu_state}; "
          f"test accuracy of w_G, mean over seeds {seeds}")
    print(f"{'scheme':<12}{'algo':<7}{'acc':>7}  {'per seed':<22}{'push B/step':>12}")
    for name in args.schemes.split(','):
        for algo in args.algos.split(','):
            accs, push, start = [], 0, time.time()
            for seed in seeds:
                init, grad_fn, accuracy = _experiment(
                    argparse.Namespace(seed=seed, hidden=64, batch=16, workers=4))

                def make_optimizer():
                    return mx.optimizer.create('sgd', learning_rate=args.lr, wd=1e-4,
                                               momentum=args.momentum, rescale_grad=1 / 16)
                kw = dict(algorithm='ssgd') if algo == 'ssgd' else dict(
                    delay_steps=int(algo[3:]), warmup_steps=args.warmup,
                    glu_state=args.glu_state)
                res = simulate(init, grad_fn, make_optimizer, 4, args.steps,
                               compression=scheme(name), **kw)
                accs.append(accuracy(res.global_weights))
                push = res.push_bytes / 4 / args.steps
            row = {'scheme': name, 'algo': algo, 'lr': args.lr, 'momentum': args.momentum,
                   'glu_state': args.glu_state, 'steps': args.steps, 'seeds': seeds,
                   'acc': float(np.mean(accs)), 'accs': accs, 'push_bytes_per_step': push,
                   'seconds': round(time.time() - start, 1)}
            per_seed = ' '.join(f"{a:.3f}" for a in accs)
            print(f"{name:<12}{algo:<7}{row['acc']:>7.3f}  {per_seed:<22}{push:>12.0f}",
                  flush=True)
            if args.json:
                with open(args.json, 'a') as f:
                    f.write(json.dumps(row) + '\n')


if __name__ == '__main__':
    main()
