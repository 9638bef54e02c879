"""The KVStore API a script may call, on ssd_sync with ssgd, checked against what MXNet's
dist_sync gives for the same calls (the surface of MXNet 1.9.1's nightly
dist_sync_kvstore.py, in this project's words). Each check prints "ok NAME" on success.

  keys:     string keys (init order numbering), fp16, big arrays split over servers,
            row_sparse init / push / row_sparse_pull, the errors for bad keys.
  trainer:  the Trainer's type checks, reset guard, dense and row_sparse steps.
  asgd:     (SSDSGD_ALGORITHM=asgd) what dist_async refuses is refused.
A job's keys are all ints or all strings (as in MXNet), so the two parts are two jobs.
"""
import os
import sys
import tempfile

import mxnet as mx
import numpy as np

import ssdsgd  # noqa: F401

RATE = 2          # the 'test' optimizer: w += rescale_grad * g
SHAPE, BIG = (2, 3), (1200, 1200)

kv = mx.kv.create(sys.argv[2] if len(sys.argv) > 2 else "ssd_sync")
rank, n = kv.rank, kv.num_workers


def ok(name):
    print(f"rank {rank}: ok {name}", flush=True)


def equal(a, x):
    got = a.asnumpy() if hasattr(a, "asnumpy") else a
    assert np.array_equal(got, np.full(got.shape, x, dtype=got.dtype)), (rank, got.ravel()[:4], x)


def raises(error, text, fn, *args, **kw):
    try:
        fn(*args, **kw)
    except error as e:
        assert text in str(e), (text, str(e))
        return
    raise AssertionError(f"{fn.__name__} did not raise {error.__name__}")


def part_keys():
    assert "dist" in kv.type and "_sync" in kv.type and "async" not in kv.type, kv.type
    assert type(kv).is_capable("optimizer")
    ok("type")
    keys = {"float32": (["3", "5", "7"], ["99"]), "float16": (["4", "6", "8"], ["100"])}
    for dtype, (small, big) in keys.items():
        kv.init(small, [mx.nd.ones(SHAPE, dtype=dtype)] * len(small))
        kv.init(big, [mx.nd.ones(BIG, dtype=dtype)] * len(big))
    kv.init("9", mx.nd.ones((6, 3)).tostype("row_sparse"))
    kv.set_optimizer(mx.optimizer.create("test", rescale_grad=RATE))
    for dtype, (small, big) in keys.items():
        for k, shape in [(k, SHAPE) for k in small] + [(k, BIG) for k in big]:
            for i in range(3):
                kv.push(k, mx.nd.ones(shape, dtype=dtype) * (rank + 1))
                out = mx.nd.zeros(shape, dtype=dtype)
                kv.pull(k, out=out)
                equal(out, (n + 1) * n * RATE / 2 * (i + 1) + 1)
    ok("string keys push pull")
    for i, k in enumerate(str(j) for j in range(200, 204)):
        kv.init(k, mx.nd.ones(SHAPE) * i)
        out = mx.nd.zeros(SHAPE)
        kv.pull(k, out=out)
        equal(out, i)
    ok("init then pull")
    rows = mx.nd.array([1, 4], dtype="int64")
    for i in range(2):
        grad = mx.nd.sparse.retain((mx.nd.ones((6, 3)) * (rank + 1)).tostype("row_sparse"), rows)
        kv.push("9", grad)
        out = mx.nd.sparse.zeros("row_sparse", (6, 3))
        kv.row_sparse_pull("9", out=out, row_ids=mx.nd.array([4, 0, 4], dtype="int64"))
        assert out.stype == "row_sparse" and out.indices.asnumpy().tolist() == [0, 4]
        dense = out.tostype("default").asnumpy()
        equal(dense[0], 1)
        equal(dense[4], (n + 1) * n * RATE / 2 * (i + 1) + 1)
        equal(dense[[1, 2, 3, 5]], 0)
    kv.row_sparse_pull("9", out=out, row_ids=mx.nd.array([], dtype="int64"))
    assert out.indices.size == 0
    raises(mx.MXNetError, "row_sparse_pull", kv.pull, "9", out=out, ignore_sparse=False)
    kv.pull("9", out=out)              # ignore_sparse (the default): nothing to do
    raises(mx.MXNetError, "pushpull into a sparse array", kv.pushpull, "9", grad)
    ok("row_sparse")
    raises(mx.MXNetError, "'never' was never initialized", kv.pull, "never",
           out=mx.nd.zeros(SHAPE))
    raises(mx.MXNetError, "this store's keys are strs", kv.push, 3, mx.nd.zeros(SHAPE))
    raises(mx.MXNetError, "csr arrays are not supported", kv.init, "500",
           mx.nd.ones(SHAPE).tostype("csr"))
    raises(NotImplementedError, "use kv.set_optimizer", kv._set_updater, None)
    raises(AttributeError, "server profiler", getattr, kv, "handle")
    ok("bad keys")


