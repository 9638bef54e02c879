"""Test and benchmark support; not part of the installed package.

- :mod:`.native_ps`: run a job on MXNet's own parameter server (ps-lite), the reference
  ssdsgd is compared against (tests/test_native_ps.py, bench/);
- :mod:`.procs`: a clean environment for a job, stopping process groups, running this
  checkout's ``launch/dist.py`` with a timeout that leaves nothing behind.

Only tests/ and bench/ use it, from a checkout: it runs the checkout's ``launch/dist.py``
and nothing in ``ssdsgd`` imports it. So setup.cfg leaves it out of the wheel
(``exclude = ssdsgd.testing``); it stays importable where the tests and benchmarks run:
from the checkout's root (``python -m pytest``, ``python -m bench.cluster``) and through
an editable install (``pip install -e .``), which maps ``ssdsgd`` to the source tree.
"""
from .native_ps import CompletedWorker, NativePSError, run_native, run_native_nodes
from .procs import clean_env, run_dist, stop_groups

__all__ = ['CompletedWorker', 'NativePSError', 'run_native', 'run_native_nodes',
           'clean_env', 'run_dist', 'stop_groups']
