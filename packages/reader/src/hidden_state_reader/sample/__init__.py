"""One sample: the ``Sample``, file -> tensors, its state, a directory's health.

``sample`` is what the reader yields, ``load`` turns a file into tensors, ``states`` is the
one sample-state rule and ``health`` classifies a whole directory with it (every counting
command uses it).
"""
