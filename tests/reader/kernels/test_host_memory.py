"""Recycled host memory (``kernels.host_memory``): reused only once nothing can read it.

Each test builds its own ``_MappingCache`` so the process-wide one (and what other tests
left in it) plays no part.
"""

from __future__ import annotations

import torch

from hidden_state_reader.kernels import host_memory

MiB = 1 << 20


def _tensor(cache: host_memory._MappingCache, nbytes: int) -> torch.Tensor:
    return torch.frombuffer(cache.take(nbytes), dtype=torch.uint8, count=nbytes)


def test_memory_is_reused_only_after_every_tensor_view_and_array_is_gone() -> None:
    cache = host_memory._MappingCache(64 * MiB)
    first = _tensor(cache, 3 * MiB)
    first.fill_(7)
    address = first.data_ptr()
    view = first[8:].view(torch.int16)
    array = first[:16].numpy()
    del first
    assert _tensor(cache, 3 * MiB).data_ptr() != address, "a view still reads it"
    del view
    assert _tensor(cache, 3 * MiB).data_ptr() != address, "a numpy array still reads it"
    del array
    again = _tensor(cache, 4 * MiB)  # same size class (4 MiB): the freed mapping
    assert again.data_ptr() == address
    assert int(again[:16].sum()) == 7 * 16, "recycled memory is not cleared (it is empty())"


def test_size_classes_keep_different_sizes_apart() -> None:
    cache = host_memory._MappingCache(64 * MiB)
    small = _tensor(cache, 3 * MiB)
    address = small.data_ptr()
    del small
    assert _tensor(cache, 5 * MiB).data_ptr() != address  # 8 MiB class
    assert _tensor(cache, 3 * MiB).data_ptr() == address


def test_the_cache_holds_at_most_its_limit_and_drops_unused_mappings_first() -> None:
    cache = host_memory._MappingCache(8 * MiB)
    kept = [_tensor(cache, 4 * MiB), _tensor(cache, 4 * MiB)]  # 8 MiB: the limit
    beyond = _tensor(cache, 4 * MiB)  # in use by a tensor, but not kept for reuse
    assert cache._bytes == 8 * MiB
    beyond.fill_(7)
    del beyond
    fresh = _tensor(cache, 4 * MiB)  # a new mapping (zeros), not the unkept one (unmapped)
    assert int(fresh.max()) == 0
    kept.pop()
    other = _tensor(cache, 2 * MiB)  # no room: the unused 4 MiB mapping is dropped for it
    assert cache._bytes == 6 * MiB
    assert other.numel() == 2 * MiB and len(kept) == 1


def test_large_tensors_come_from_the_process_cache_and_small_ones_from_torch() -> None:
    big = host_memory.empty((3 * MiB // 2,), torch.bfloat16)
    assert big.shape == (3 * MiB // 2,) and big.dtype == torch.bfloat16
    assert big.untyped_storage().nbytes() >= 3 * MiB
    small = host_memory.empty((16,), torch.float32)
    assert small.shape == (16,) and small.untyped_storage().nbytes() == 64


def _mapped(address: int) -> bool:
    """Whether ``address`` lies in one of this process's mappings (``/proc/self/maps``)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            if start <= address < end:
                return True
    return False


def test_a_pools_large_buffer_goes_back_to_the_system_with_its_last_tensor() -> None:
    # A pool's slabs freed at an engine's shutdown must not stay reserved by the process
    # (from malloc's heap they could: a later fork of a large process then fails).
    # Once a freed buffer has raised malloc's mapping threshold (glibc: up to 32 MiB),
    # malloc serves buffers below it from its heap.
    del_me = torch.empty(24 * MiB, dtype=torch.uint8)
    del del_me
    buffer = host_memory.byte_buffer(16 * MiB)
    buffer[::4096].fill_(1)  # touched: its pages are real
    address = buffer.data_ptr()
    view = buffer[MiB:]
    del buffer
    assert _mapped(address), "a view still reads it"
    del view
    assert not _mapped(address)
