"""examples/store_two_process.py runs against a real store and consumes every sample."""

from __future__ import annotations

import subprocess
import sys

from conftest import MASTER, TESTS, StoreCluster, finish, needs_store

pytestmark = needs_store


def test_two_process_example(cluster: StoreCluster) -> None:
    example = TESTS.parent / "examples" / "store_two_process.py"
    proc = cluster.net.popen([sys.executable, str(example), "--master", MASTER, "--count", "12"],
                             stdout=subprocess.PIPE)  # fmt: skip
    result = finish(proc)
    assert result["producer_exit"] == 0
    assert result["consumed"] == list(range(12))
    assert result["stats"]["yielded"] == 12 and result["stats"]["skipped"] == 0
