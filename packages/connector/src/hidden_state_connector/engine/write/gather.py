"""Gather a request's hidden states out of the paged cache, one bounded chunk at a time.

A chunk is a run of whole blocks. On CUDA each chunk is gathered on a side stream into
one preallocated device staging buffer (the only extra device memory, whatever the
request length), copied asynchronously into a pinned host slab, and an event marks the
copy done; the model's stream is never synchronised. On CPU the gather writes straight
into the host slab with numpy (one thread, no OpenMP team: writer threads gather too,
beside the engine's own OpenMP work).

With fp8 storage (``storage="fp8_e4m3"``) a CUDA chunk is quantized on the side stream
and the slab receives the fp8 bytes and their scales (half the copy of bf16); a CPU
chunk is quantized by the writer thread that writes it (``chunk_payload``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from hidden_state_connector.engine import compat
from hidden_state_connector.engine.config import ConnectorConfig
from hidden_state_connector.engine.layout import CacheLayout
from hidden_state_connector.engine.write.buffers import Slab
from hidden_state_reader.files.publish import has_nonfinite
from hidden_state_reader.format import fp8
from hidden_state_reader.kernels.fp8 import quantize


@dataclass(frozen=True)
class Chunk:
    """Blocks ``[first, first + count)`` of a request, holding tokens ``[start, stop)``."""

    first: int
    count: int
    start: int
    stop: int

    @property
    def num_tokens(self) -> int:
        """Tokens in this chunk."""
        return self.stop - self.start


def plan_chunks(num_tokens: int, block_size: int, blocks_per_chunk: int) -> list[Chunk]:
    """Split ``num_tokens`` into chunks of at most ``blocks_per_chunk`` blocks."""
    chunks = []
    tokens_per_chunk = block_size * blocks_per_chunk
    for start in range(0, num_tokens, tokens_per_chunk):
        stop = min(num_tokens, start + tokens_per_chunk)
        first = start // block_size
        count = -(-(stop - start) // block_size)
        chunks.append(Chunk(first, count, start, stop))
    return chunks


# Integer dtypes of each element size: numpy has no bfloat16, and a copy moves bytes.
_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class Extractor:
    """Copies chunks of the hidden-state cache into host slabs.

    Args:
        kv_cache: The cache-only layer's cache view.
        layout: Its axis order (``compat.probe_layout``).
        blocks_per_chunk: Blocks per chunk; bounds the staging buffer.
        check_nonfinite: Compute a NaN/inf flag per chunk on the device.
        storage: ``"model"`` or ``"fp8_e4m3"`` (``ConnectorConfig.storage_dtype``).
    """

    def __init__(
        self,
        kv_cache: torch.Tensor,
        layout: CacheLayout,
        blocks_per_chunk: int,
        *,
        check_nonfinite: bool,
        storage: str = fp8.STORAGE_MODEL,
    ) -> None:
        self.layout = layout
        self.storage = fp8.check_storage(storage)
        self.view = layout.blocks_tokens_layers(kv_cache)  # [blocks, block_size, layers, hidden]
        self.dtype = kv_cache.dtype
        self.device = kv_cache.device
        self.blocks_per_chunk = blocks_per_chunk
        self.token_bytes = layout.num_layers * layout.hidden_size * self.dtype.itemsize
        self.slab_bytes = blocks_per_chunk * layout.block_size * self.token_bytes
        self.on_cuda = self.device.type == "cuda"
        self.check_nonfinite = check_nonfinite
        self._stream: torch.cuda.Stream | None = None
        self._staging: torch.Tensor | None = None
        self._step_event: torch.cuda.Event | None = None
        self._raw_dtype = _SAME_SIZE_INT[self.dtype.itemsize]
        self._cpu_view = None if self.on_cuda else self.view.view(self._raw_dtype).numpy()
        # On CUDA an fp8 slab holds the chunk's fp8 bytes, then its scales from here on.
        rows = blocks_per_chunk * layout.block_size * layout.num_layers
        self._scales_offset = -(-rows * layout.hidden_size // 16) * 16
        self.device_fp8 = self.on_cuda and self.storage == fp8.STORAGE_FP8
        if self.device_fp8 and self._scales_offset + rows * 4 > self.slab_bytes:
            raise ValueError(f"hidden size {layout.hidden_size} is too small for fp8 storage")

    @classmethod
    def for_settings(
        cls, source: torch.Tensor, layout: CacheLayout, config: ConnectorConfig
    ) -> Extractor:
        """An extractor over ``source`` with chunks of about ``chunk_bytes`` (a block at least).

        Checked and stored as the connector's settings say.
        """
        itemsize = source.dtype.itemsize
        block_bytes = layout.block_size * layout.num_layers * layout.hidden_size * itemsize
        return cls(
            source,
            layout,
            max(1, config.chunk_bytes // block_bytes),
            check_nonfinite=config.check_nonfinite,
            storage=config.storage_dtype,
        )

    @property
    def staging_bytes(self) -> int:
        """Device memory held for gathering (0 on CPU, or before the first chunk)."""
        return 0 if self._staging is None else self._staging.numel() * self.dtype.itemsize

    def plan(self, num_tokens: int) -> list[Chunk]:
        """Chunks for a request of ``num_tokens``."""
        return plan_chunks(num_tokens, self.layout.block_size, self.blocks_per_chunk)

    def _host_view(self, slab: Slab, blocks: int) -> torch.Tensor:
        nbytes = blocks * self.layout.block_size * self.token_bytes
        shape = (blocks, self.layout.block_size, self.layout.num_layers, self.layout.hidden_size)
        return slab.data[:nbytes].view(self.dtype).view(shape)

    def begin_step(self) -> None:
        """Order this step's gathers after everything the model has written so far.

        Call from the engine's thread (its current stream is the model's).
        """
        if self.on_cuda:
            stream = self._cuda_stream()
            stream.wait_stream(torch.cuda.current_stream(self.device))

    def mark_step(self) -> None:
        """Remember how far the model's stream has got (engine's thread, after a step)."""
        if self.on_cuda:
            if self._step_event is None:
                self._step_event = torch.cuda.Event()
            self._step_event.record(torch.cuda.current_stream(self.device))

    def begin_off_thread(self) -> None:
        """``begin_step`` for other threads: order gathers after the last marked step."""
        if self.on_cuda and self._step_event is not None:
            self._cuda_stream().wait_event(self._step_event)

    def _cuda_stream(self) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
            shape = (
                self.blocks_per_chunk,
                self.layout.block_size,
                self.layout.num_layers,
                self.layout.hidden_size,
            )
            self._staging = torch.empty(shape, dtype=self.dtype, device=self.device)
        return self._stream

    @torch.inference_mode()  # writer threads too: the cache and buffers are inference tensors
    def copy(self, block_ids: Sequence[int], chunk: Chunk, slab: Slab) -> None:
        """Start copying one chunk into ``slab`` (asynchronous on CUDA).

        On CUDA, ``slab.event`` is recorded after the copy and ``slab.nonfinite`` is
        filled asynchronously; wait for the event before reading either.
        """
        wanted = block_ids[chunk.first : chunk.first + chunk.count]
        if len(wanted) != chunk.count:  # the rows would come from a stale slab
            raise ValueError(
                f"{len(block_ids)} blocks cannot hold tokens [{chunk.start}, {chunk.stop})"
            )
        host = self._host_view(slab, chunk.count)
        if self._cpu_view is not None:
            # One strided copy per block: the cache view is permuted (vLLM's layouts keep
            # layers outside tokens), and np.take over such a view copies element by
            # element, many times slower (docs/connector.md, "What happens to one request").
            out = host.view(self._raw_dtype).numpy()
            cache = self._cpu_view
            for i, block in enumerate(wanted):
                np.copyto(out[i], cache[block])
            return
        ids = torch.tensor(wanted, dtype=torch.long)
        stream = self._cuda_stream()
        assert self._staging is not None
        staging = self._staging[: chunk.count]
        with torch.cuda.stream(stream):
            with compat.host_sync_allowed():
                ids_dev = ids.to(self.device, non_blocking=True)
            torch.index_select(self.view, 0, ids_dev, out=staging)
            if self.device_fp8:
                self._copy_fp8(staging, chunk, slab)
            else:
                host.copy_(staging, non_blocking=True)
            if self.check_nonfinite:
                valid = staging.reshape(-1, self.layout.num_layers, self.layout.hidden_size)
                bad = ~torch.isfinite(valid[: chunk.num_tokens]).all()
                if slab.nonfinite is None:
                    slab.nonfinite = torch.zeros((), dtype=torch.bool, pin_memory=True)
                slab.nonfinite.copy_(bad, non_blocking=True)
            if slab.event is None:
                slab.event = torch.cuda.Event()
            slab.event.record(stream)
            # The staging buffer is reused by the next chunk on this same stream, so
            # stream order alone keeps it safe.

    def _copy_fp8(self, staging: torch.Tensor, chunk: Chunk, slab: Slab) -> None:
        """Quantize a gathered chunk on the device and copy fp8 and scales to the slab.

        Runs on the side stream; the temporaries are freed into the allocator on that
        same stream, so their reuse is ordered after these copies.
        """
        n, layers, hidden = chunk.num_tokens, self.layout.num_layers, self.layout.hidden_size
        q, scales = quantize(staging.reshape(-1, layers, hidden)[:n])
        slab.data[: n * layers * hidden].view(q.shape).copy_(q.view(torch.uint8), non_blocking=True)
        begin = self._scales_offset
        host_scales = slab.data[begin : begin + n * layers * 4].view(torch.float32)
        host_scales.view(scales.shape).copy_(scales, non_blocking=True)

    def chunk_payload(self, slab: Slab, chunk: Chunk) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What the file gets for a chunk: its bytes, and its fp8 scales (None unless fp8).

        Called by the writer thread after the copy completed. With fp8 storage on the
        CPU the chunk is quantized here, off the engine's thread.
        """
        if self.storage != fp8.STORAGE_FP8:
            return self.chunk_bytes(slab, chunk), None
        n, layers, hidden = chunk.num_tokens, self.layout.num_layers, self.layout.hidden_size
        if self.device_fp8:
            begin = self._scales_offset
            scales = slab.data[begin : begin + n * layers * 4].view(torch.float32)
            return slab.data[: n * layers * hidden], scales.view(n, layers, 1)
        rows = self._host_view(slab, chunk.count).reshape(-1, layers, hidden)[:n]
        with torch.inference_mode():
            return quantize(rows)

    def order_before_compute(self) -> None:
        """Make the model's later work wait for every copy issued so far (CUDA)."""
        if self.on_cuda and self._stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._stream)

    def wait_copies(self) -> None:
        """Return once every copy issued so far has completed (CPU copies already have)."""
        if self.on_cuda and self._stream is not None:
            self._stream.synchronize()

    def record_done(self) -> object | None:
        """An event that completes when every copy issued so far has completed."""
        if not self.on_cuda:
            return None
        event = torch.cuda.Event()
        event.record(self._cuda_stream())
        return event

    def chunk_bytes(self, slab: Slab, chunk: Chunk) -> torch.Tensor:
        """The finished bytes of a chunk in its slab (after the copy completed)."""
        return slab.data[: chunk.num_tokens * self.token_bytes]

    @property
    def stored_itemsize(self) -> int:
        """Bytes per element of a chunk in its slab (1 when the device quantized to fp8)."""
        return 1 if self.device_fp8 else self.dtype.itemsize

    def chunk_rows(self, slab: Slab, chunk: Chunk) -> np.ndarray:
        """A chunk's rows in its slab, as ``uint8 [tokens, layers, row bytes]`` (no copy).

        The model's values, or the fp8 bytes a CUDA slab received; after the copy completed.
        """
        layers, hidden = self.layout.num_layers, self.layout.hidden_size
        row_bytes = hidden * self.stored_itemsize
        data = slab.data[: chunk.num_tokens * layers * row_bytes]
        return data.numpy().reshape(chunk.num_tokens, layers, row_bytes)

    def chunk_nonfinite(self, slab: Slab, chunk: Chunk) -> bool:
        """Whether the chunk holds NaN/inf (after the copy completed)."""
        if slab.nonfinite is not None and self.on_cuda:
            return bool(slab.nonfinite.item())
        host = self._host_view(slab, chunk.count).reshape(
            -1, self.layout.num_layers, self.layout.hidden_size
        )[: chunk.num_tokens]
        return has_nonfinite(host)
