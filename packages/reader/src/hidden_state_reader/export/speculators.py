"""Compatibility alias: ``hidden_state_reader.apps.export.speculators``.

Kept so the documented ``hidden_state_reader.export.speculators.export_speculators``
keeps working; it re-exports only (an application module, like everything under ``apps``).
"""

from hidden_state_reader.apps.export.speculators import (
    ExportError,
    MissingLastLayerError,
    NothingToExportError,
    export_speculators,
)

__all__ = ["ExportError", "MissingLastLayerError", "NothingToExportError", "export_speculators"]
