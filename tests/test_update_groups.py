"""Keys in multi-tensor optimizer calls of similar sizes (ssdsgd.mxglue.update_groups):
bounded work per call, and the same weights as one call for all keys and one per key."""
import mxnet as mx
import numpy as np
import pytest

from ssdsgd.mxglue.update_groups import SLACK, size_groups

MLP = [(2048, 64), (2048,), (2048, 2048), (2048,), (10, 2048), (10,)]


def _sizes(shapes):
    return [int(np.prod(s)) for s in shapes]


@pytest.mark.parametrize("sizes,limit", [
    (_sizes(MLP), 45), ([5] * 100, 45), ([1], 4), ([], 4),
    ([4_194_304, 2_359_296, 2_359_296, 1_048_576, 589_824, 64, 64, 2048, 10], 3)])
def test_groups_cover_every_key_once_with_bounded_visits(sizes, limit):
    groups = size_groups(sizes, limit)
    assert sorted(i for g in groups for i in g) == list(range(len(sizes)))
    for g in groups:
        assert 1 <= len(g) <= limit
        assert max(sizes[i] for i in g) * len(g) <= SLACK * sum(sizes[i] for i in g)


def test_the_wide_layer_gets_a_call_of_its_own():
    assert [2] in size_groups(_sizes(MLP), 45)        # 4.2 M elements, the others <= 130 K


def _update(groups, shapes, steps=3):
    rng = np.random.RandomState(0)
    opt = mx.optimizer.create("sgd", learning_rate=0.1, momentum=0.9, wd=1e-4,
                              rescale_grad=1 / 128)
    opt.aggregate_num = 45
    updater = mx.optimizer.get_updater(opt)
    weights = [mx.nd.array(rng.randn(*s).astype(np.float32)) for s in shapes]
    grads = [mx.nd.array(rng.randn(*s).astype(np.float32)) for s in shapes]
    for _ in range(steps):
        for g in groups:
            updater(list(g), [grads[i] for i in g], [weights[i] for i in g])
    return [w.asnumpy() for w in weights]


def test_grouped_updates_give_the_same_weights_bit_for_bit():
    one_call = _update([list(range(len(MLP)))], MLP)
    for groups in (size_groups(_sizes(MLP), 45), [[i] for i in range(len(MLP))]):
        for a, b in zip(one_call, _update(groups, MLP)):
            np.testing.assert_array_equal(a, b)
