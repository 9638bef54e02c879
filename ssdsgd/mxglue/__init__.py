"""MXNet helpers that know no algorithm and no wire: host copies and views of NDArrays,
asynchronous operations on MXNet's engine, grouped multi-tensor optimizer calls, and
optimizers as descriptions. Every layer above the settings table may use them."""
