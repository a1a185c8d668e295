"""Injected disk faults for the write-path tests: a chunk write that waits, or fails.

The one kind of mock the write-path tests use: it holds a writer thread inside
``SampleFileWriter.write_hidden`` (so a test decides when a slab comes back) or makes
it raise (a full disk), which real files cannot be made to do on cue.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

from hidden_state_reader.files.publish import SampleFileWriter

WAIT_S = 10.0  # generous bound for anything a thread must do


class StuckDisk:
    """Makes every ``write_hidden`` wait until ``release`` (or raise ``error``).

    Attributes:
        entered: Set when a writer thread reached a chunk write.
        release: Set it to let the held writes go on.
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch, error: OSError | None = None) -> None:
        self.entered, self.release = threading.Event(), threading.Event()
        real = SampleFileWriter.write_hidden

        def write_hidden(writer: SampleFileWriter, chunk: Any) -> None:
            self.entered.set()
            if error is not None:
                raise error
            self.release.wait(WAIT_S)
            real(writer, chunk)

        monkeypatch.setattr(SampleFileWriter, "write_hidden", write_hidden)
