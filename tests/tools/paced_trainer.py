"""A follow-mode trainer process for tests: reports each batch, then waits for "next".

Usage: paced_trainer.py DIR {workers,cpu}
It follows DIR with ``on_consumed="delete"`` through ``HiddenStateLoader`` (batch 4, two
DataLoader worker processes, or two builder threads with ``device="cpu"``), prints
"ready", starts at the next line on stdin, and for every batch prints the JSON list of
its sample names and then waits for a line on stdin before it asks for the next batch:
the test decides when it is past a batch, and can kill it while it holds one.
"""

from __future__ import annotations

import json
import os
import sys

from hidden_state_reader.training.dataset import HiddenStateDataset
from hidden_state_reader.training.loader import HiddenStateLoader

root, how = sys.argv[1], sys.argv[2]
dataset = HiddenStateDataset(root, follow=True, on_consumed="delete", idle_timeout=30.0)
device = {"device": "cpu"} if how == "cpu" else {}
loader = HiddenStateLoader(dataset, batch_size=4, num_workers=2, **device)
print("ready", flush=True)
sys.stdin.readline()
for batch in loader:
    print(json.dumps([os.path.basename(path) for path in batch["paths"]]), flush=True)
    sys.stdin.readline()
