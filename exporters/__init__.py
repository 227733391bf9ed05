"""rlxrt.exporters: Hugging Face → ONNX (optimum), validation, fp16/int8 variants.

The only sub-package that imports torch, transformers and optimum. Use
``rlxrt.export`` (which wires validation to ``rlxrt.backends``) rather than
``export_model`` directly.
"""
from .export import ExportResult, export_model

__all__ = ["ExportResult", "export_model"]
