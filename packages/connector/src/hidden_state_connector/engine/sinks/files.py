"""The files medium (``storage_backend="files"``): samples in ``shared_storage_path``.

The worker half pins each sample's directory beneath the root and creates its lock
(``write.target.pin_sample``); the writer writes the file there. The scheduler half
probes a client-chosen directory and looks for a keyed sample's file.
"""

from __future__ import annotations

import os

from hidden_state_connector.engine.sample_params import sample_exists
from hidden_state_connector.engine.storage_check import usable_directory
from hidden_state_connector.engine.write.target import SampleTarget, pin_sample


class FilesSink:
    """The worker half: samples are files beneath ``root`` (a ``seam.Sink``).

    Args:
        root: The connector's storage root (created here).
        lock: Create each sample's lock (``use_synchronization_lock``).
    """

    always_checksum = False

    def __init__(self, root: str, *, lock: bool) -> None:
        os.makedirs(root, exist_ok=True)
        self.root = root
        self.lock = lock

    def target(self, req_id: str, path: str) -> SampleTarget:
        """Open the sample's directory beneath the root and lock the sample."""
        return pin_sample(self.root, req_id, path, lock=self.lock)

    def staged_path(self, path: str) -> str:
        """The writer writes the file where it is published (through a temp name)."""
        return path

    def close(self) -> None:
        """Nothing to leave."""


class FilesIndex:
    """The scheduler half: samples are files (a ``seam.SinkIndex``)."""

    def unusable(self, path: str) -> str | None:
        """Why ``path``'s directory cannot take samples (probed at most once a while)."""
        return usable_directory(os.path.dirname(path))

    def written(self, path: str) -> bool:
        """Whether the keyed sample's file is published (or consumed since)."""
        return sample_exists(path)

    def client_params(self, path: str) -> dict[str, str] | None:
        """A client learns its sample's path."""
        return None

    def close(self) -> None:
        """Nothing to leave."""
