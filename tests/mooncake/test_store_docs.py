"""docs/scale-out.md's DataLoader recipe, run as written against a real store.

The samples are published one at a time, each only after the previous one reached the
training loop: a recipe that made a finished sample wait for the other worker (a plain
``DataLoader`` returns the workers' batches in turn) would hold one back until the
idle timeout, far beyond the deadline here.
"""

from __future__ import annotations

import json
import re
import select
import subprocess
import sys
from pathlib import Path

from store_cluster import StoreCluster, needs_store, url, write_store_samples

pytestmark = needs_store

DOC = Path(__file__).resolve().parents[2] / "docs" / "scale-out.md"
DOC_URL = '"mooncake://127.0.0.1:50051/hs?hostname=127.0.0.1"'
DEADLINE_S = 120.0  # the recipe's idle timeout below is 600 s


def loader_recipe(prefix: str) -> str:
    """The doc's HiddenStateLoader block, pointed at ``prefix``, printing each batch."""
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.DOTALL)
    [code] = [b for b in blocks if "HiddenStateLoader(" in b]
    assert DOC_URL in code and "follow=True)" in code and "    ...  #" in code
    code = code.replace(DOC_URL, repr(url(prefix)))
    code = code.replace("follow=True)", "follow=True, idle_timeout=600)")
    body = '    print(json.dumps([p.rsplit("/", 1)[1] for p in batch["paths"]]), flush=True)'
    code = re.sub(r"    \.\.\.  #.*", body, code)
    return "import json\n" + code


def next_line(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], DEADLINE_S)
    assert ready, f"no batch within {DEADLINE_S:.0f}s: a finished sample was held back"
    return proc.stdout.readline()


def test_the_dataloader_recipe_hands_on_every_sample_at_once(
    cluster: StoreCluster, tmp_path: Path
) -> None:
    names = [f"doc-{i}" for i in range(4)]
    trainer = cluster.net.popen(
        [sys.executable, "-c", loader_recipe("docloader")], stdout=subprocess.PIPE
    )
    try:
        got = []
        for name in names:
            write_store_samples(tmp_path / name, [name])
            published = cluster.role("produce", "--prefix", "docloader", "--files",
                                     str(tmp_path / name))["published"]  # fmt: skip
            assert published == [f"{name}.safetensors"]
            got += json.loads(next_line(trainer))
        assert got == [f"{n}.safetensors" for n in names]
    finally:
        trainer.kill()
        trainer.wait()
