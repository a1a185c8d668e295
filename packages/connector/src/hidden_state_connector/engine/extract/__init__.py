"""The extract engine (``capture: "extract"``): rows from vLLM's hidden-state KV cache.

vLLM's ``extract_hidden_states`` speculative method stores the chosen layers' hidden
states in a cache-only KV-cache group; a save's rows are the request's blocks there.
``plan`` finds that group and its layers (and refuses what it cannot capture), ``rows``
is its ``seam.RowSource`` (worker half), ``planner`` its ``seam.RowPlanner`` (scheduler
half: nothing to add per step). Nothing is imported here.
"""
