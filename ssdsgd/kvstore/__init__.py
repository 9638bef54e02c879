"""The transport: wire protocol, scheduler, servers and the worker's client (nothing above it)."""
