"""Exploration behind docs/glu.md (kept for the record at this commit only): the
'corrected' state with three gains (rules.GAIN: lsq, model, zero) against estimate and exact.
    python bench/explore_glu/gains.py LRS KS VARIANTS SEEDS STEPS OUT.json
e.g. 0.05,0.2 5,10,20 estimate,exact,corrected:model,corrected:lsq,corrected:zero 3 504 x.json
"""
import sys, os, json, time, multiprocessing as mp
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE)); sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
import numpy as np

def run(cfg):
    import glu_state as G
    from ssdsgd.glu import rules
    rules.GAIN = cfg.get('gain', 'lsq')
    r = G.run_one(cfg)
    r['variant'] = cfg['variant']
    return r

if __name__ == '__main__':
    os.environ['OMP_NUM_THREADS'] = '1'; os.environ['MXNET_ENGINE_TYPE'] = 'NaiveEngine'
    lrs = [float(x) for x in sys.argv[1].split(',')]
    ks = [int(x) for x in sys.argv[2].split(',')]
    variants = sys.argv[3].split(',')
    seeds = int(sys.argv[4]); steps = int(sys.argv[5]); out = sys.argv[6]
    base = dict(steps=steps, short=252, warmup=40, workers=4, batch=16, hidden=64, act='tanh',
                momentum=0.9, wd=1e-4, eval_every=12)
    plan = [dict(base, algorithm='ssgd', state=None, lr=lr, k=None, seed=s, variant='ssgd')
            for lr in lrs for s in range(seeds)]
    for v in variants:
        st, _, gain = v.partition(':')
        plan += [dict(base, algorithm='ssd', state=st, gain=gain or 'lsq', lr=lr, k=k, seed=s, variant=v)
                 for lr in lrs for k in ks for s in range(seeds)]
    t0 = time.time(); res = []
    with mp.get_context('spawn').Pool(2) as pool:
        for i, r in enumerate(pool.imap_unordered(run, plan), 1):
            res.append(r)
            if i % 10 == 0: print(i, len(plan), round(time.time() - t0), flush=True)
    json.dump(res, open(out, 'w'))
    def acc(r, step): return next(c[1] for c in r['curve'] if c[0] == step)
    for lr in lrs:
        ref = {r['seed']: r for r in res if r['variant'] == 'ssgd' and r['lr'] == lr}
        print(f"lr={lr} ssgd@252 {np.mean([acc(r,252) for r in ref.values()]):.3f} @{steps} {np.mean([acc(r,steps) for r in ref.values()]):.3f}")
        for v in variants:
            cells = []
            for k in ks:
                rs = [r for r in res if r['variant'] == v and r['lr'] == lr and r['k'] == k]
                a1 = np.mean([acc(r, 252) for r in rs]); a2 = np.mean([acc(r, steps) for r in rs])
                cells.append(f"k={k}: {a1:.3f}/{a2:.3f}")
            print(f"  {v:16s} " + "  ".join(cells))
