"""KV connectors (docs/kv_tiers.md): the seam through which K,V come from, and go to, somewhere other than the
engine's own device pool, vLLM v1's shape.

    base.py        KVConnectorBase: the scheduler side and the worker side, each method a no-op
    config.py      KVTransferConfig: vLLM's kv_transfer_config (kv_connector, kv_role, kv_connector_extra_config)
    tiers.py       TierIndex: which prefix-cache blocks the CPU and disk tiers hold (host only)
    offloading.py  OffloadingConnector: spill to CPU, then disk; load a lower-tier prefix hit back, layer by layer
    factory.py     make_connector: the one kv_transfer_config names, for one rank
"""
