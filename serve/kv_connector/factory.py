"""The connector kv_transfer_config names (serve/kv_connector/config.py CONNECTORS), built for one rank."""

from __future__ import annotations

from serve.kv_connector.base import KVConnectorBase
from serve.kv_connector.offloading import OffloadingConnector

CONNECTORS = {"OffloadingConnector": OffloadingConnector}


def make_connector(config, ctx, cache) -> KVConnectorBase | None:
    """None without kv_transfer_config. config: the EngineConfig; ctx: the rank's TPContext; cache: its KVPool.
    Checks the disk tier's directory before any collective. P/D's PDConnector needs its layout and requests: serve_pd
    (serve/pd/run.py) builds it and hands it to the engine."""
    kv = config.kv_transfer_config
    if kv is None:
        return None
    if kv.kv_connector not in CONNECTORS:
        raise ValueError(f"kv_transfer_config kv_connector={kv.kv_connector!r} is built by P/D's own driver "
                         f"(launch/serve.py pd.prefill_ranks=... pd.decode_ranks=...), not from the settings alone")
    kv.check_disk()
    return CONNECTORS[kv.kv_connector](kv, config.block_size, cache.bytes_per_block, ctx.group, cache, ctx.rank)
