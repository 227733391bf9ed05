"""The one compiled part of rlxrt: the CPU MatMul kernel that ONNX Runtime loads as a custom-op library
(backends/stream_matmul.c). It is optional: without a C compiler the install goes on and sessions use ONNX
Runtime's own MatMul (``rlxrt compile`` says which)."""
import sys

from setuptools import Extension, setup

flags = [] if sys.platform == "win32" else ["-O3", "-ffp-contract=fast", "-Wno-psabi", "-fvisibility=hidden"]
setup(ext_modules=[Extension("rlxrt.backends._stream_matmul", ["backends/stream_matmul.c"],
                             depends=["backends/stream_kernels.h", "backends/stream_int8.h"],
                             libraries=[] if sys.platform == "win32" else ["m"], extra_compile_args=flags,
                             optional=True)])
