"""Forward capture (``capture: "forward"``, preview): the residual stream from the forward pass.

Hooks on the model's decoder layers copy the chosen layers' pre-norm residual stream into a
fixed-size staging buffer (``staging``); after the step, the rows of captured requests are
routed to their positions (``routing``) and kept on the host (``arena``) until the write
pipeline copies them out like it copies blocks of the hidden-state cache (``worker``).
No KV-cache group, no speculative method. Design: docs/connector.md, "Forward capture
(preview)".
"""
