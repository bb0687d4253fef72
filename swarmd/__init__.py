"""swarmd: SWARM parallelism (Ryabinin et al., ICML 2023) for volunteer machines.

The package is laid out by concept:

- ``swarmd.net``: the versioned msgpack wire format, tensor codecs and the aiohttp data plane;
- ``swarmd.dht``: Kademlia membership (peer records, stage discovery);
- ``swarmd.pipeline``: model stages, their executor, routing, averaging and rebalancing;
- ``swarmd.api``: the FastAPI control plane;
- ``swarmd.daemon`` / ``swarmd.cli`` / ``swarmd.config``: one daemon per machine and its CLI.
"""

__version__ = "0.1.0"
