"""Offline dataset extraction: prompts in, one hidden-state file per sample out.

The engine behind ``hidden-state extract``. Modules:

* ``inputs``: read JSONL / JSON / Hugging Face ``save_to_disk`` folders and tokenize
  each record (``text``, chat ``messages`` or ``token_ids``) with the model's tokenizer.
* ``manifest``: the append-only ``manifest.jsonl`` that makes runs resumable.
* ``progress``: the progress line and the final throughput figures.
* ``extract``: the loop that feeds vLLM and records each sample once its file is final.

Nothing here imports vLLM, torch or transformers at import time.
"""

from hidden_state_connector.offline.errors import UsageError

__all__ = ["UsageError"]
