"""Train a small symbol ResNet with MXNet's Module API, ``mod.fit(..., kvstore=...)``, in the
style of MXNet's ``example/image-classification/train_imagenet.py --benchmark 1``:
synthetic images, a residual network built from symbols, SGD with momentum and weight
decay (which Module gives biases and BatchNorm's beta and gamma a wd_mult by name).

    python tests/scripts/module_fit.py --kvstore dist_sync|ssd_sync [--object] --out DIR

``--object`` passes ``mx.kv.create(NAME)`` instead of the name. Writes
DIR/params-rank{rank}.npz (arg and aux parameters) and DIR/meta-rank{rank}.json (rank,
num_workers, the store's type, the optimizer's rescale_grad, the epochs' accuracy).
"""
import argparse
import json
from pathlib import Path

import mxnet as mx
import numpy as np

BATCH, NUM_BATCHES, NUM_CLASSES, SHAPE = 8, 6, 4, (3, 12, 12)


def residual_unit(data, filters, stride, name):
    bn1 = mx.sym.BatchNorm(data, fix_gamma=False, eps=2e-5, name=f"{name}_bn1")
    act1 = mx.sym.Activation(bn1, act_type="relu")
    conv1 = mx.sym.Convolution(act1, num_filter=filters, kernel=(3, 3), stride=stride,
                               pad=(1, 1), no_bias=True, name=f"{name}_conv1")
    bn2 = mx.sym.BatchNorm(conv1, fix_gamma=False, eps=2e-5, name=f"{name}_bn2")
    act2 = mx.sym.Activation(bn2, act_type="relu")
    conv2 = mx.sym.Convolution(act2, num_filter=filters, kernel=(3, 3), pad=(1, 1),
                               no_bias=True, name=f"{name}_conv2")
    shortcut = mx.sym.Convolution(act1, num_filter=filters, kernel=(1, 1), stride=stride,
                                  no_bias=True, name=f"{name}_sc")
    return conv2 + shortcut


def resnet():
    data = mx.sym.Variable("data")
    body = mx.sym.Convolution(data, num_filter=8, kernel=(3, 3), pad=(1, 1), no_bias=True,
                              name="conv0")
    body = residual_unit(body, 8, (1, 1), "stage1")
    body = residual_unit(body, 16, (2, 2), "stage2")
    body = mx.sym.Activation(mx.sym.BatchNorm(body, fix_gamma=False, name="bn_out"),
                             act_type="relu")
    pool = mx.sym.Pooling(body, global_pool=True, kernel=(6, 6), pool_type="avg")
    fc = mx.sym.FullyConnected(mx.sym.Flatten(pool), num_hidden=NUM_CLASSES, name="fc1")
    return mx.sym.SoftmaxOutput(fc, name="softmax")


def synthetic(rank):
    """Each worker's own shard of a fixed synthetic set (the same on every run)."""
    rng = np.random.RandomState(100 + rank)
    x = rng.uniform(-1, 1, (BATCH * NUM_BATCHES, *SHAPE)).astype(np.float32)
    y = rng.randint(0, NUM_CLASSES, BATCH * NUM_BATCHES).astype(np.float32)
    return mx.io.NDArrayIter(x, y, BATCH, label_name="softmax_label")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--kvstore", required=True)
    p.add_argument("--object", action="store_true")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    if "ssd" in a.kvstore:
        import ssdsgd  # noqa: F401 - registers ssd_sync; the native reference runs without
    kv = mx.kv.create(a.kvstore)       # to learn the rank; passed on only with --object
    mx.random.seed(7)
    np.random.seed(7)
    mod = mx.mod.Module(resnet(), context=mx.cpu())
    metric = mx.metric.Accuracy()
    accuracy = []
    mod.fit(synthetic(kv.rank), eval_metric=metric, kvstore=kv if a.object else a.kvstore,
            optimizer="sgd", initializer=mx.init.Xavier(magnitude=2.0), num_epoch=2,
            optimizer_params={"learning_rate": 0.05, "momentum": 0.9, "wd": 1e-3},
            epoch_end_callback=lambda epoch, *_: accuracy.append(metric.get()[1]))
    args, auxs = mod.get_params()
    a.out.mkdir(parents=True, exist_ok=True)
    np.savez(a.out / f"params-rank{kv.rank}.npz",
             **{f"arg:{k}": v.asnumpy() for k, v in args.items()},
             **{f"aux:{k}": v.asnumpy() for k, v in auxs.items()})
    used = mod._kvstore                      # what Module really trained with
    (a.out / f"meta-rank{kv.rank}.json").write_text(json.dumps({
        "rank": kv.rank, "num_workers": kv.num_workers,
        "type": used.type if used is not None else None,
        "rescale_grad": mod._optimizer.rescale_grad, "accuracy": accuracy}))
    if hasattr(kv, "close"):
        kv.close()


if __name__ == "__main__":
    main()
