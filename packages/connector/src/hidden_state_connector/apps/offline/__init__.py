"""Offline dataset extraction: prompts in, one hidden-state file per sample out.

The engine behind ``hidden-state extract``. Modules:

* ``inputs``: read JSONL / JSON / Hugging Face ``save_to_disk`` folders and tokenize
  each record (``text``, chat ``messages`` or ``token_ids``) with the model's tokenizer.
* ``manifest``: the append-only ``manifest.jsonl`` that makes runs resumable.
* ``progress``: the progress line and the final throughput figures.
* ``settings``: ``ExtractOptions`` and the vLLM / connector settings it implies.
* ``result``: ``ExtractResult``, what a run did.
* ``resume``: what earlier runs left (recorded samples, unrecorded files, temporaries).
* ``engine``: starts offline vLLM and feeds it one request at a time.
* ``sample_check``: checks that a sample file holds a prompt's hidden states.
* ``check_pool``: waits for each finished request's file on threads, then checks it.
* ``pipeline``: records -> prompts -> vLLM -> verified files -> manifest.
* ``extract``: one run (``run_extract``): checks, run lock, manifest, progress, Ctrl-C.

Nothing here imports vLLM, torch or transformers at import time.
"""

from hidden_state_connector.apps.offline.errors import UsageError

__all__ = ["UsageError"]
