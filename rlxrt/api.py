"""Entry points that wire sub-packages together (imported lazily, like the CLI)."""
from __future__ import annotations

import os
from typing import Callable


def export(src: str | os.PathLike, out: str | os.PathLike, *, dtype: str = "fp32", quantize: str | None = None,
           force: bool = False, validate: bool = True, atol: float | None = None,
           report: Callable[[str], None] | None = None):
    """Export a Hugging Face causal LM (local directory or hub id) to an rlxrt model directory.

    Returns ``rlxrt.exporters.ExportResult`` (path, manifest, seconds per step).
    ``dtype`` is fp32 or fp16; ``quantize="int8"`` applies dynamic int8
    quantisation. Validation against PyTorch runs unless ``validate=False``.
    Needs ``pip install 'rlxrt[export]'``.
    """
    from .config import Config
    from .exporters.deps import require_export_stack

    require_export_stack()
    from .backends import compile
    from .exporters import export_model

    def runner(graph_path):
        graph = compile(graph_path, Config(providers=("cpu",), cache=False, intra_op_threads=1))
        names = graph.output_names

        def run(feeds):
            return dict(zip(names, graph.session.run(names, feeds)))

        return run

    return export_model(src, out, runner=runner, dtype=dtype, quantize=quantize, force=force,
                        validate_export=validate, atol=atol, report=report)
