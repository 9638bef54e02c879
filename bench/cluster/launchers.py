"""Start a job's roles on the hosts of an emulated cluster.

* ssdsgd: :class:`NetnsLauncher`, a ``ssdsgd.launch.local.LocalLauncher`` that prefixes
  every command with ``ip netns exec HOST``, so ``run_job(...,
  launcher=NetnsLauncher(layout))`` runs every role in its own namespace. The hosts are
  separate machines, so it is secure as the multi-host launchers are by default: ``run_job``
  makes the job's keys, a 0600 file per process, for aesgcm (or the row's ``curve``;
  ``plain``: not encrypted).
* MXNet's ps-lite: :meth:`Layout.native_node` for ``run_native_nodes(node=...)``.

A :class:`Layout` says which host each role gets: host 0 the scheduler, hosts 1..S the
servers, hosts S+1..S+N the workers.
"""
from __future__ import annotations

from ssdsgd.launch.local import LocalLauncher


class Layout:
    def __init__(self, cluster, num_workers, num_servers):
        need = 1 + num_servers + num_workers
        if need > len(cluster.names):
            raise ValueError(f'{num_workers} workers + {num_servers} servers + scheduler need '
                             f'{need} hosts; the cluster has {len(cluster.names)}')
        self.cluster, self.num_workers, self.num_servers = cluster, num_workers, num_servers

    def host(self, role, rank):
        if role == 'scheduler':
            return 0
        if role == 'server':
            return 1 + rank
        if role == 'worker':
            return 1 + self.num_servers + rank
        raise ValueError(f'unknown role {role!r}')

    def address(self, role, rank):
        return self.cluster.addresses[self.host(role, rank)]

    def worker_hosts(self):
        return [self.host('worker', r) for r in range(self.num_workers)]

    def native_node(self, role, index):
        """For run_native_nodes: (command prefix, DMLC_NODE_HOST) of one ps-lite node."""
        h = self.host(role, index)
        return self.cluster.prefix(h), self.cluster.addresses[h]


class NetnsLauncher(LocalLauncher):
    """ssdsgd's local launcher, with every role in its host's namespace; ``security``:
    ``curve`` or ``aesgcm`` (encrypted, as ssh, mpi and slurm are across hosts by
    default), or ``plain`` (run_job reads ``secure`` and ``cipher``)."""
    name = 'netns'

    def __init__(self, layout, security='aesgcm'):
        self.layout = layout
        self.secure = security != 'plain'
        self.cipher = security if security in ('curve', 'aesgcm') else 'curve'
        self.scheduler_host = layout.address('scheduler', 0)

    def node_env(self, role, rank):
        return {'SSDSGD_NODE_HOST': self.layout.address(role, rank)}

    def start(self, role, rank, cmd, env):
        prefix = self.layout.cluster.prefix(self.layout.host(role, rank))
        return super().start(role, rank, prefix + list(cmd), env)
