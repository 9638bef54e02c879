"""An emulated cluster on one machine (network namespaces, veth, a bridge, tc) and the
benchmarks that run MXNet's native ps-lite and ssdsgd's ssd_sync side by side on it.

    sudo .venv/bin/python -m bench.cluster [--quick]      (see docs/benchmarks/README.md)

Modules: ``netns`` (the cluster), ``launchers`` (roles onto hosts, for ssdsgd's run_job and
for ps-lite), ``rows`` (a row = a name plus settings, from rows.yaml), ``plan`` (what a
row runs, workloads, bounds), ``workloads`` (models and worker arguments), ``jobs`` (one
row -> one job), ``runner`` (one job on the cluster -> one row's figures), the experiments
``matrix``, ``scaling``, ``tta`` (and tta-comm), ``hetero``, ``targets`` (read from
docs/benchmarks/targets.md), ``report`` (tables, plots), ``pages`` (the generated
markdown), ``args`` and ``__main__`` (the command).
"""
