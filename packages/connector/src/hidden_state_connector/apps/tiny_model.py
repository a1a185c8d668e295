"""A tiny Llama-architecture model with random weights, to try things without a hub.

``build_tiny_model(directory)`` (or ``hidden-state tiny-model DIR``) writes a complete
Hugging Face model folder, built locally with ``transformers`` and ``tokenizers`` (no
download): a Llama with random weights, hidden 128, 2 heads (head size 64, one vLLM's CPU
attention accepts), 4 layers by default, and a byte-level tokenizer with a
chat template. vLLM (CPU or CUDA) and Hugging Face load it like any local model, so
``hidden-state serve``, ``extract`` and the demo run on it in seconds. The states it
produces are meaningless: it is for trying the pipeline, not for training a drafter.

Example::

    from hidden_state_connector.apps.tiny_model import build_tiny_model

    model_dir = build_tiny_model("/tmp/tiny-llama")  # reused if already built
"""

from __future__ import annotations

import json
import os
from pathlib import Path

BYTE_VOCAB = 256
RECIPE_FILE = "tiny_model_recipe.json"
"""Written last into a built model folder: how it was built (a rebuild is skipped when
the recipe is the same)."""
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""``hidden_size / num_heads`` values vLLM's CPU attention backend takes (0.32; CUDA
backends take more)."""
SPECIAL_TOKENS = ("<s>", "</s>", "<pad>", "<unk>")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _byte_level_tokenizer() -> object:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    for tok in SPECIAL_TOKENS:
        vocab[tok] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_model(
    directory: str | os.PathLike[str],
    *,
    num_layers: int = 4,
    hidden_size: int = 128,
    num_heads: int = 2,
    dtype: str = "bfloat16",
    seed: int = 0,
    arch: str = "llama",
) -> Path:
    """Create (or reuse) a tiny random Llama model directory loadable by vLLM and HF.

    Args:
        directory: Where to save it; reused if it already holds the same configuration.
        num_layers: Decoder layers.
        hidden_size: Model width.
        num_heads: Attention heads (``hidden_size / num_heads`` one of
            ``CPU_HEAD_SIZES`` for vLLM's CPU build).
        dtype: ``"bfloat16"`` or ``"float32"`` weights.
        seed: Weight initialisation seed.
        arch: Architecture (``tiny_archs.ARCHITECTURES``: llama, qwen3, qwen3_moe, ...);
            every one gets the same byte-level tokenizer.

    Returns:
        The model directory.

    Raises:
        ImportError: ``transformers`` or ``tokenizers`` is not installed
            (``pip install "hidden-state-connector[demo]"``).
        ValueError: Unknown ``arch``.
    """
    path = Path(directory)
    recipe = {
        "num_layers": num_layers,
        "hidden_size": hidden_size,
        "num_heads": num_heads,
        "dtype": dtype,
        "seed": seed,
    }
    if arch != "llama":  # recipes of Llama folders built before stay valid
        recipe["arch"] = arch
    stamp = path / RECIPE_FILE
    if stamp.exists() and json.loads(stamp.read_text()) == recipe:
        return path
    path.mkdir(parents=True, exist_ok=True)
    _save_random_model(path, arch, num_layers, hidden_size, num_heads, dtype, seed)
    stamp.write_text(json.dumps(recipe))
    return path


def _save_random_model(
    path: Path, arch: str, num_layers: int, hidden_size: int, num_heads: int, dtype: str, seed: int
) -> None:
    """Save a randomly initialised ``arch`` model and the byte-level tokenizer into ``path``."""
    import torch

    from hidden_state_connector.apps.tiny_archs import TinySize, tiny_config

    tokenizer = _byte_level_tokenizer()
    size = TinySize(
        vocab_size=BYTE_VOCAB + len(SPECIAL_TOKENS),
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        bos_token_id=tokenizer.bos_token_id,  # type: ignore[attr-defined]
        eos_token_id=tokenizer.eos_token_id,  # type: ignore[attr-defined]
        pad_token_id=tokenizer.pad_token_id,  # type: ignore[attr-defined]
    )
    config, model_class = tiny_config(arch, size)
    torch.manual_seed(seed)
    model = model_class(config).to(getattr(torch, dtype))
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)  # type: ignore[attr-defined]
