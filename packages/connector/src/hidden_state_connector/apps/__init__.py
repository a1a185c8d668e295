"""Applications built on the connector and the reader.

``cli`` (``hidden-state serve``/``extract``/``demo``/``tiny-model``, added to the reader's
``hidden-state`` command through the ``hidden_state.cli`` entry points), ``offline`` (the
engine behind ``extract``), ``demo``, ``server`` (the ``vllm serve`` launcher) and
``tiny_model``/``tiny_archs`` (the tiny test models). The library (everything outside
``apps``) never imports these (docs/contributing.md, "Code layout").
"""
