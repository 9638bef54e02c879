"""Test and benchmark helpers: running jobs on MXNet's native parameter server (ps-lite)."""
from .native_ps import CompletedWorker, NativePSError, free_port, run_native

__all__ = ['CompletedWorker', 'NativePSError', 'free_port', 'run_native']
