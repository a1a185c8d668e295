"""Byte sizes as people write them: ``1073741824``, ``"1GiB"``, ``"1.5 GiB"``, ``"512MB"``.

The one parser of both packages: the connector's ``*_bytes`` settings
(``kv_connector_extra_config``) and the options of a ``mooncake://`` store URL.
``k``/``m``/``g``/``t`` are powers of 1000, ``ki``/``mi``/``gi``/``ti`` powers of 1024;
a trailing ``b`` and spaces are allowed. It does no I/O.
"""

from __future__ import annotations

import re

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "t": 1000**4,
          "ki": 1024, "mi": 1024**2, "gi": 1024**3, "ti": 1024**4}  # fmt: skip


def parse_size(key: str, value: int | str, *, allow_zero: bool = False) -> int:
    """Bytes from an int or a string such as ``"512MiB"``, ``"2GB"`` or ``"1.5GiB"``.

    Args:
        key: What the size is for (a setting, ``URL: option``); every error names it.
        value: A whole number of bytes, or a number with an optional unit.
        allow_zero: Accept 0 (for sizes where 0 means "none", such as memory a store
            client contributes); otherwise the size must be positive.

    Returns:
        The size in whole bytes (a fraction of a byte is dropped).

    Raises:
        ValueError: Not a size, an unknown unit, or 0 / negative where not allowed.
    """
    if isinstance(value, bool):
        raise ValueError(f"{key}: expected a size in bytes, got {value!r}")
    if isinstance(value, int):
        number, factor = float(value), 1
    elif isinstance(value, str) and (m := _SIZE.match(value)):
        unit = (m.group(2) or "").lower().rstrip("b")
        if unit not in _UNITS:
            raise ValueError(f"{key}: unknown unit in {value!r} (use B, KiB, MiB, GiB, TiB)")
        number, factor = float(m.group(1)), _UNITS[unit]
    else:
        raise ValueError(f"{key}: expected a size such as 1073741824 or '1GiB', got {value!r}")
    size = int(number * factor)
    if size < 0 or (size == 0 and not allow_zero):
        rule = "0 or more" if allow_zero else "positive"
        raise ValueError(f"{key}: must be {rule}, got {value!r}")
    return size
