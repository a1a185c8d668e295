"""``mooncake://MASTER_HOST:PORT/PREFIX?option=value``: a store address as one string.

Options (all optional): ``metadata`` (default ``P2PHANDSHAKE``), ``hostname`` (this
process's address for other clients), ``protocol`` (``tcp``), ``devices`` (RDMA),
``segment`` (memory this process contributes, e.g. ``4GiB``; default 0), ``buffer``
(the largest sample this process reads, default ``256MiB``) and ``lease`` (seconds a
claiming reader's claim survives it, default 30; ``store.claims``).
"""

from __future__ import annotations

from urllib.parse import parse_qs, urlsplit

from hidden_state_reader.format.store_keys import check_prefix
from hidden_state_reader.sizes import parse_size
from hidden_state_reader.store.client import StoreSettings

SCHEME = "mooncake://"
_OPTIONS = {"metadata", "hostname", "protocol", "devices", "segment", "buffer", "lease"}


def is_store_url(path: object) -> bool:
    """Whether ``path`` names a store rather than a directory."""
    return isinstance(path, str) and path.startswith(SCHEME)


def parse_store_url(url: str) -> StoreSettings:
    """The settings a ``mooncake://`` URL names.

    Raises:
        ValueError: Not a store URL, no master port, no prefix, or an unknown option;
            the message quotes the URL.
    """
    if not is_store_url(url):
        raise ValueError(f"{url!r}: a store URL starts with {SCHEME}")
    parts = urlsplit(url)
    if not parts.hostname or parts.port is None:
        raise ValueError(f"{url!r}: name the master as {SCHEME}HOST:PORT/PREFIX")
    try:
        prefix = check_prefix(parts.path.strip("/"))
    except ValueError as exc:
        raise ValueError(f"{url!r}: {exc} (e.g. {SCHEME}{parts.netloc}/hs)") from None
    query = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
    unknown = sorted(set(query) - _OPTIONS)
    if unknown:
        raise ValueError(f"{url!r}: unknown option(s) {unknown} (known: {sorted(_OPTIONS)})")
    return StoreSettings(
        master=f"{parts.hostname}:{parts.port}",
        prefix=prefix,
        metadata_server=query.get("metadata", "P2PHANDSHAKE"),
        local_hostname=query.get("hostname", ""),
        protocol=query.get("protocol", "tcp"),
        device_names=query.get("devices", ""),
        segment_bytes=parse_size(f"{url}: segment", query.get("segment", "0"), allow_zero=True),
        buffer_bytes=parse_size(f"{url}: buffer", query.get("buffer", "256MiB"), allow_zero=True),
        claim_lease=_parse_lease(url, query.get("lease", "30")),
    )


def _parse_lease(url: str, text: str) -> float:
    try:
        lease = float(text)
    except ValueError:
        lease = -1.0
    if not lease > 0:
        raise ValueError(f"{url!r}: lease must be positive seconds (e.g. lease=30), got {text!r}")
    return lease


def store_url(settings: StoreSettings) -> str:
    """The URL of ``settings`` (the inverse of ``parse_store_url``, for messages)."""
    return f"{SCHEME}{settings.master}/{settings.prefix}"
