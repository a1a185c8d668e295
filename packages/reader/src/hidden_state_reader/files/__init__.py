"""The POSIX file protocol of format v1: the mechanisms that put the format on a disk.

What a file holds is the format's (``hidden_state_reader.format``); how it is read,
listed, locked and published is here:

- ``fileio``: opening regular files without blocking.
- ``header``: reading a sample's header from its file.
- ``listing``: the one directory scan.
- ``paths``: directories below a root without following symlinks; client paths.
- ``locks``: writer and reader locks, and the status in lock files.
- ``held_files``: files created already locked, taken over only when free (claims, members).
- ``flockwait``: a blocking ``flock`` with a deadline and cancellation.
- ``inotify``: the kernel's file-system events (``ctypes``), one thread per process.
- ``identity``: process identity (host, pid, boot id, start time; is a writer gone?).
- ``publish``: writing a sample atomically (temp file, ``os.replace``, release the lock).
- ``atomic``: any other file written whole by rename (``write_atomic``), ``move``.

Import direction: ``format`` <- ``kernels`` <- ``files`` <- the libraries (``read``,
``sample``, ``store``, ``training``, the connector's engine).
"""
