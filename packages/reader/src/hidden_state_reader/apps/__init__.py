"""Applications built on the reader: the ``hidden-state`` command (``cli``) and ``export``.

The library (everything outside ``apps``) never imports these; they import the library.
They stay in this distribution so ``pip install hidden-state-reader`` gives the
``hidden-state`` command (docs/contributing.md, "Code layout").
"""
