"""Compute and memory kernels: fp8, CRC-32, host memory, the header-layout memo.

- ``fp8``: quantize and dequantize (the format's fp8 rule, ``format.fp8``).
- ``fp8_cpu`` and ``_fp8_native.c``: the CPU dequantize kernel, native where it built.
- ``crc``: the fastest CRC-32 this host has.
- ``layouts``: the process's memo of header layouts already validated (``parse_header``'s).
- ``host_memory``: the host-memory home: recycled huge-page-advised allocations.

Kernels import only the format; the file protocol (``files``) and the libraries import
them.
"""
