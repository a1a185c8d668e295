"""Baseline connectors for the server benchmark, loaded by vLLM via ``kv_connector_module_path``.

* ``NullSinkConnector``: the least a connector can do. With ``extract_hidden_states``
  the model still writes every captured layer into the hidden-state cache, but the
  connector frees each request's blocks at once (``request_finished`` returns
  ``(False, None)``): extraction without any copy-out or disk.
* ``DiscardConnector``: ``HiddenStateConnector`` with its write path replaced, through its
  ``write_hooks`` seam, by one that drops the data: locks, scheduling, slab pool and the
  gather out of the cache all run as in production, only the files are never written.
  Separates "gather" from "disk" in the connector's cost.

Both only run inside vLLM's engine processes (this module imports vLLM).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from hidden_state_connector.connector import HiddenStateConnector
from hidden_state_connector.engine.write.buffers import Slab
from hidden_state_connector.engine.write.gather import Extractor
from hidden_state_connector.engine.write.job import SaveJob
from hidden_state_connector.engine.write.sample_file import FileOptions, WriteHooks


class NullSinkConnector(KVConnectorBase_V1, SupportsHMA):
    """Frees every request's blocks immediately; writes nothing."""

    def __init__(
        self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        pass

    def wait_for_save(self) -> None:
        pass

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        pass

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        return False, None

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict | None]:
        return False, None


def discard_sample(
    job: SaveJob,
    extractor: Extractor,
    options: FileOptions,
    return_slab: Callable[[Slab], None],
    copies_done: Callable[[], None],
) -> str | None:
    """Drain a job's chunks (the gather already happened), write nothing, release the lock.

    A ``SampleWriter`` (``WriteHooks.write_sample``): the pipeline counts the sample as
    written, as it would a published file.
    """
    while True:
        item = job.ready.get()
        if item is None:
            break
        _chunk, slab = item
        return_slab(slab)
    copies_done()
    if job.lock is not None:
        job.lock.release()
    return None


class DiscardConnector(HiddenStateConnector):
    """``HiddenStateConnector`` whose writer threads drop the gathered chunks."""

    write_hooks = WriteHooks(write_sample=discard_sample)
