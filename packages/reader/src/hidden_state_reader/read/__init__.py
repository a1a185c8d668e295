"""The reader's data path: discover -> wait -> decide -> consume, one stage per module.

``backend`` is the contract every source of samples implements (and the ``Outcome`` of a
decision); ``directory`` implements it for a storage directory, composing ``sources``
(discover, woken by ``inotify``), ``waiting_set`` and ``stream`` (wait for many writers
at once), ``decision`` (decide about one sample, with ``claims`` across readers) and
``disposal`` (keep, delete or move). ``holding`` is what a plain loop holds (consumed
when it asks for the next, given back when it stops). ``policy`` is the error policy of
every backend, ``claim_lifecycle`` how a claim is settled, ``access`` checks the options
first, ``counters`` counts (``ReaderStats``).
"""
