"""One sample: the ``Sample``, file -> tensors, its state, a directory's health.

``sample`` is what the reader yields, ``load`` turns a file into tensors, ``finishing``
dequantizes fp8 and applies the reader's dtype (for a sample, or a batch on a device),
``placement`` moves tensors to the trainer's device, ``content`` is what the loader
refuses in a file whose header is valid, ``states`` is the one sample-state rule and
``health`` classifies a whole directory with both (every counting command and
``len(HiddenStateDataset)`` use it), so counts are what a reader yields.
"""
