"""``rlxrt export``: a Hugging Face causal LM to a model directory sessions can run.

Steps: resolve the source → pick its family (families.py) → load → export the
graph (the family's steps: optimum-onnx and a fp16 / int8 variant, or rlxrt's
own recurrent graph) → assemble the manifest → validate against PyTorch →
write (manifest, tokenizer, chat template). The directory is assembled under a temporary name
and renamed into place at the end, so a failure half way leaves nothing that
looks like a model.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

from rlxrt.errors import ExportError, RlxrtError
from rlxrt.manifest import Manifest

from . import gguf_blocks
from .chat_template import save_chat
from .deps import require_export_stack, versions
from .families import FAMILIES, family_for
from .gguf_source import dequantise, gguf_file
from .fused import TASK as FUSED_TASK
from .fused import build_graph, check_int4_compute, default_hidden_layers, fused_layout
from .fused import unsupported as fused_unsupported
from .safetensors_np import read_weights
from .source import read_config, recorded_name, resolve_source, weights_hash
from .validate import TOLERANCE

GRAPH = "model.onnx"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "added_tokens.json", "generation_config.json")
DTYPES = {"fp32": "float32", "fp16": "float16"}

Runner = Callable[[Path], Callable[[dict], dict]]


@dataclass
class ExportResult:
    path: Path
    manifest: Manifest
    seconds: dict[str, float] = field(default_factory=dict)
    """Wall time of each step."""


class _Steps:
    def __init__(self, report: Callable[[str], None] | None):
        self.report = report
        self.seconds: dict[str, float] = {}

    def run(self, name: str, fn, *args, **kwargs):
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        self.seconds[name] = time.perf_counter() - start
        if self.report:
            self.report(f"{name:<9} {self.seconds[name]:6.2f} s")
        return out


def _prepare_out(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ExportError(f"output {str(out)!r} is a file; pass a directory path")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ExportError(f"output directory {str(out)!r} is not empty; pass --force (force=True) to replace it")


def _load(torch, transformers, src: Path):
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # e.g. Mamba's "fast path is not available" (CUDA kernels)
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32,
                                                                  attn_implementation="eager")
    except Exception as exc:
        raise ExportError(f"cannot load the weights in {str(src)!r}: {type(exc).__name__}: "
                          f"{str(exc).splitlines()[0][:300]}; check the weight files are complete") from None
    finally:
        transformers.logging.set_verbosity(verbosity)
    return model.eval()


def _special_tokens(config: dict, src_dir: Path) -> tuple[int | None, tuple[int, ...], int | None]:
    """bos, eos ids and pad from generation_config.json (which wins, as in transformers) or config.json."""
    gen = {}
    if (src_dir / "generation_config.json").is_file():
        gen = read_config(src_dir, "generation_config.json")

    def pick(name):
        v = gen.get(name)
        return v if v is not None else config.get(name)

    eos = pick("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
    return pick("bos_token_id"), tuple(int(e) for e in eos_ids), pick("pad_token_id")


def _save_tokenizer(transformers, src: Path, dst: Path) -> str | None:
    """Copy the tokenizer files; without a tokenizer.json, transformers (when installed) writes one."""
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
    if not (dst / "tokenizer.json").is_file() and transformers is not None:
        try:
            tok = transformers.AutoTokenizer.from_pretrained(str(src))
            if getattr(tok, "is_fast", False):
                tok.save_pretrained(str(dst))
        except Exception:
            pass
    return "tokenizer.json" if (dst / "tokenizer.json").is_file() else None


def export_model(src: str | os.PathLike, out: str | os.PathLike, *, runner: Runner, dtype: str = "fp32",
                 quantize: str | None = None, force: bool = False, validate_export: bool = True,
                 atol: float | None = None, report: Callable[[str], None] | None = None,
                 with_hidden_states: bool = False, graph: str | None = None,
                 max_context: int | None = None, int4_compute: str = "fp32",
                 greedy_head: bool | None = None, greedy_candidates: int | None = None,
                 draft_vocab: int | None = None, vocab_texts: list[str] | None = None,
                 hidden_layers: tuple[int, ...] | str = ()) -> ExportResult:
    """Export ``src`` (a local Hugging Face model directory, a hub id, or a GGUF file) into ``out``.

    ``graph`` is ``fused`` (rlxrt's own graph from the safetensors weights, no torch needed; the default for
    llama, mistral, qwen2 and qwen3 in fp32, with a KV buffer of ``max_context`` positions) or ``portable``
    (optimum's graph, or rlxrt's recurrent graphs). ``runner(graph_path)`` returns a
    ``run(feeds) -> {name: array}`` callable for validation; ``rlxrt.export`` passes one built on
    ``rlxrt.backends.compile``. Validation against PyTorch needs torch and transformers; a fused export
    without them records that it was not validated. ``with_hidden_states`` adds the last hidden state (the
    LM head's input) as output ``hidden_states``, for draft heads that read it (``MtpHead``).
    ``int4_compute="int8"`` computes an int4 graph with int8 activations (``fused.INT4_INT8``);
    ``quantize="int8"`` makes a fused graph of 8-bit blocks computed so (``fused.INT8``; a portable graph
    gets dynamic int8). int4 from a GGUF keeps the file's own Q4_0/Q4_1/Q8_0 blocks (``gguf_blocks``).
    ``greedy_head`` (None: on for fp32 fused graphs) adds input ``greedy`` and output ``next_ids``
    (``greedy_head.py``; ``greedy_candidates`` rows checked exactly, default 128). ``draft_vocab`` N makes a
    draft-only fused graph whose logits cover the N tokens ``vocab_texts`` use most (``draft_vocab.py``).
    ``hidden_layers`` (fused graphs; implies ``with_hidden_states``) appends the residual stream after those
    layers to ``hidden_states``, for a head that reads them (``fused.check_hidden_layers``; ``"auto"``: a low, a
    middle and a high layer, ``fused.default_hidden_layers``).
    """
    variant = _variant(dtype, quantize)
    check_int4_compute(int4_compute, variant == "int4")  # before any work
    out = Path(out).expanduser()
    _prepare_out(out, force)
    gguf = gguf_file(src)
    steps = _Steps(report)
    if gguf is None:
        src_dir = resolve_source(src)
        kind = _graph_kind(graph, read_config(src_dir), variant, max_context)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        gguf_record = None
        if gguf is not None:  # dequantised into a Hugging Face directory first (needs torch and transformers)
            torch_, transformers_, _ = require_export_stack()
            src_dir = work / "hf"
            gguf_record = steps.run("dequantise", dequantise, gguf, src_dir, torch_, transformers_)
            kind = _graph_kind(graph, read_config(src_dir), variant, max_context)
        config = read_config(src_dir)
        final = work / "model"
        final.mkdir()
        vocab_ids = vocab_record = None
        if draft_vocab is not None:
            vocab_ids, vocab_record = _draft_vocab(kind, config, src_dir, final, draft_vocab, vocab_texts)
        if hidden_layers == "auto":
            hidden_layers = default_hidden_layers(int(config["num_hidden_layers"]))
        hidden_layers = tuple(hidden_layers or ())
        with_hidden_states = with_hidden_states or bool(hidden_layers)
        if hidden_layers and kind != "fused":
            raise ExportError("--hidden-layers is built into the fused graph (llama, mistral, qwen2, qwen3); drop it, "
                              "or drop --graph portable")
        if kind == "fused":
            weights = steps.run("read", read_weights, src_dir)
            blocks = None
            if gguf is not None and variant == "int4":  # the GGUF's own 4-bit blocks, not quantised twice
                blocks = steps.run("blocks", gguf_blocks.matched, gguf, weights, config)
            spec = steps.run("build", build_graph, config, weights, final / GRAPH, capacity=max_context,
                             with_hidden=with_hidden_states, quantize=variant if variant in ("int4", "int8") else None,
                             dtype="float16" if variant == "float16" else "float32", int4_compute=int4_compute,
                             greedy_head=greedy_head, greedy_candidates=greedy_candidates, blocks=blocks,
                             vocab_ids=vocab_ids, hidden_layers=hidden_layers)
            del weights, blocks
            layout, task, family = fused_layout(spec, with_hidden_states, hidden_layers), FUSED_TASK, \
                FAMILIES["attention"]
            stack = _torch_stack() if validate_export else None
            torch, transformers = stack or (None, None)
        else:
            if greedy_head:
                raise ExportError("the greedy head is part of the fused graph; this export is portable (drop "
                                  "--greedy-head, or export a llama/mistral/qwen2/qwen3 model in fp32)")
            torch, transformers, _ = require_export_stack()
            family = family_for(config)
            model = steps.run("load", _load, torch, transformers, src_dir)
            family.export(steps, torch, model, final / GRAPH, variant, with_hidden_states)
            layout, task = family.layout(model, final / GRAPH, variant, with_hidden_states), family.task
        manifest = assemble_manifest(config, task, layout, src, src_dir, _save_tokenizer(transformers, src_dir, final))
        manifest = replace(manifest, chat=save_chat(src_dir, final, manifest.eos_token_ids), draft_vocab=vocab_record)
        if gguf_record is not None:
            manifest = replace(manifest, source={**manifest.source, **gguf_record})
        if validate_export and torch is None:
            manifest = replace(manifest, validation={"skipped": True, "reason": "torch/transformers not installed"})
        elif validate_export:
            if kind == "fused":
                model = steps.run("load", _load, torch, transformers, src_dir)
            columns = {} if vocab_ids is None else {"columns": vocab_ids}  # a draft-only graph's N logits
            record = steps.run("validate", family.validate, torch, model, manifest, runner(final / GRAPH),
                               atol if atol is not None else TOLERANCE[variant], **columns)
            _check_validation(record)
            manifest = replace(manifest, validation=record)
        steps.run("write", _write, manifest, final, out, force)
        return ExportResult(out, manifest, steps.seconds)
    except RlxrtError:
        raise
    except Exception as exc:
        raise ExportError(f"export of {str(src)!r} failed: {type(exc).__name__}: {exc}") from exc
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _graph_kind(graph: str | None, config: dict, variant: str, max_context: int | None) -> str:
    """fused or portable: as asked, else fused where rlxrt builds it (Llama-style families, fp32)."""
    if graph not in (None, "fused", "portable"):
        raise ExportError(f"graph {graph!r} is not a graph kind; use fused or portable")
    why_not = fused_unsupported(config)
    if graph == "fused" and why_not:
        raise ExportError(f"{why_not}; export with --graph portable")
    if variant == "int4" and (graph == "portable" or why_not):
        raise ExportError(f"int4 (MatMulNBits) is built into the fused graph only; {why_not or 'drop --graph portable'}")
    kind = graph or ("portable" if why_not else "fused")
    if max_context is not None and kind != "fused":
        raise ExportError("--max-context sets the KV buffer of a fused graph; a portable graph has none "
                          "(drop it, or pass --graph fused)")
    return kind


def _draft_vocab(kind: str, config: dict, src_dir: Path, final: Path, n: int, texts: list[str] | None):
    """The N token ids of a draft-only export and its manifest record; the ids are written to ``final``."""
    import json

    from .draft_vocab import FILE, frequent_ids

    if kind != "fused":
        raise ExportError("--draft-vocab is built into the fused graph (llama, mistral, qwen2, qwen3); drop it, "
                          "or drop --graph portable")
    if not texts:
        raise ExportError("--draft-vocab N keeps the N tokens a corpus uses most: pass --vocab-corpus PATH... "
                          "(text like what the target will write)")
    ids, record = frequent_ids(src_dir / "tokenizer.json", texts, n, int(config["vocab_size"]),
                               _special_tokens(config, src_dir)[1])
    (final / FILE).write_text(json.dumps(ids.tolist()) + "\n", encoding="utf-8")
    return ids, record


def _torch_stack():
    """(torch, transformers) when both are installed (to validate a fused graph), else None."""
    try:
        import torch
        import transformers
    except ImportError:
        return None
    return torch, transformers


def _variant(dtype: str, quantize: str | None) -> str:
    """The weights' form: float32, float16 or int8; ExportError for a combination rlxrt does not make."""
    if dtype not in DTYPES:
        raise ExportError(f"dtype {dtype!r} is not supported; use one of {', '.join(DTYPES)}")
    if quantize not in (None, "int8", "int4"):
        raise ExportError(f"quantize {quantize!r} is not supported; use int8, int4 or leave it out")
    if quantize and dtype != "fp32":
        raise ExportError(f"{quantize} quantisation starts from fp32 weights; drop dtype=fp16 or quantize={quantize}")
    return quantize or DTYPES[dtype]


def assemble_manifest(config: dict, task: str, layout: dict, src, src_dir: Path, tokenizer: str | None) -> Manifest:
    """The manifest of every family: what the model says of itself (config.json, generation_config.json),
    the family's ``layout`` (dtype, inputs, outputs, kv_cache, state, max_positions, graph kind), where it
    came from (no absolute path) and the tool versions; validation is filled in once it has run."""
    bos, eos, pad = _special_tokens(config, src_dir)
    return Manifest(
        architecture=(config.get("architectures") or [config["model_type"]])[0], model_type=config["model_type"],
        vocab_size=int(config["vocab_size"]), graph=GRAPH, **layout,
        bos_token_id=bos, eos_token_ids=eos, pad_token_id=pad, tokenizer=tokenizer,
        source={"path_or_id": recorded_name(src), "weights_sha256": weights_hash(src_dir), "task": task},
        versions=versions(), validation={"skipped": True})


def _user_modes(directory: Path) -> None:
    """Give every file the export wrote the mode the user's umask gives a new file (onnx writes external data
    as 0600, so the weights of a model exported for others would be readable by its maker alone)."""
    mask = os.umask(0)
    os.umask(mask)
    for f in directory.iterdir():
        if f.is_file() and not f.is_symlink():
            f.chmod(0o666 & ~mask)


def _check_validation(record: dict) -> None:
    if not record["passed"]:
        worst = max((k for k in record if k.startswith("max_abs_diff")), key=lambda k: record[k])
        raise ExportError(
            f"validation failed: ORT and PyTorch differ by {record[worst]:.3g} ({worst}) "
            f"(allowed {record['tolerance']:.3g}; argmax agreement {record['argmax_agreement']:.2f}); "
            "nothing was written. Pass a looser atol only if this variant is expected to drift"
        )


def _write(manifest: Manifest, final: Path, out: Path, force: bool) -> None:
    manifest.write(final)
    _user_modes(final)
    backup = None
    if out.exists():
        if not force and any(out.iterdir()):  # someone wrote it meanwhile
            raise ExportError(f"output directory {str(out)!r} appeared during export; pass --force to replace it")
        backup = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.rename(out, backup)
    os.rename(final, out)
    if backup is not None:
        shutil.rmtree(backup, ignore_errors=True)

