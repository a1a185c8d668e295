"""Build of the optional native fp8 kernel; everything else is in pyproject.toml.

The extension is optional: where no C compiler is available the build goes on without
it and the reader dequantizes fp8 with torch passes instead (``kernels/fp8_cpu.py``), so
the package installs everywhere it did before.
"""

import sys

from setuptools import Extension, setup

# Strict floating point (the kernel is bit-exact with torch), vectorisation on.
FLAGS = [] if sys.platform == "win32" else ["-O3", "-ffp-contract=off", "-fno-fast-math"]

setup(
    ext_modules=[
        Extension(
            "hidden_state_reader.kernels._fp8_native",
            ["src/hidden_state_reader/kernels/_fp8_native.c"],
            extra_compile_args=FLAGS,
            optional=True,
        )
    ]
)
