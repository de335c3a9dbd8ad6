"""The connector kv_transfer_config names (serve/kv_connector/config.py CONNECTORS), built for one rank."""

from __future__ import annotations

from serve.kv_connector.base import KVConnectorBase
from serve.kv_connector.offloading import OffloadingConnector

CONNECTORS = {"OffloadingConnector": OffloadingConnector}


def make_connector(config, ctx, cache, blocks) -> KVConnectorBase | None:
    """None without kv_transfer_config. config: the EngineConfig; ctx: the rank's TPContext; cache: its KVPool;
    blocks: its model's layers (each waits for its loads). Checks the disk tier's directory before any collective."""
    kv = config.kv_transfer_config
    if kv is None:
        return None
    kv.check_disk()
    return CONNECTORS[kv.kv_connector](kv, config.block_size, cache.bytes_per_block, ctx.group, cache, blocks,
                                       ctx.rank)
