"""``argparse`` types the connector's commands share."""

from __future__ import annotations

import argparse

from hidden_state_connector.layers import parse_layers


def layers_argument(text: str) -> list[int]:
    """``argparse`` type of ``--layers``: ``parse_layers``, its error shown as written."""
    try:
        return parse_layers(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
