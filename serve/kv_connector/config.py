"""vLLM's `kv_transfer_config`: which KV connector an engine runs, in which role, with what settings. Plain Python,
no torch: checked where the EngineConfig is made, before any process starts or any collective runs.

    LLM(model, kv_transfer_config={"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                                   "kv_connector_extra_config": {"cpu_bytes": 1 << 30, "disk_path": "/tmp/kv",
                                                                 "disk_bytes": 8 << 30}})
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from serve.nested_config import nested_config

# serve/kv_connector/factory.py builds OffloadingConnector from these settings; PDConnector (P/D's hand-over,
# serve/pd/handover.py: its prefill side kv_producer, its decode side kv_consumer) is built by serve/pd/run.py
CONNECTORS = ("OffloadingConnector", "PDConnector")
ROLES = ("kv_both", "kv_producer", "kv_consumer")  # vLLM's: saves and loads, saves only, loads only
OFFLOADING_KEYS = {"cpu_bytes": "bytes of each rank's CPU tier (default 0: none)",
                   "disk_path": "a directory for each rank's disk tier (default: none)",
                   "disk_bytes": "bytes of each rank's disk tier (needs disk_path)"}


@dataclass(frozen=True)
class KVTransferConfig:
    kv_connector: str
    kv_role: str = "kv_both"
    kv_connector_extra_config: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.kv_connector not in CONNECTORS:
            raise ValueError(f"kv_transfer_config kv_connector={self.kv_connector!r}: choose "
                             f"{' or '.join(CONNECTORS)}")
        if self.kv_role not in ROLES:
            raise ValueError(f"kv_transfer_config kv_role={self.kv_role!r}: choose {', '.join(ROLES)}")
        extra = self.kv_connector_extra_config
        if not isinstance(extra, dict):
            raise ValueError(f"kv_transfer_config kv_connector_extra_config must be a dict, not "
                             f"{type(extra).__name__}")
        if self.kv_connector == "PDConnector":
            if self.kv_role == "kv_both":
                raise ValueError("kv_transfer_config PDConnector: kv_role='kv_producer' (the prefill side) or "
                                 "'kv_consumer' (the decode side)")
            if extra:
                raise ValueError(f"kv_transfer_config PDConnector takes no kv_connector_extra_config (its layout is "
                                 f"pd.*): {sorted(extra)[0]!r}")
            return
        if self.kv_role != "kv_both":
            raise ValueError(f"kv_transfer_config kv_role={self.kv_role!r}: {self.kv_connector} both saves and loads "
                             f"on one engine; use kv_role='kv_both'")
        unknown = sorted(set(extra) - set(OFFLOADING_KEYS))
        if unknown:
            raise ValueError(f"kv_transfer_config kv_connector_extra_config: unknown key {unknown[0]!r}; known: "
                             f"{', '.join(OFFLOADING_KEYS)}")
        for name in ("cpu_bytes", "disk_bytes"):
            v = extra.get(name, 0)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"kv_transfer_config kv_connector_extra_config {name}={v!r} must be an integer "
                                 f"of at least 0")
        path = extra.get("disk_path")
        if path is not None and not isinstance(path, (str, os.PathLike)):
            raise ValueError(f"kv_transfer_config kv_connector_extra_config disk_path={path!r} must be a directory's "
                             f"path")
        if (path is None) != (extra.get("disk_bytes", 0) == 0):
            raise ValueError("kv_transfer_config kv_connector_extra_config: disk_path and disk_bytes go together "
                             "(a disk tier needs both a directory and its size)")
        if not extra.get("cpu_bytes", 0) and path is None:
            raise ValueError("kv_transfer_config OffloadingConnector needs a tier: set cpu_bytes, or disk_path and "
                             "disk_bytes, in kv_connector_extra_config")

    @property
    def cpu_bytes(self) -> int:
        return self.kv_connector_extra_config.get("cpu_bytes", 0)

    @property
    def disk_bytes(self) -> int:
        return self.kv_connector_extra_config.get("disk_bytes", 0)

    @property
    def disk_path(self) -> str | None:
        path = self.kv_connector_extra_config.get("disk_path")
        return None if path is None else os.fspath(path)

    @classmethod
    def of(cls, value) -> "KVTransferConfig | None":
        """None, a KVTransferConfig, or its dict (vLLM's JSON: {"kv_connector": ..., "kv_role": ...,
        "kv_connector_extra_config": {...}})."""
        return nested_config(cls, value, "kv_transfer_config", "{'kv_connector': 'OffloadingConnector', 'kv_role': "
                             "'kv_both', 'kv_connector_extra_config': {'cpu_bytes': 1073741824}}", "kv_connector",
                             CONNECTORS)

    def check_disk(self) -> None:
        """The disk tier's directory can be made and written (a ValueError naming it, else nothing): checked by the
        process that starts the ranks, before any starts, and by each rank before its first collective."""
        path = self.disk_path
        if path is None:
            return
        probe = os.path.join(path, f".probe-{os.getpid()}")
        try:
            os.makedirs(path, exist_ok=True)
            with open(probe, "wb") as f:
                f.write(b"\0")
            os.remove(probe)
        except OSError as exc:
            raise ValueError(f"kv_transfer_config kv_connector_extra_config disk_path={path!r} is not a writable "
                             f"directory: {exc.strerror or exc}") from None
