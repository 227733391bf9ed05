"""Read ``*.safetensors`` weights into numpy float32 arrays without torch (bf16/fp16/fp32 tensors).

The format: 8 bytes (little-endian u64) giving the header's length, a JSON header naming each tensor's
dtype, shape and byte range, then the raw bytes. numpy has no bfloat16, so bf16 words are widened to
float32 by a 16-bit shift (exact).
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from rlxrt.errors import ExportError

DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64, "I64": np.int64,
          "I32": np.int32}


def read_weights(directory: Path) -> dict[str, np.ndarray]:
    """Every tensor of every ``*.safetensors`` file in ``directory``, float ones as float32."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():  # a sharded checkpoint: exactly the files its weight map names
        files = sorted({directory / f for f in json.loads(index.read_text())["weight_map"].values()})
    else:  # model.safetensors (not e.g. Mistral's consolidated.safetensors beside it)
        files = sorted(directory.glob("model*.safetensors")) or sorted(directory.glob("*.safetensors"))
    if not files:
        raise ExportError(f"no *.safetensors weights in {str(directory)!r}; the fused graph is built from "
                          "safetensors (save the model with `save_pretrained(..., safe_serialization=True)`)")
    out: dict[str, np.ndarray] = {}
    for path in files:
        raw = path.read_bytes()
        try:
            (size,) = struct.unpack("<Q", raw[:8])
            header = json.loads(raw[8:8 + size])
        except (struct.error, ValueError) as exc:
            raise ExportError(f"cannot load the weights in {str(path)!r}: not a complete safetensors file "
                              f"({type(exc).__name__}); check the weight files are complete") from None
        body = memoryview(raw)[8 + size:]
        for name, info in header.items():
            if name == "__metadata__":
                continue
            kind = info["dtype"]
            if kind not in DTYPES:
                raise ExportError(f"{path.name}: tensor {name!r} has dtype {kind}, which the fused exporter does "
                                  f"not read (it reads {', '.join(DTYPES)})")
            start, end = info["data_offsets"]
            if end > len(body):
                raise ExportError(f"cannot load the weights in {str(path)!r}: tensor {name!r} runs past the end of "
                                  "the file; check the weight files are complete")
            arr = np.frombuffer(body[start:end], dtype=DTYPES[kind]).reshape(info["shape"])
            if kind == "BF16":
                arr = (arr.astype(np.uint32) << 16).view(np.float32)
            elif arr.dtype.kind == "f":
                arr = arr.astype(np.float32)
            out[name] = arr
    return out
