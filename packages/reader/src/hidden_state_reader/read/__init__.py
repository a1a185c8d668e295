"""The reader's data path: discover -> wait -> decide -> consume, one stage per module.

``sources`` discovers names, ``waiting_set`` and ``stream`` wait for many writers at once,
``decision`` decides about one sample (with ``claims`` across readers), ``outcomes`` counts
and reports, ``disposal`` keeps, deletes or moves. ``access`` checks the options first;
``stats`` counts.
"""
