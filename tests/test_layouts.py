"""oneDNN's in-place weight layouts after an inference pass, and ssdsgd's buffer access
(ssdsgd/mxglue/layout.py): real MXNet, a real CIFAR-10 job."""
import mxnet as mx
import numpy as np
import pytest
from mxnet import autograd
from mxnet.gluon import nn

import jobs
from ssdsgd.mxglue import hostcopy, layout
from test_e2e_configs import sets
from test_resume import params, resnet20_job


def conv_net():
    net = nn.HybridSequential()
    net.add(nn.Conv2D(16, 3, in_channels=8))
    net.initialize(mx.init.Xavier())
    net.hybridize(static_alloc=True, static_shape=True)
    return net


@pytest.mark.parametrize("blind", [False, True])
def test_a_kept_view_of_a_weight_reads_and_writes_it_after_an_inference_pass(
        monkeypatch, blind):
    """hostcopy keeps views of a Trainer's arrays between steps. An inference pass (a
    validation) rewrites a convolution's weight in place into a oneDNN layout; writing
    through the kept view then wrote the blocked bytes, which MXNet reordered into
    scrambled weights. ``blind``: where the calls cannot be counted (a compiled
    CachedOp), every check restores."""
    if blind:
        monkeypatch.setattr(layout, "_blind", True)
        assert layout.inferences() != layout.inferences()
    net = conv_net()
    x = mx.nd.random.uniform(shape=(2, 8, 8, 8))
    with autograd.record():
        y = net(x)
    y.backward()
    w = net[0].weight.data()
    views = hostcopy.Views()
    kept, = hostcopy.read([w], copy=False, views=views, slots=["w"])
    assert (kept == w.asnumpy().reshape(-1)).all()
    net(x).asnumpy()            # inference: the weight's buffer now holds another layout
    mx.nd.waitall()
    assert not (kept == w.asnumpy().reshape(-1)).all(), \
        "this MXNet build did not rewrite the weight's layout; the test shows nothing"
    assert (hostcopy.read([w], views=views, slots=["w"])[0] == w.asnumpy().reshape(-1)).all()
    net(x).asnumpy()
    value = np.arange(w.size, dtype=np.float32)
    hostcopy.write([(w, value)], views=views, slots=["w"])
    assert (w.asnumpy().reshape(-1) == value).all()


@pytest.mark.parametrize("algorithm", ["ssgd", "ssd"])
def test_a_job_whose_rank_0_validates_ends_with_the_synchronous_engines_weights(
        tmp_path, algorithm):
    """Rank 0 validates after each epoch; its next step, queued on MXNet's engine, wrote
    the reply (ssgd) or the local update (ssd) into weights left in a oneDNN layout, and
    the job ended with other weights on every run. NaiveEngine runs every operation at
    once, so no step is queued there."""
    # no checkpoint before the last epoch's end: its copies would restore the layouts
    job = resnet20_job(tmp_path, algorithm, checkpoint_every=3)
    got = {}
    for name, env in (("queued", {}), ("naive", {"MXNET_ENGINE_TYPE": "NaiveEngine"})):
        run = jobs.run([*job, *sets(output__dir=tmp_path / name)], timeout=300, env=env)
        assert run.returncode == 0, run.stderr[-3000:]
        assert "Validation" in run.stderr + run.stdout
        run_dir, = (tmp_path / name).iterdir()
        got[name] = params(run_dir / "checkpoints" / "epoch-0002.params")
    differ = [k for k in got["queued"] if not (got["queued"][k] == got["naive"][k]).all()]
    assert differ == [], f"{len(differ)} of {len(got['queued'])} arrays differ, e.g. {differ[:3]}"
