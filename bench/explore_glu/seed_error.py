"""Exploration (this commit only): median relative error of worker 0's seeded momentum
against the server's, per glu_state, relu MLP of ssdsgd.glu.simulate, lr 0.05, 150 steps."""
import argparse, sys
import numpy as np, mxnet as mx
from ssdsgd.glu import simulate as S
from ssdsgd.glu import rules as R

def run(state, k, lr, steps=150, warm=10, seed=0, beta=None):
    args = argparse.Namespace(seed=seed, hidden=64, batch=16, workers=4)
    init, grad_fn, acc = S._experiment(args)
    mk = lambda: mx.optimizer.SGD(learning_rate=lr, momentum=0.9, wd=1e-4, rescale_grad=1/16)
    errs = []
    orig = R.make_local_rule
    def patched(*a, **kw):
        rule = orig(*a, **kw)
        rule.needs_state = True
        r0 = rule.reset
        def reset(key, gw, **kw2):
            true = kw2['state'][0].asnumpy()
            st = kw2['state']
            if rule.glu_state != 'exact':
                kw2['state'] = None
            r0(key, gw, **kw2)
            seeded = rule.updater.states[key].asnumpy()
            if key == 0:
                errs.append(np.linalg.norm(seeded - true) / (np.linalg.norm(true) + 1e-12))
        rule.reset = reset
        return rule
    S.make_local_rule = patched
    try:
        res = S.simulate(init, grad_fn, mk, 4, steps, warmup_steps=warm, delay_steps=k, glu_state=state)
    finally:
        S.make_local_rule = orig
    return acc(res.global_weights), np.median(errs[4:]) if len(errs) > 4 else float('nan')

for lr in [0.05]:
    for k in [2, 5, 10, 20]:
        for st in ['estimate', 'recursive', 'corrected', 'exact']:
            a, e = run(st, k, lr)
            print(f"lr={lr} k={k:2d} {st:10s} acc={a:.3f} median rel err of seed={e:.3f}", flush=True)
