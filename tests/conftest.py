import os

import pytest

from tests.harness import close_all

# Rank processes (LLM's, torchrun's, the pools') do not compile decode's fused kernels: a few seconds per process at
# load, which the suite's budget cannot spend on every model it serves. tests/test_weight_format.py turns them on
# in-process and checks them against eager products; benchmarks/bench_decode.py measures them served.
os.environ.setdefault("TPREF_COMPILE", "0")


@pytest.fixture(scope="session", autouse=True)
def _close_rank_pools():
    yield
    close_all()
