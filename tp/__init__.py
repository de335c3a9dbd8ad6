"""Process groups, devices, the autograd-aware collectives of tensor parallelism, and traffic accounting."""

from tp.comm import copy_to_region, gather_from_region, reduce_from_region, scatter_to_region
from tp.dist import ConfigError, TPContext, init_from_env
from tp.ledger import CommRecord, Traffic, TrafficLedger

__all__ = [
    "CommRecord",
    "ConfigError",
    "TPContext",
    "Traffic",
    "TrafficLedger",
    "copy_to_region",
    "gather_from_region",
    "init_from_env",
    "reduce_from_region",
    "scatter_to_region",
]
