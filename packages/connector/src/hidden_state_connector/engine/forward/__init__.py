"""Forward capture (``capture: "forward"``, preview): the residual stream from the forward pass.

Hooks installed while vLLM builds the model (``install``, via the connector's plugin) call
one operator (``capture_op``) that copies the chosen layers' pre-norm residual stream into
a fixed-size staging buffer (``staging``), in eager and compiled models alike. After each
step the rows go to host memory (``transfer``); the ingest thread (``ingest``) routes them
to their requests' positions (``routing``) and keeps them on the host (``arena``) until
the write pipeline copies them out like blocks of the hidden-state cache. ``rows``
(``ForwardRows``) and ``planner`` (``ForwardPlanner``) are its two parts behind
``engine.seam``; ``checks`` its refusals.
No KV-cache group, no speculative method. Design: docs/connector.md, "Forward capture
(preview)".
"""
