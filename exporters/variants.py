"""Weight variants of an exported graph: fp16 (for GPUs) and dynamic int8 (a cheap CPU draft)."""
from __future__ import annotations

from pathlib import Path

from rlxrt.errors import ExportError


def _save(model, path: Path) -> None:
    import onnx

    big = model.ByteSize() > 1_800_000_000
    onnx.save(model, str(path), save_as_external_data=big, all_tensors_to_one_file=True,
              location=path.name + ".data" if big else None)


def to_fp16(src: Path, dst: Path) -> None:
    """Weights, activations and the KV cache in float16; input ids and masks stay int64."""
    import onnx
    from onnxruntime.transformers.float16 import convert_float_to_float16

    model = onnx.load(str(src))
    try:
        model16 = convert_float_to_float16(model, keep_io_types=False, disable_shape_infer=True)
    except Exception as exc:
        raise ExportError(f"converting {src} to float16 failed: {exc}") from None
    _save(model16, dst)


DYNAMIC_INT8 = {"method": "quantize_dynamic", "bits": 8, "weights": "int8, one scale per tensor",
                "activations": "int8, one dynamic scale over all rows of a call",
                "rows_alike": "never: a row's activation scale depends on the rows beside it",
                "exactness": "plain decoding only: a Session refuses a speculator on this graph (it may draft for "
                             "another target)"}
"""How ``--graph portable --quantize int8`` computes (recorded in the manifest)."""


def to_int8(src: Path, dst: Path) -> None:
    """Dynamic int8 quantisation of the MatMul/Gemm weights (onnxruntime's quantiser)."""
    import logging

    from onnxruntime.quantization import QuantType, quantize_dynamic

    logging.getLogger("root").setLevel(logging.ERROR)  # its "run pre-processing" hint is noise here
    try:
        quantize_dynamic(str(src), str(dst), weight_type=QuantType.QInt8,
                         use_external_data_format=src.stat().st_size > 1_800_000_000)
    except Exception as exc:
        raise ExportError(f"int8 quantisation of {src} failed: {exc}") from None
