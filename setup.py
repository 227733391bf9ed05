"""The one compiled part of rlxrt: the CPU kernels that ONNX Runtime loads as a custom-op library
(backends/stream_matmul.c and the headers it includes). They need GCC or Clang (vector extensions): on Windows,
or without a C compiler, the install goes on without them and sessions use ONNX Runtime's kernels (``rlxrt
compile`` says which)."""
import sys

from setuptools import Extension, setup

HEADERS = ["backends/stream_kernels.h", "backends/stream_int8.h", "backends/stream_attention.h",
           "backends/stream_batch.h", "backends/stream_rows.h", "backends/stream_scan.h"]
kernels = Extension("rlxrt.backends._stream_matmul", ["backends/stream_matmul.c"], depends=HEADERS,
                    libraries=["m"], extra_compile_args=["-O3", "-ffp-contract=fast", "-Wno-psabi",
                                                         "-fvisibility=hidden"], optional=True)
setup(ext_modules=[] if sys.platform == "win32" else [kernels])
