"""The connector's counters in the shape vLLM's KV-connector metrics logging expects."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

_MAX_KEYS = ("max_queue",)


@dataclass
class HiddenStateConnectorStats(KVConnectorStats):
    """Files, bytes, failures and write time since the last report (summed over workers)."""

    def reset(self) -> None:
        """Clear the counters."""
        self.data: dict[str, Any] = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        """Add another worker's (or interval's) counters."""
        for key, value in (other.data or {}).items():
            if key in _MAX_KEYS:
                self.data[key] = max(self.data.get(key, 0), value)
            else:
                self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        """Summary for one logging interval."""
        data: dict[str, Any] = dict(self.data)
        seconds = data.get("write_seconds", 0.0)
        data["avg_write_ms"] = round(1000 * seconds / data["files"], 3) if data.get("files") else 0
        return data

    def is_empty(self) -> bool:
        """True when nothing happened in the interval."""
        return not any(self.data.values())
