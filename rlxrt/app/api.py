"""Entry points that wire sub-packages together (imported lazily, like the CLI)."""
from __future__ import annotations

import os
from typing import Callable


def export(src: str | os.PathLike, out: str | os.PathLike, *, dtype: str = "fp32", quantize: str | None = None,
           force: bool = False, validate: bool = True, atol: float | None = None,
           report: Callable[[str], None] | None = None, with_hidden_states: bool = False,
           graph: str | None = None, max_context: int | None = None, int4_compute: str = "fp32",
           greedy_head: bool | None = None, greedy_candidates: int | None = None,
           draft_vocab: int | None = None, vocab_corpus: list[str | os.PathLike] | None = None,
           hidden_layers: list[int] | str | None = None):
    """Export a Hugging Face causal LM (local directory or hub id) to an rlxrt model directory.

    Returns ``rlxrt.exporters.ExportResult`` (path, manifest, seconds per step).
    ``dtype`` is fp32 or fp16; ``quantize="int8"`` stores a fused graph's weights as 8-bit blocks computed with
    int8 activations (a target speculates over it where rlxrt's CPU kernels run it), a portable graph's as dynamic
    int8 (plain decoding or drafting only: docs/exactness.md). Validation against PyTorch runs unless
    ``validate=False``.
    ``with_hidden_states`` adds the last hidden state as an output (for ``MtpHead``).
    ``graph`` is ``fused`` (rlxrt's own graph with fused attention and a KV buffer of ``max_context``
    positions; the default for llama, mistral, qwen2 and qwen3 in fp32, built without torch) or ``portable``
    (optimum's graph). The portable path needs ``pip install 'rlxrt[export]'``. ``int4_compute="int8"``
    (with ``quantize="int4"``) computes with int8 activations: faster plain decoding; a Session speculates
    over such a target where rlxrt's CPU kernels run it (rows_exact) and refuses elsewhere (drafts may use it). ``greedy_head`` (default: on for fp32 fused graphs)
    adds the exact argmax through int8 candidates that greedy decoding reads instead of the logits
    (``rlxrt.exporters.greedy_head``); False leaves it out. ``greedy_candidates`` (default 128) is how many
    rows it computes exactly: fewer cost less and send more rows to the full Gemm. ``draft_vocab`` N (with
    ``vocab_corpus``: text files, directories or .json lists of texts) makes a draft-only fused graph whose
    logits cover the N tokens that text uses most: a cheaper draft step, exact output all the same (it is
    refused as a target). ``hidden_layers`` (a list of layer counts, or ``"auto"`` for a low, a middle and a high
    layer) appends the residual stream after those layers to the ``hidden_states`` output (it implies
    ``with_hidden_states``), for an MTP head that reads them (``rlxrt train-head`` trains one on what the output
    holds).
    """
    from rlxrt.checks import as_bool, as_float, as_int
    from rlxrt.errors import ExportError

    force, validate = as_bool(force, "force", ExportError), as_bool(validate, "validate", ExportError)
    with_hidden_states = as_bool(with_hidden_states, "with_hidden_states", ExportError)
    if atol is not None and as_float(atol, "atol", error=ExportError) <= 0:
        raise ExportError(f"atol must be a positive number (a max abs logit difference), got {atol!r}")
    if max_context is not None:
        max_context = as_int(max_context, "max_context", 1, error=ExportError)
    texts = None
    if draft_vocab is not None:
        draft_vocab = as_int(draft_vocab, "draft_vocab", 1, error=ExportError)
        if vocab_corpus:
            from .train_head import documents

            texts = [t for _, t in documents([str(p) for p in vocab_corpus], "--vocab-corpus", at_least=1)]
    elif vocab_corpus:
        raise ExportError("--vocab-corpus is counted for --draft-vocab N; pass both, or neither")
    if hidden_layers is not None and hidden_layers != "auto":
        if isinstance(hidden_layers, (str, bytes)) or not hasattr(hidden_layers, "__iter__"):
            raise ExportError(f"hidden_layers must be a list of layer counts or 'auto', got {hidden_layers!r}")
        hidden_layers = tuple(as_int(j, "hidden_layers", error=ExportError) for j in hidden_layers)
    from rlxrt.exporters import export_model

    return export_model(src, out, runner=runner, dtype=dtype, quantize=quantize, force=force,
                        validate_export=validate, atol=atol, report=report,
                        with_hidden_states=with_hidden_states, graph=graph, max_context=max_context,
                        int4_compute=int4_compute,
                        greedy_head=None if greedy_head is None else as_bool(greedy_head, "greedy_head", ExportError),
                        greedy_candidates=None if greedy_candidates is None else
                        as_int(greedy_candidates, "greedy_candidates", 1, error=ExportError),
                        draft_vocab=draft_vocab, vocab_texts=texts, hidden_layers=hidden_layers or ())


def runner(graph_path: str | os.PathLike) -> Callable[[dict], dict]:
    """``run(feeds) -> {output name: array}`` on a CPU session of ``graph_path``: how exporters validate a
    graph without creating ORT sessions themselves."""
    from rlxrt.backends import compile
    from rlxrt.config import Config

    graph = compile(graph_path, Config(providers=("cpu",), cache=False, intra_op_threads=1))
    names = graph.output_names

    def run(feeds):
        return dict(zip(names, graph.session.run(names, feeds)))

    return run
