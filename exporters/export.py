"""``rlxrt export``: a Hugging Face causal LM to a model directory sessions can run.

Steps: load → export (optimum-onnx, one graph with a KV cache) → variant
(fp16 / int8) → validate against PyTorch → write (manifest, tokenizer). The
directory is assembled under a temporary name and renamed into place at the
end, so a failure half way leaves nothing that looks like a model.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from rlxrt.errors import ExportError, RlxrtError
from rlxrt.manifest import KVCacheLayout, Manifest

from .deps import require_export_stack, versions
from .hidden import HIDDEN, add_hidden_output
from .source import RECURRENT, TASK, check_architecture, read_config, resolve_source, weights_hash
from .validate import TOLERANCE, hidden_diff, reference_logits, validate
from .variants import to_fp16, to_int8

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


def _kv_layout(graph: Path, layers: int, dtype: str) -> tuple[dict, dict, KVCacheLayout]:
    import onnx

    proto = onnx.load(str(graph), load_external_data=False)
    ins = {i.name: i for i in proto.graph.input}
    outs = [o.name for o in proto.graph.output]
    pattern = ("past_key_values.{i}.key", "past_key_values.{i}.value", "present.{i}.key", "present.{i}.value")
    for i in range(layers):
        for name in pattern[:2]:
            if name.format(i=i) not in ins:
                raise ExportError(f"exported graph lacks input {name.format(i=i)!r}; "
                                  f"its inputs are {sorted(ins)}")
        for name in pattern[2:]:
            if name.format(i=i) not in outs:
                raise ExportError(f"exported graph lacks output {name.format(i=i)!r}")
    dims = ins["past_key_values.0.key"].type.tensor_type.shape.dim
    kv_heads, head_dim = dims[1].dim_value, dims[3].dim_value
    if not kv_heads or not head_dim:
        raise ExportError("exported graph has no static kv-heads/head-dim in its past inputs")
    inputs = {role: (role if role in ins else None) for role in ("input_ids", "attention_mask", "position_ids")}
    outputs = {"logits": "logits" if "logits" in outs else None,
               "hidden_states": HIDDEN if HIDDEN in outs else None}
    return inputs, outputs, KVCacheLayout(layers, kv_heads, head_dim, dtype, *pattern)


def _special_tokens(model) -> tuple[int | None, tuple[int, ...], int | None]:
    gen = getattr(model, "generation_config", None)
    cfg = model.config

    def pick(name):
        v = getattr(gen, name, None) if gen is not None else None
        return v if v is not None else getattr(cfg, name, None)

    eos = pick("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
    return pick("bos_token_id"), tuple(int(e) for e in eos_ids), pick("pad_token_id")


def _save_tokenizer(transformers, src: Path, dst: Path) -> str | None:
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
    if not (dst / "tokenizer.json").is_file():
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
                 with_hidden_states: bool = False) -> ExportResult:
    """Export ``src`` (a local Hugging Face model directory or a hub id) into ``out``.

    ``runner(graph_path)`` returns a ``run(feeds) -> {name: array}`` callable
    for validation; ``rlxrt.export`` passes one built on ``rlxrt.backends.compile``.
    ``with_hidden_states`` adds the last hidden state (the LM head's input) as
    output ``hidden_states``, for draft heads that read it (``MtpHead``).
    """
    if dtype not in DTYPES:
        raise ExportError(f"dtype {dtype!r} is not supported; use one of {', '.join(DTYPES)}")
    if quantize not in (None, "int8"):
        raise ExportError(f"quantize {quantize!r} is not supported; use int8 or leave it out")
    if quantize and dtype != "fp32":
        raise ExportError("int8 quantisation starts from fp32 weights; drop dtype=fp16 or quantize=int8")
    out = Path(out).expanduser()
    _prepare_out(out, force)
    src_dir = resolve_source(src)
    config = read_config(src_dir)
    torch, transformers, optimum_onnx = require_export_stack()
    model_type = check_architecture(config)
    steps = _Steps(report)
    variant = "int8" if quantize else DTYPES[dtype]

    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        model = steps.run("load", _load, torch, transformers, src_dir)
        if model_type in RECURRENT:
            final = steps.run("export", _recurrent_graph, torch, model, work, variant, with_hidden_states)
            manifest = _recurrent_manifest(config, model, model_type, src, src_dir, transformers, final,
                                           with_hidden_states)
            if validate_export:
                record = steps.run("validate", _family(model_type).validate_graph, torch, model,
                                   runner(final / GRAPH), atol if atol is not None else TOLERANCE[variant])
                _check_validation(record)
                manifest = Manifest(**{**manifest.__dict__, "validation": record})
            steps.run("write", _write, manifest, final, out, force)
            return ExportResult(out, manifest, steps.seconds)
        raw = work / "raw"
        steps.run("export", _optimum_export, optimum_onnx, model, raw)
        if with_hidden_states:
            add_hidden_output(raw / GRAPH, int(model.config.hidden_size))
        final = work / "model"
        final.mkdir()
        if variant == "float16":
            steps.run("fp16", to_fp16, raw / GRAPH, final / GRAPH)
        elif variant == "int8":
            steps.run("quantise", to_int8, raw / GRAPH, final / GRAPH)
        else:
            for f in raw.iterdir():
                if f.name.startswith(GRAPH):
                    shutil.move(str(f), final / f.name)
        cache_dtype = "float16" if variant == "float16" else "float32"
        inputs, outputs, kv = _kv_layout(final / GRAPH, model.config.num_hidden_layers, cache_dtype)
        bos, eos, pad = _special_tokens(model)
        tokenizer = _save_tokenizer(transformers, src_dir, final)
        manifest = Manifest(
            architecture=(config.get("architectures") or [type(model).__name__])[0], model_type=model_type,
            vocab_size=int(model.config.vocab_size),
            max_positions=int(getattr(model.config, "max_position_embeddings", 0) or 0),
            graph=GRAPH, dtype=variant, inputs=inputs, outputs=outputs, kv_cache=kv,
            bos_token_id=bos, eos_token_ids=eos, pad_token_id=pad, tokenizer=tokenizer,
            source={"path_or_id": str(src), "weights_sha256": weights_hash(src_dir), "task": TASK},
            versions=versions(), validation={"skipped": True},
        )
        if validate_export:
            record = steps.run("validate", _validate, torch, model, manifest, runner(final / GRAPH),
                               atol if atol is not None else TOLERANCE[variant])
            manifest = Manifest(**{**manifest.__dict__, "validation": record})
            _check_validation(record)
        steps.run("write", _write, manifest, final, out, force)
        return ExportResult(out, manifest, steps.seconds)
    except RlxrtError:
        raise
    except Exception as exc:
        raise ExportError(f"export of {str(src)!r} failed: {type(exc).__name__}: {exc}") from exc
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _check_validation(record: dict) -> None:
    if not record["passed"]:
        worst = max((k for k in record if k.startswith("max_abs_diff")), key=lambda k: record[k])
        raise ExportError(
            f"validation failed: ORT and PyTorch differ by {record[worst]:.3g} ({worst}) "
            f"(allowed {record['tolerance']:.3g}; argmax agreement {record['argmax_agreement']:.2f}); "
            "nothing was written. Pass a looser atol only if this variant is expected to drift"
        )


def _family(model_type: str):
    """The module that exports a recurrent or hybrid family: mamba.py, jamba.py."""
    import importlib

    return importlib.import_module(f".{RECURRENT[model_type]}", __package__)


def _recurrent_graph(torch, model, work: Path, variant: str, with_hidden: bool) -> Path:
    if variant != "float32":
        raise ExportError(f"{model.config.model_type} exports in fp32 only for now (asked for {variant}); "
                          "drop --dtype/--quantize")
    final = work / "model"
    final.mkdir()
    _family(model.config.model_type).export_graph(torch, model, final / GRAPH, with_hidden)
    return final


def _recurrent_manifest(config: dict, model, model_type: str, src, src_dir: Path, transformers,
                        final: Path, with_hidden: bool) -> Manifest:
    family = _family(model_type)
    cfg = model.config
    bos, eos, pad = _special_tokens(model)
    return Manifest(
        architecture=(config.get("architectures") or [type(model).__name__])[0], model_type=model_type,
        vocab_size=int(cfg.vocab_size), max_positions=family.max_positions(cfg), graph=GRAPH,
        dtype="float32", inputs=family.inputs(cfg),
        outputs={"logits": "logits", "hidden_states": HIDDEN if with_hidden else None},
        kv_cache=family.kv_layout(cfg), state=family.state_layout(cfg),
        bos_token_id=bos, eos_token_ids=eos, pad_token_id=pad,
        tokenizer=_save_tokenizer(transformers, src_dir, final),
        source={"path_or_id": str(src), "weights_sha256": weights_hash(src_dir), "task": "recurrent-with-states"},
        versions=versions(), validation={"skipped": True})


def _optimum_export(optimum_onnx, model, raw: Path) -> None:
    import logging
    import warnings

    for name in ("optimum", "transformers", "torch.onnx"):
        logging.getLogger(name).setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        optimum_onnx.onnx_export_from_model(model, str(raw), task=TASK, do_validation=False)
    if not (raw / GRAPH).is_file():
        raise ExportError(f"optimum wrote no {GRAPH} (files: {sorted(p.name for p in raw.iterdir())})")


def _validate(torch, model, manifest: Manifest, run, tolerance: float) -> dict:
    prompt_len = 8
    ids, ref = reference_logits(torch, model, manifest.vocab_size, prompt_len=prompt_len, step_len=4)
    return validate(run, manifest, ids, ref, prompt_len, tolerance,
                    lambda *outs: hidden_diff(torch, model, ids, *outs))


def _write(manifest: Manifest, final: Path, out: Path, force: bool) -> None:
    manifest.write(final)
    backup = None
    if out.exists():
        if not force and any(out.iterdir()):  # someone wrote it meanwhile
            raise ExportError(f"output directory {str(out)!r} appeared during export; pass --force to replace it")
        backup = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.rename(out, backup)
    os.rename(final, out)
    if backup is not None:
        shutil.rmtree(backup, ignore_errors=True)

