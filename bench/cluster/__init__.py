"""An emulated cluster on one machine (network namespaces, veth, a bridge, tc) and the
benchmarks that run MXNet's native ps-lite and ssdsgd's ssd_sync side by side on it.

    sudo .venv/bin/python -m bench.cluster [--quick]      (see docs/benchmarks/README.md)

Modules: ``netns`` (the cluster), ``launchers`` (roles onto hosts, for ssdsgd's run_job and
for ps-lite), ``plan`` (systems, workloads, bounds), ``runner`` (one job -> one row),
``report`` (tables, plots, markdown), ``__main__`` (the command).
"""
