"""Export a hidden-state directory into the layout another trainer reads.

``speculators``: vLLM speculators' ``ArrowDataset`` (``hidden-state export --format
speculators``); see ``hidden_state_reader.apps.export.speculators``. Nothing here is imported by
``hidden_state_reader`` itself, and importing this package imports no torch.
"""
