"""Process groups, devices and the autograd-aware collectives of tensor parallelism."""

from tp.comm import copy_to_region, gather_from_region, reduce_from_region, scatter_to_region
from tp.dist import ConfigError, TPContext, init_from_env

__all__ = [
    "ConfigError",
    "TPContext",
    "copy_to_region",
    "gather_from_region",
    "init_from_env",
    "reduce_from_region",
    "scatter_to_region",
]
