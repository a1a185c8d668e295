"""The store reader's receive arena (``store.pool``): lent per sample, back when unused.

No store needed: the arena is plain memory until a client registers it.
"""

from __future__ import annotations

import numpy as np
import torch

from hidden_state_reader.store.pool import ALIGN, ReceivePool


def test_a_range_comes_back_only_when_every_view_of_it_is_gone() -> None:
    pool = ReceivePool(4 * ALIGN)
    data = pool.lend(1000)
    assert data is not None and data.nbytes == 1000 and pool.in_use() == 1
    data[:] = 7
    # What a loaded sample keeps: tensors made from numpy views of the bytes.
    hidden = torch.from_numpy(data[8:1000].view(np.int16).reshape(62, 8))
    tokens = hidden[:2]
    del data
    assert pool.in_use() == 1, "the tensors still view it"
    del hidden
    assert pool.in_use() == 1, "a view of a view is a view"
    assert int(tokens[0, 0]) == 0x0707
    del tokens
    assert pool.in_use() == 0


def test_ranges_never_overlap_and_a_full_arena_says_so() -> None:
    pool = ReceivePool(4 * ALIGN)
    lent = [pool.lend(ALIGN) for _ in range(4)]
    assert all(a is not None for a in lent)
    for i, a in enumerate(lent):
        assert a is not None
        a[:] = i
    assert [int(a[0]) for a in lent if a is not None] == [0, 1, 2, 3]
    assert pool.lend(1) is None and pool.misses == 1
    # Two neighbours come back: one range of both sizes fits again.
    first, second = lent[1], lent[2]
    assert first is not None and second is not None
    where = first.ctypes.data
    del lent[1:3], first, second
    again = pool.lend(2 * ALIGN)
    assert again is not None and again.ctypes.data == where
    assert [int(a[0]) for a in lent if a is not None] == [0, 3], "the others are untouched"


def test_lent_memory_outlives_the_pool() -> None:
    pool = ReceivePool(ALIGN)
    data = pool.lend(16)
    assert data is not None
    data[:] = 5
    del pool
    assert data.tolist() == [5] * 16
