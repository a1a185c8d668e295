"""One announced sample, read from the store in two halves: fetch, then load.

``fetch`` does what costs: the transfer (``StoreClient.get_object``, straight into the
memory that becomes the sample's) and the checks the store promises (size against the
commit record, the CRC32: ``load.check_bytes``). The store backend runs it in its
read-ahead thread. ``load`` makes the sample's tensors from the checked bytes, with the
reader's options (layers, dtype, ``device``), in the caller's thread: a copy to a CUDA
device is then queued on the caller's current stream, ordered before the kernels that
use it. Either half ends in the one sample-state rule (``sample.states.judge``).
"""

from __future__ import annotations

import json
from typing import NamedTuple

import numpy as np

from hidden_state_reader.errors import FailedSampleError, SampleError
from hidden_state_reader.format.lock_status import LockState
from hidden_state_reader.format.store_keys import CommitRecord, data_key, failed_key
from hidden_state_reader.options import LoadOptions
from hidden_state_reader.read.backend import Outcome, OutcomeKind, judged, rejected
from hidden_state_reader.read.claim_lifecycle import Ending, HeldClaim, settle
from hidden_state_reader.sample.sample import Sample
from hidden_state_reader.sample.states import SampleState, judge, observe
from hidden_state_reader.store.client import StoreClient
from hidden_state_reader.store.load import check_bytes, load_checked


class Fetched(NamedTuple):
    """A sample's bytes, transferred and checked, to be loaded (``load``).

    Attributes:
        name: The sample name.
        where: Its address (``Sample.path``, errors).
        data: Its bytes; the sample's tensors will view them.
        claim: This reader's claim on it, if it claims.
    """

    name: str
    where: str
    data: np.ndarray
    claim: HeldClaim | None


def fetch(
    client: StoreClient,
    name: str,
    where: str,
    record: CommitRecord | None,
    ok: bool,
    claim: HeldClaim | None,
) -> Outcome | Fetched:
    """Transfer and check sample ``name`` (or read why its writer failed it).

    Args:
        client: The store.
        name: The sample.
        where: Its address.
        record: Its commit record, when known (the size to read and check, the CRC).
        ok: False when its producer recorded a failure instead.
        claim: This reader's claim on it, carried by what is returned.

    Returns:
        The checked bytes, or the outcome: ``REJECT`` (failed, short, corrupt),
        ``VANISHED`` (consumed and deleted by another reader meanwhile).
    """
    prefix = client.settings.prefix
    if not ok:
        raw = client.get(failed_key(prefix, name)) or b"{}"
        reason = str(json.loads(raw).get("reason", "no reason recorded"))
        error = FailedSampleError(where, f"the writer gave up: {reason}")
        return rejected(name, SampleState.FAILED, error, claim)
    data = client.get_object(data_key(prefix, name), None if record is None else record.size)
    if data is None:
        return Outcome(OutcomeKind.VANISHED, name)
    try:
        check_bytes(where, data, record)
    except SampleError as exc:
        return _judged(name, where, None, exc, claim)
    return Fetched(name, where, data, claim)


def load(fetched: Fetched, options: LoadOptions) -> Outcome:
    """The outcome of checked bytes: the sample loaded with ``options``, or why not.

    Raises:
        Exception: Whatever loading raised other than a ``SampleError`` (out of device
            memory, ...), after giving the claim back.
    """
    name, where, data, claim = fetched
    try:
        sample = load_checked(where, data, options)
    except SampleError as exc:
        return _judged(name, where, None, exc, claim)
    except BaseException:
        settle(claim, Ending.RETURNED)
        raise
    return _judged(name, where, sample, None, claim)


def _judged(
    name: str,
    where: str,
    sample: Sample | None,
    problem: SampleError | None,
    claim: HeldClaim | None,
) -> Outcome:
    # A stored object is complete or it is not: no lock, and no age to wait out.
    obs = observe(
        LockState.ABSENT,
        data_exists=True,
        problem=problem,
        num_tokens=None if sample is None else sample.num_tokens,
    )
    return judged(name, where, judge(obs), sample, problem, claim)
