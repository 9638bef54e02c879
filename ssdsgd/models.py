"""Networks: gluoncv's model zoo (never pretrained) plus two small digits models."""
from __future__ import annotations

from mxnet import gluon
from mxnet.gluon import nn

ZOO_MODELS = ("cifar_resnet20_v1", "cifar_resnet56_v1", "resnet50_v1", "alexnet", "vgg16")


def digits_mlp(classes: int = 10) -> gluon.HybridBlock:
    """64-128-64-classes MLP with ReLU (about 17k parameters)."""
    net = nn.HybridSequential()
    net.add(nn.Flatten(), nn.Dense(128, activation="relu"), nn.Dense(64, activation="relu"),
            nn.Dense(classes))
    return net


def digits_cnn(classes: int = 10) -> gluon.HybridBlock:
    """Two 3x3 convolutions, one 2x2 max-pool, two dense layers (for 1x8x8 input)."""
    net = nn.HybridSequential()
    net.add(nn.Conv2D(32, 3, padding=1, activation="relu"),
            nn.Conv2D(64, 3, padding=1, activation="relu"),
            nn.MaxPool2D(2), nn.Flatten(),
            nn.Dense(128, activation="relu"), nn.Dense(classes))
    return net


def build_model(name: str, classes: int) -> gluon.HybridBlock:
    """The network called ``name`` with ``classes`` outputs, uninitialized, its blocks
    named as in a fresh process (``dense0``...) whatever the process built before: MXNet's
    Trainer orders the parameters, i.e. numbers the kvstore keys and optimizer states, by
    those names, so a checkpoint's states meet their own parameters on resume."""
    import mxnet as mx
    with mx.name.NameManager():
        return _build(name, classes)


def _build(name: str, classes: int) -> gluon.HybridBlock:
    if name == "digits_mlp":
        return digits_mlp(classes)
    if name == "digits_cnn":
        return digits_cnn(classes)
    if name in ZOO_MODELS:
        from gluoncv import model_zoo
        return model_zoo.get_model(name, classes=classes, pretrained=False)
    raise ValueError(f"model.name: unknown model {name!r}")


def initializer(name: str):
    """Weight initializer: Xavier (gaussian, magnitude 2, i.e. He) for all models, as
    gluoncv's training scripts do for ResNets."""
    import mxnet as mx
    return mx.init.Xavier(rnd_type="gaussian", factor_type="in", magnitude=2)