def _trainer(stype, grad_stype, update_on_kv, ctx=(mx.cpu(0), mx.cpu(1))):
    params = mx.gluon.ParameterDict()
    params.get("x", shape=(10, 1), lr_mult=1.0, stype=stype, grad_stype=grad_stype)
    params.initialize(ctx=list(ctx), init="zeros")
    return params, mx.gluon.Trainer(params, "sgd", {"learning_rate": 0.1}, kvstore=kv,
                                    update_on_kvstore=update_on_kv)


def part_trainer():
    # First, while keys 0 and 1 are new: one Trainer, a dense and a row_sparse parameter.
    params = [mx.gluon.Parameter(f"x_{stype}", shape=(10, 1), stype=stype, grad_stype=stype)
              for stype in ("default", "row_sparse")]
    for p in params:
        p.initialize(ctx=mx.cpu(0), init="ones")
    trainer = mx.gluon.Trainer(params, "sgd", {"learning_rate": 1.0}, kvstore=kv)
    rows = mx.nd.arange(0, 10)
    with mx.autograd.record():
        y = (rank + 1) * (params[0].data() + params[1].row_sparse_data(rows))
    y.backward()
    trainer.step(1)
    equal(params[0].data(), 1 - (1 + n) * n / 2)
    equal(params[1].row_sparse_data(rows).tostype("default"), 1 - (1 + n) * n / 2)
    ok("trainer steps")
    for stype, update_on_kv, expected in [("default", None, True), ("default", True, True),
                                          ("default", False, False),
                                          ("row_sparse", None, True),
                                          ("row_sparse", False, ValueError)]:
        _, trainer = _trainer(stype, stype, update_on_kv)
        try:
            trainer._init_kvstore()
            assert trainer._kv_initialized and trainer._update_on_kvstore is expected
        except ValueError:
            assert expected is ValueError
    ok("trainer types")
    params, trainer = _trainer("row_sparse", "row_sparse", None, ctx=[mx.cpu(0)])
    with tempfile.TemporaryDirectory() as tmp:
        saved = os.path.join(tmp, "x.params")
        params.save(saved)
        params["x"].row_sparse_data(mx.nd.arange(0, 4))
        assert trainer._kv_initialized and trainer._update_on_kvstore
        raises(RuntimeError, "Cannot reset distributed KVStore", params.load, saved)
    ok("trainer reset refused")


def part_asgd():
    """asgd has dist_async's semantics, so MXNet's own checks apply to it."""
    assert "dist" in kv.type and "async" in kv.type and "_sync" not in kv.type, kv.type
    params = mx.gluon.ParameterDict()
    params.get("x", shape=(10, 1))
    params.initialize(ctx=mx.cpu(0), init="zeros")
    trainer = mx.gluon.Trainer(params, "sgd", {"learning_rate": 0.1}, kvstore="ssd_sync",
                               update_on_kvstore=False)
    raises(ValueError, "update_on_kvstore=True", trainer._init_kvstore)
    kv.init(5, mx.nd.zeros(SHAPE))
    raises(RuntimeError, "algorithm asgd applies every push on the servers", kv.pushpull,
           5, mx.nd.ones(SHAPE))
    raises(ValueError, "the job's algorithm (SSDSGD_ALGORITHM) is asgd", mx.kv.create,
           "dist_sync_ssdsgd")
    assert mx.kv.create("dist_async_ssdsgd").type == "dist_async_ssdsgd"
    ok("asgd refusals")


{"keys": part_keys, "trainer": part_trainer, "asgd": part_asgd}[sys.argv[1]]()
kv.close()
