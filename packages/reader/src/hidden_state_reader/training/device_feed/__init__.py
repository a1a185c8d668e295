"""The device feed: batches built by threads in page-locked memory, put on the device early.

What ``HiddenStateLoader(..., device=...)`` iterates instead of DataLoader workers. Each
builder thread reads its share of the pass (the chunks a DataLoader worker would get, or
its own claiming reader in follow mode) and runs every batch through three stages, one
module each:

1. ``host_build``: the collate builds the batch in host memory; an ``InPlaceCollate``
   straight into a reused page-locked buffer (``HostArenas``), the only time the host
   touches the bytes.
2. ``to_device``: the copy is queued on the thread's own CUDA stream; the training loop's
   stream waits for it when the loop receives the batch.
3. ``device_finishing``: fp8 dequantized and the reader's ``dtype`` applied on the
   device, by the sample layer's finishing (``sample/finishing.py``).

``builder_threads`` (``DeviceFeed``) runs the threads, their queues, the order batches
arrive in and each batch's ticket (``training.acknowledgement``). Threads, not
processes: reading is system calls and memory copies, which release the GIL, and nothing
crosses a process boundary (docs/dependencies.md has the measurements).

A process forked later (a DataLoader worker) must not free what the feed made (a
page-locked buffer a copy read, a ``record_stream``ed tensor, a CUDA event: freeing them
calls CUDA, which aborts a forked child). So a finished feed is no reference cycle, and
every ``fork`` is preceded by a garbage collection in the parent (``fork_safety``).
"""
