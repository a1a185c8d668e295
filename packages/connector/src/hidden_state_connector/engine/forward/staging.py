"""The step's staging buffer: a fixed ``[layers, max_num_batched_tokens, hidden]`` tensor.

Forward hooks on the decoder layers write the captured layers' residual stream into it,
every row of the batch (padding included), at fixed addresses: the buffer never grows or
moves, so a CUDA graph that records the writes can replay them. Rows leave it after the
forward pass (``ForwardRows.after_forward``), before the next step overwrites it. The
staging of each engine is found by its vLLM config (``installed``, ``staging_for``).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch

from hidden_state_connector.engine.forward.adapter import stream_after, stream_before
from hidden_state_connector.engine.forward.capture_op import store_rows_op

# The staging of each engine's model, by ``id(vllm_config)``: the hooks keep it alive.
_installed: weakref.WeakValueDictionary[int, StepStaging] = weakref.WeakValueDictionary()


def installed(vllm_config: Any, staging: StepStaging) -> None:
    """Record ``staging`` as the one hooked into ``vllm_config``'s model."""
    staging.owner = vllm_config
    _installed[id(vllm_config)] = staging


def staging_for(vllm_config: Any) -> StepStaging | None:
    """The staging installed when this engine's model was built (None: none was)."""
    staging = _installed.get(id(vllm_config))
    if staging is None or staging.owner is not vllm_config:
        return None
    return staging


class StepStaging:
    """Holds one step's captured rows and the hooks that fill it.

    Args:
        layer_ids: Captured layer ids, in layer-axis order (ascending).
        max_tokens: Rows per layer (the engine's ``max_num_batched_tokens``).
        hidden_size: Width of a row.
        dtype: The model's activation dtype.
        device: The model's device.
    """

    def __init__(
        self,
        layer_ids: Sequence[int],
        max_tokens: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.layer_ids = list(layer_ids)
        with torch.inference_mode():
            self.rows = torch.zeros(
                len(self.layer_ids), max_tokens, hidden_size, dtype=dtype, device=device
            )
        self._op = store_rows_op()
        self.owner: Any = None  # the vLLM config of the engine whose model it is hooked into
        self._handles: list[Any] = []

    def install(self, layers: Sequence[torch.nn.Module]) -> None:
        """Hook the decoder layers: id 0 before the first, id k after layer k-1."""
        for axis, layer_id in enumerate(self.layer_ids):
            if layer_id == 0:
                handle = layers[0].register_forward_pre_hook(
                    self._before_hook(axis), with_kwargs=True
                )
            else:
                handle = layers[layer_id - 1].register_forward_hook(self._after_hook(axis))
            self._handles.append(handle)

    def remove(self) -> None:
        """Take the hooks off (shutdown)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _store(self, axis: int, hidden: torch.Tensor, residual: torch.Tensor | None) -> None:
        """Write ``hidden (+ residual)`` into rows ``[0, n)`` of layer ``axis``, out of place.

        Out of place and right away: the next layer's fused add-norm updates its inputs in
        place on CUDA. One operator call (``capture_op``), which compiled graphs keep.
        """
        self._op(self.rows, axis, hidden, residual)

    def _after_hook(self, axis: int) -> Any:
        def hook(_module: torch.nn.Module, _args: Any, output: Any) -> None:
            hidden, residual = stream_after(output)
            self._store(axis, hidden, residual)

        return hook

    def _before_hook(self, axis: int) -> Any:
        def hook(_module: torch.nn.Module, args: Any, kwargs: Any) -> None:
            self._store(axis, stream_before(args, kwargs), None)

        return hook
