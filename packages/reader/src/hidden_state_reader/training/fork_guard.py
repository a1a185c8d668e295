"""What a forked child must never free: page-locked buffers, CUDA events, device tensors.

A forked child cannot use CUDA (the driver's state does not survive ``fork``), yet it
inherits every Python object of its parent, and freeing some of them calls CUDA: a
page-locked buffer that a non-blocking copy read (torch's host allocator records an
event on the copy's stream), a device tensor marked with ``record_stream``, a
``torch.cuda.Event``. In a child that call fails ("CUDA error: initialization error",
from ``ExchangeDevice``) inside a destructor, and the process aborts. DataLoader
workers are forked children, and their garbage collector frees the garbage cycles they
inherited.

``keep_in_forked_children`` registers such objects, weakly (nothing is kept alive in
this process). Around every ``os.fork`` the live ones are referenced; a child keeps
those references for its lifetime (its address space goes with it), the parent drops
them. The fork hooks are installed by the first registration, not on import.
"""

from __future__ import annotations

import ctypes
import os
import threading
import weakref
from typing import Any

import torch

_MIN_PRUNE = 64  # registrations between sweeps of dead references, at least

_lock = threading.Lock()
_refs: list[weakref.ref[Any]] = []
_prune_at = _MIN_PRUNE
_held: list[Any] | None = None  # the live objects, from just before a fork to just after
_hooked = False


def keep_in_forked_children(*objects: Any) -> None:
    """Never free ``objects`` in a process forked from this one (a tensor: its memory).

    Args:
        objects: Tensors (their storage is what is kept) or other weak-referenceable
            objects whose destructor calls CUDA.
    """
    global _hooked, _prune_at, _refs
    refs = [weakref.ref(obj.untyped_storage() if isinstance(obj, torch.Tensor) else obj)
            for obj in objects]  # fmt: skip
    with _lock:
        if not _hooked:
            os.register_at_fork(
                before=_before_fork,
                after_in_parent=_after_in_parent,
                after_in_child=_after_in_child,
            )
            _hooked = True
        _refs.extend(refs)
        if len(_refs) >= _prune_at:
            _refs = [ref for ref in _refs if ref() is not None]
            _prune_at = max(_MIN_PRUNE, 2 * len(_refs))


def _before_fork() -> None:
    """In the parent: reference every live object, so nothing frees one until the child has it."""
    global _held
    _lock.acquire()  # released on both sides of the fork: no other thread holds it there
    _held = [obj for ref in _refs if (obj := ref()) is not None]


def _after_in_parent() -> None:
    global _held
    _held = None
    _lock.release()


def _after_in_child() -> None:
    """In the child: one reference more to each, never given back (even at interpreter exit)."""
    global _held
    for obj in _held or ():
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))
    _held = None
    _lock.release()
