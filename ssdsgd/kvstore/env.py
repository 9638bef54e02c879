"""How a process learns its part in the job: SSDSGD_* environment variables.

MXNet's own launcher configures ps-lite nodes through DMLC_*; ssdsgd does the same with its
own names (docs/design.md), so a worker can be started by any launcher, and ``DMLC_ROLE``
is never needed (it would turn the process into a ps-lite node at ``import mxnet``).
The variables, their defaults and bounds are the rows of ``ssdsgd.settings`` that have one;
``NodeEnv`` has one attribute per such row.
"""
import dataclasses
import os

from ..settings import BY_ENV, REQUIRED, SettingError, read_env


class EnvError(SettingError):
    """A missing or malformed SSDSGD_* variable."""


def _field(setting):
    default = dataclasses.MISSING if setting.default is REQUIRED else setting.default
    return (setting.name, setting.type, dataclasses.field(default=default,
                                                          metadata={"setting": setting}))


def _from_environ(cls, env=None):
    """Read and check every variable (``os.environ`` unless ``env`` is given)."""
    try:
        return cls(**read_env(os.environ if env is None else env))
    except SettingError as e:
        raise EnvError(str(e)) from None


NodeEnv = dataclasses.make_dataclass(
    "NodeEnv", [_field(s) for s in BY_ENV.values()], frozen=True, kw_only=True,
    namespace={"from_environ": classmethod(_from_environ),
               "__doc__": "One process's settings, read from SSDSGD_* variables "
                          "(ssdsgd.settings has one row per attribute)."})
NodeEnv.__module__ = __name__
