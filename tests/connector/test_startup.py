"""vLLM refuses to start on an unusable storage root, and says why (one real start).

The checks themselves run without vLLM in ``tests/connector_unit/test_storage_check.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

# -- one real vLLM start --------------------------------------------------------------

START_LLM = textwrap.dedent(
    """
    import sys
    from hidden_state_connector.apps.server import kv_transfer_config, speculative_config
    from vllm import LLM

    model, root = sys.argv[1], sys.argv[2]
    try:
        LLM(
            model=model,
            dtype="float32",
            max_model_len=256,
            enforce_eager=True,
            kv_cache_memory_bytes=64 * 1024**2,
            skip_tokenizer_init=True,
            speculative_config=speculative_config([1, 2]),
            kv_transfer_config=kv_transfer_config(root),
        )
    except Exception as exc:
        print(f"START FAILED: {type(exc).__name__}: {exc}", flush=True)
        sys.exit(3)
    print("STARTED", flush=True)
    """
)


@pytest.mark.vllm
@pytest.mark.parametrize(
    "multiprocess",
    [
        pytest.param(False, id="in-process"),
        # vllm serve's and LLM's default; ~2.5x the time (two more interpreters start).
        pytest.param(True, id="multiprocess", marks=pytest.mark.long),
    ],
)
def test_vllm_does_not_start_on_a_regular_file_and_says_why(
    tiny_model_fp32: Path, tmp_path: Path, multiprocess: bool
) -> None:
    pytest.importorskip("vllm")
    target = tmp_path / "hs"
    target.write_text("a file where the storage directory should be")
    env = {
        **os.environ,
        "VLLM_LOGGING_LEVEL": "WARNING",
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if multiprocess else "0",
    }
    done = subprocess.run(
        [sys.executable, "-c", START_LLM, str(tiny_model_fp32), str(target)],
        capture_output=True,
        text=True,
        env=env,
        timeout=400,
        check=False,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 3, f"vLLM started (rc {done.returncode}):\n{output[-4000:]}"
    expected = f"shared_storage_path: cannot write hidden states to {str(target)!r}"
    assert expected in output, output[-4000:]
    assert "it exists and is not a directory" in output
    assert "[Errno 17]" not in output
    if multiprocess:
        # The engine's traceback (on the terminal) carries the message; the caller gets
        # vLLM's "Engine core initialization failed. See root cause above."
        assert "START FAILED: RuntimeError" in done.stdout
    else:
        # In-process, the caller's exception is the message itself.
        assert f"START FAILED: StorageRootError: {expected}" in done.stdout
    assert target.read_text() == "a file where the storage directory should be"
