"""Synchronization policies: what each algorithm decides (which pushes close a round,
who averages with whom), as pure code over events; no sockets, no MXNet state."""
