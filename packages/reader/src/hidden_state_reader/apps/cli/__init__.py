"""The ``hidden-state`` command-line tool.

``hidden_state_reader.apps.cli.main:main`` is the entry point. Subcommands of this package
live in ``listing`` (ls, stats), ``inspect``, ``verify`` (verify, clean), ``tail``,
``export`` and ``store``; other packages add theirs through the ``hidden_state.cli``
entry-point group (see ``hidden_state_reader.apps.cli.main``).
"""
