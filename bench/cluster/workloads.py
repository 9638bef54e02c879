"""What every worker of a row does per step: emulated models (parameter shapes and a
sleep) or real gluoncv models, and the worker's arguments for them."""
from __future__ import annotations

import json
from pathlib import Path

from . import netns, plan
from .plan import Workload

TINY_SHAPES = [[64, 32], [64], [128, 64], [128], [10, 128], [10]]


def model_shapes(model):
    """Trainable parameter shapes of an EMULATED_MODELS entry (or 'tiny')."""
    if model == 'tiny':
        return TINY_SHAPES
    import mxnet as mx
    from gluoncv import model_zoo
    name, shape, _ = plan.EMULATED_MODELS[model]
    net = model_zoo.get_model(name, pretrained=False)
    net.initialize(mx.init.Zero())
    net(mx.nd.zeros(shape))
    return [list(p.shape) for p in net.collect_params().values() if p.grad_req != 'null']

def real_model_bytes(name, image_size):
    import mxnet as mx
    from gluoncv import model_zoo
    net = model_zoo.get_model(name, classes=10, pretrained=False)
    net.initialize(mx.init.Zero())
    net(mx.nd.zeros((1, 3, image_size, image_size)))
    ps = [p for p in net.collect_params().values() if p.grad_req != 'null']
    return sum(p.data().size * 4 for p in ps), len(ps)


PRETTY = {'resnet20': 'ResNet-20', 'resnet50': 'ResNet-50', 'vgg16': 'VGG-16', 'tiny': 'tiny'}


def parse_workload(spec, default_rates, args, raw, ratio=None, ref_rate=None):
    """'emulated:resnet50@1gbit+10gbit' -> (Workload, [rates in bit/s])."""
    body, _, rates = spec.partition('@')
    kind, _, model = body.partition(':')
    rates = [netns.parse_rate(r) for r in (rates.split('+') if rates else default_rates)]
    if kind == 'emulated':
        if model not in plan.EMULATED_MODELS and model != 'tiny':
            raise SystemExit(f'unknown emulated model {model!r}: '
                             f'{", ".join(plan.EMULATED_MODELS)}, tiny')
        shapes = model_shapes(model)
        path = Path(raw) / f'shapes-{model}.json'
        path.write_text(json.dumps({'model': model, 'shapes': shapes}))
        nbytes = sum(4 * _prod(s) for s in shapes)
        batch = plan.EMULATED_MODELS.get(model, (None, None, 32))[2]
        ratio = args.compute_ratio if ratio is None else ratio
        ref = netns.parse_rate(args.compute_ref) if ref_rate is None else ref_rate
        w = Workload(f'emulated {PRETTY.get(model, model)}', 'emulated', model, batch,
                     compute_s=ratio * plan.push_time(nbytes, ref), param_bytes=nbytes,
                     num_keys=len(shapes))
        w.shapes_path = str(path)
        w.compute_rule = f'{ratio:g} x one push at {netns.rate_label(ref)}'
        return w, rates
    if kind == 'real':
        nbytes, nkeys = real_model_bytes(model, 32)
        w = Workload(f'real {model}', 'real', model, args.real_batch, image_size=32,
                     param_bytes=nbytes, num_keys=nkeys)
        return w, rates
    raise SystemExit(f'workload {spec!r}: expected emulated:MODEL or real:GLUONCV_NAME')

def _prod(shape):
    n = 1
    for s in shape:
        n *= int(s)
    return n

def worker_args(workload, steps, warmup):
    args = ['--workload', workload.kind, '--batch', workload.batch, '--steps', steps,
            '--warmup', warmup]
    if workload.kind == 'emulated':
        args += ['--shapes', workload.shapes_path, '--compute-s', f'{workload.compute_s:.6f}']
    else:
        args += ['--model', workload.model, '--image-size', workload.image_size]
    return args
