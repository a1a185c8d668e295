"""``model_config``: the one reader of a model's ``config.json`` and its three users.

Local directories are real folders in ``tmp_path``. Hub ids resolve against a real
huggingface_hub cache layout (``test_serve_cli.fake_hf_cache``) in a fresh process with
``HF_HUB_CACHE`` and ``HF_HUB_OFFLINE=1`` set (huggingface_hub reads them at import), so
nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from test_serve_cli import fake_hf_cache

from hidden_state_connector.apps.demo.options import DemoError
from hidden_state_connector.apps.demo.serving import model_config as demo_model_config
from hidden_state_connector.engine.architecture import check_model_before_start
from hidden_state_connector.layers import num_hidden_layers
from hidden_state_connector.model_config import (
    ModelConfigError,
    ModelConfigMissingError,
    model_config_path,
    read_model_config,
)
from hidden_state_reader.errors import InputError


def model_dir(tmp_path: Path, content: str | bytes | None) -> Path:
    """A model folder whose ``config.json`` holds ``content`` (None: no config.json)."""
    folder = tmp_path / "model"
    folder.mkdir()
    if isinstance(content, bytes):
        (folder / "config.json").write_bytes(content)
    elif content is not None:
        (folder / "config.json").write_text(content)
    return folder


def test_a_local_directorys_config_is_read_from_str_or_path(tmp_path: Path) -> None:
    folder = model_dir(tmp_path, json.dumps({"num_hidden_layers": 4, "architectures": ["X"]}))
    assert read_model_config(folder) == {"num_hidden_layers": 4, "architectures": ["X"]}
    assert read_model_config(str(folder), hub="off") == read_model_config(folder)
    assert model_config_path(folder) == folder / "config.json"


@pytest.mark.parametrize(
    ("content", "words"),
    [
        (None, "config.json: no such file"),
        ("{not json", "is not valid JSON"),
        ("[1, 2]", "holds a JSON list, not an object"),
        (b"\xff\xfe{}", "cannot read"),
    ],
    ids=["missing", "bad-json", "not-an-object", "not-utf8"],
)
def test_a_bad_local_config_is_an_input_error_naming_the_file(
    tmp_path: Path, content: str | bytes | None, words: str
) -> None:
    folder = model_dir(tmp_path, content)
    with pytest.raises(ModelConfigError) as caught:
        read_model_config(folder, hint="pass --layers")
    message = str(caught.value)
    assert str(folder / "config.json") in message and words in message
    assert message.endswith("; pass --layers")
    assert isinstance(caught.value, InputError)  # the CLI reports it in one line, exit 2
    assert isinstance(caught.value, ModelConfigMissingError) == (content is None)


def test_a_path_that_is_no_directory_is_not_looked_up_with_hub_off(tmp_path: Path) -> None:
    with pytest.raises(ModelConfigError, match=r"nope: no such model directory$"):
        read_model_config(tmp_path / "nope", hub="off")


HUB_PROBE = """
import json, sys
from hidden_state_connector.model_config import (
    ModelConfigError, ModelConfigMissingError, read_model_config
)
out = {}
for model, hub in json.loads(sys.argv[1]):
    try:
        out[f"{model} {hub}"] = read_model_config(model, hub=hub, hint="HINT")
    except ModelConfigMissingError as exc:
        out[f"{model} {hub}"] = "missing: " + str(exc)
    except ModelConfigError as exc:
        out[f"{model} {hub}"] = "error: " + str(exc)
print(json.dumps(out))
"""


def test_hub_ids_come_from_the_cache_and_offline_misses_say_so(tmp_path: Path) -> None:
    hf_home = fake_hf_cache(tmp_path / "hf", "org/cached", {"num_hidden_layers": 6})
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(hf_home / "hub")}
    asks = [
        ["org/cached", "cache"],
        ["org/cached", "download"],
        ["org/missing", "cache"],
        ["org/missing", "download"],
        ["not/a/hub/id", "cache"],
        ["org/cached", "off"],
    ]
    proc = subprocess.run(
        [sys.executable, "-c", HUB_PROBE, json.dumps(asks)],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    got: dict[str, Any] = json.loads(proc.stdout)
    assert got["org/cached cache"] == got["org/cached download"] == {"num_hidden_layers": 6}
    cache = str(hf_home / "hub")
    assert got["org/missing cache"] == (
        f"missing: org/missing: config.json is not in the Hugging Face cache ({cache}); HINT"
    )
    assert got["org/missing download"].startswith("missing: org/missing: config.json is not")
    assert "HF_HUB_OFFLINE is set; HINT" in got["org/missing download"]
    assert got["not/a/hub/id cache"] == (
        "error: not/a/hub/id: no such model directory (nor a Hugging Face model id); HINT"
    )
    assert got["org/cached off"] == "error: org/cached: no such model directory; HINT"


def test_the_three_users_keep_their_behaviour(tmp_path: Path) -> None:
    """Layers: None without a config, an error naming the file for a bad one; the
    architecture check: nothing to refuse; the demo: its own error type."""
    empty = model_dir(tmp_path, None)
    assert num_hidden_layers(str(empty)) is None
    check_model_before_start(str(empty), "hidden-state serve")  # vLLM will say
    with pytest.raises(DemoError, match=r"config.json: no such file \(the demo serves"):
        demo_model_config(str(empty))
    (empty / "config.json").write_text("{broken")
    with pytest.raises(InputError, match=r"config.json is not valid JSON .*; pass --layers$"):
        num_hidden_layers(str(empty))
    check_model_before_start(str(empty), "hidden-state serve")
    (empty / "config.json").write_text(json.dumps({"text_config": {"num_hidden_layers": 5}}))
    assert num_hidden_layers(str(empty)) == 5
    assert demo_model_config(str(empty))["num_hidden_layers"] == 5  # text_config merged
