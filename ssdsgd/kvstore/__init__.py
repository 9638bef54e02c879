"""The KVStore: wire protocol, scheduler, servers, the worker's client and the adapter MXNet sees."""
