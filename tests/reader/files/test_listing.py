"""The directory scan: one name per sample, as ``classify`` judges each entry; natural order."""

from __future__ import annotations

import random
import re
from pathlib import Path

from hidden_state_reader.files.listing import list_entries, list_samples, scan_samples
from hidden_state_reader.format import Kind, classify, natural_key, sample_key

# Pieces of names a storage directory can hold: samples, locks, temporaries of both
# writers, hidden entries, odd characters (a newline, non-ASCII digits).
PIECES = ["hs_", "7", "10", "٣", ".", ".safetensors", ".lock", ".tmp.", ".tmpAb12Cd", "x", "\n"]


def _tricky_names(count: int, seed: int) -> set[str]:
    rng = random.Random(seed)
    names = {"".join(rng.choice(PIECES) for _ in range(rng.randint(1, 5))) for _ in range(count)}
    return {n for n in names if n not in (".", "..") and len(n.encode()) < 200}


def test_scans_find_what_classify_calls_data_and_lock_files(tmp_path: Path) -> None:
    names = _tricky_names(3000, seed=3)
    for name in names:
        (tmp_path / name).touch()
    expected = {sample_key(n) for n in names if classify(n) in (Kind.DATA, Kind.LOCK)}
    temps = sorted((n for n in names if classify(n) is Kind.TEMP), key=natural_key)
    assert len(expected) > 50 and temps  # the names cover every kind
    assert scan_samples(str(tmp_path)) == expected
    assert list_samples(str(tmp_path)) == sorted(expected, key=natural_key)
    assert list_entries(tmp_path) == (sorted(expected, key=natural_key), temps)


def _spelled_out_key(name: str) -> tuple[object, ...]:
    """The natural order as first written: numbers before text at each position."""
    parts = re.split(r"(\d+)", name)
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in parts)


def test_natural_order_is_numbers_by_value_and_text_by_text() -> None:
    names = sorted(_tricky_names(5000, seed=4)) + [f"hs_{i}.safetensors" for i in range(300)]
    names += ["hs_007.safetensors", "hs_7.safetensors", "a", "", "10", "9x"]
    random.Random(5).shuffle(names)
    assert sorted(names, key=natural_key) == sorted(names, key=_spelled_out_key)
    assert sorted(["hs_10", "hs_2", "hs_1"], key=natural_key) == ["hs_1", "hs_2", "hs_10"]
