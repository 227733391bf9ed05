"""``compile()``: an ONNX model in, an optimised ORT session on the configured providers out.

The optimised graph is cached on disk under a key made of the model's content
hash (external data included), the ORT version, the providers and their
options, the optimisation level and the machine. A cache entry is written to a
temporary directory and renamed into place, so concurrent compiles never see a
half-written entry.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from rlxrt.config import Config, check_config, load_config
from rlxrt.errors import ModelFormatError, ProviderError
from rlxrt.manifest import Manifest
from rlxrt.providers import short_name

from . import cpu_kernels
from .batched import batched_manifest, prepare as prepare_batch, refusal as batch_refusal
from . import head_batch
from .rows import mixed_rows
from ._ort import ort_errors
from .contract import check_contract
from .hugepages import HugePages, collapse_new, resident_chunks
from .modelfile import content_hash, external_files, locate
from .registry import Registry, Resolution, default_registry

log = logging.getLogger("rlxrt")

CACHE_LAYOUT = "1"
# Providers whose optimised graphs ORT can serialise; others compile nodes at load.
CACHEABLE = {"cpu", "cuda", "rocm"}
OPT_LEVELS = {"disable": "ORT_DISABLE_ALL", "basic": "ORT_ENABLE_BASIC", "extended": "ORT_ENABLE_EXTENDED",
              "layout": "ORT_ENABLE_LAYOUT", "all": "ORT_ENABLE_ALL"}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int | str | None, ...]
    """Static sizes as ints, symbolic ones by name (or None)."""
    dtype: str
    """ORT's type string, e.g. ``tensor(float)``."""


@dataclass
class CompiledGraph:
    """An ORT session plus its I/O contract and how it was made."""

    session: Any
    """The onnxruntime.InferenceSession."""
    path: Path
    """The source graph file."""
    manifest: Manifest | None
    """The model directory's manifest, when compiled from one."""
    providers: list[str]
    """Short names of the providers the session actually registered, in order."""
    requested: list[str]
    """The configured preference list."""
    fallbacks: list[str]
    """One sentence per preferred provider that is not in use (empty when all went as configured)."""
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    cache: str
    """"hit", "miss" or "off" (with the reason after a colon when off)."""
    cache_path: Path | None
    load_seconds: float
    config: Config = field(repr=False)
    errors: tuple[type[Exception], ...] = field(default=(RuntimeError,), repr=False)
    """The exception classes this session's ``run`` raises on an ONNX Runtime failure."""
    huge_pages: HugePages = field(default_factory=lambda: HugePages("off: not requested"), repr=False)
    """The move of the weights onto huge pages (CPU sessions): ``.state``, ``.wait()``."""
    cpu_kernels: str = "off: not requested"
    """Whether rlxrt's CPU kernels replaced ONNX Runtime's (``on: N MatMuls, M attention, …`` or ``off: why``)."""
    rows_exact: bool = False
    """Every MatMul-like node and every attention runs rlxrt's kernels: a row's output is bitwise the same alone
    or in a (k+1)-row verification (cpu_kernels.Plan.rows_exact)."""
    batched: bool = False
    """The batched variant of a fused graph (``backends/batched.py``)."""
    rows_mixed: str | None = None
    """Why a (k+1)-row verification is not computed like one-row steps, beyond float rounding, and the fix
    (``rows.mixed_rows``); None when it is. A Session refuses to speculate over such a target."""

    @property
    def rows(self) -> str:
        """How a verification's rows compare with one-row steps: ``exact`` (bit for bit), ``rounding`` (float
        kernels that take other paths for several rows) or ``mixed: why``."""
        return "exact" if self.rows_exact else f"mixed: {self.rows_mixed}" if self.rows_mixed else "rounding"

    @property
    def input_names(self) -> list[str]:
        return [t.name for t in self.inputs]

    @property
    def output_names(self) -> list[str]:
        return [t.name for t in self.outputs]

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": str(self.path), "providers": self.providers, "requested": self.requested,
            "fallbacks": self.fallbacks, "cache": self.cache, "huge_pages": self.huge_pages.state,
            "cpu_kernels": self.cpu_kernels, "rows_exact": self.rows_exact, "rows": self.rows,
            "cache_path": str(self.cache_path) if self.cache_path else None,
            "load_seconds": round(self.load_seconds, 4),
            "inputs": [{"name": t.name, "shape": list(t.shape), "dtype": t.dtype} for t in self.inputs],
            "outputs": [{"name": t.name, "shape": list(t.shape), "dtype": t.dtype} for t in self.outputs],
        }


@lru_cache(maxsize=1)
def _cpuinfo() -> tuple[tuple[str, str], ...]:
    """The first two (key, value) pairs of /proc/cpuinfo among model name, flags and Features (Linux)."""
    found = []
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith(("model name", "flags", "Features")):
                    key, value = line.split(":", 1)
                    found.append((key.strip(), value.strip()))
                if len(found) >= 2:
                    break
    except OSError:
        pass
    return tuple(found)


def cpu_model() -> str | None:
    """The CPU's model name where the system gives one (Linux x86), for benchmark results."""
    return next((value for key, value in _cpuinfo() if key == "model name"), None)


@lru_cache(maxsize=1)
def machine_fingerprint() -> str:
    """CPU model and feature flags: an ORT-optimised graph can be hardware-specific."""
    parts = [platform.system(), platform.machine(), platform.processor(), *(value for _, value in _cpuinfo())]
    return hashlib.blake2b("|".join(parts).encode(), digest_size=8).hexdigest()


def session_options(ort, config: Config, level: str | None = None):
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.intra_op_num_threads = config.intra_op_threads
    opts.inter_op_num_threads = config.inter_op_threads
    spin = "1" if config.spinning else "0"
    opts.add_session_config_entry("session.intra_op.allow_spinning", spin)
    opts.add_session_config_entry("session.inter_op.allow_spinning", spin)
    opts.add_session_config_entry("session.force_spinning_stop", "1")  # idle threads never take a core
    name = OPT_LEVELS[level or config.graph_optimization]
    if not hasattr(ort.GraphOptimizationLevel, name):
        raise ProviderError(
            f"graph_optimization {config.graph_optimization!r} is not supported by onnxruntime "
            f"{ort.__version__}; use one of basic, extended, all"
        )
    opts.graph_optimization_level = getattr(ort.GraphOptimizationLevel, name)
    cpu_kernels.register(opts)
    return opts


def _cache_key(model_hash: str, ort_version: str, res: Resolution, config: Config, matmul: str) -> str:
    blob = json.dumps({
        "layout": CACHE_LAYOUT, "model": model_hash, "ort": ort_version,
        "providers": res.providers, "level": config.graph_optimization, "machine": machine_fingerprint(),
        "matmul": matmul,
    }, sort_keys=True)
    return hashlib.blake2b(blob.encode(), digest_size=16).hexdigest()


def _make_session(ort, path: Path, opts, res: Resolution):
    try:
        return ort.InferenceSession(str(path), sess_options=opts, providers=res.providers)
    except Exception as exc:  # ORT raises Fail / InvalidProtobuf / InvalidGraph / RuntimeError
        text = str(exc).strip().splitlines()[0][:500] if str(exc).strip() else type(exc).__name__
        raise ModelFormatError(
            f"onnxruntime cannot load {str(path)!r}: {text}; check that the file is a complete ONNX model "
            "(re-export it) and that the providers support its operators"
        ) from None


def compile(model: str | os.PathLike, config: Config | None = None, *,
            registry: Registry | None = None, batched: bool = False) -> CompiledGraph:
    """Create an optimised ORT session for ``model`` (an .onnx file or an exported model directory).

    ``batched`` compiles the batched variant of a fused graph (``backends/batched.py``): several sequences a
    call, each in a slot of the KV buffers; ProviderError where it cannot be made, with the reason and the fix.

    ``config`` defaults to :func:`rlxrt.load_config` (environment, ``rlxrt.toml``).
    Provider fallbacks are errors under ``config.strict`` and warnings otherwise,
    recorded in ``CompiledGraph.fallbacks``.
    """
    config = check_config(config) if config is not None else load_config()
    if not isinstance(model, (str, os.PathLike)):
        raise ModelFormatError(f"a model is a path (an .onnx file or a directory made by `rlxrt export`) or a "
                               f"CompiledGraph, got {type(model).__name__} {str(model)[:80]!r}")
    registry = registry or default_registry()
    start = time.perf_counter()
    graph_path, manifest = locate(model)
    proto, ext_files = external_files(graph_path)
    res = registry.resolve(config)
    ort = registry.ort
    provider = res.names[0] if res.names else "cpu"
    head = batched and manifest is not None and bool(manifest.draft_head)
    if head:
        why = head_batch.refusal(manifest)
        if why:
            raise ProviderError(f"{graph_path.parent}: cannot draft for a batch in one call: {why}")
        head_batch.batch_head(proto, *head_batch.shape(manifest))  # planned on the graph the batch will run
    elif batched and manifest is not None and manifest.graph_kind == "fused":
        prepare_batch(proto, manifest.inputs)
    kernels = cpu_kernels.plan(proto, config.cpu_kernels, provider)
    if head:
        if not (kernels.nodes and kernels.rows_exact):
            raise ProviderError(f"{graph_path.parent}: a batched head needs rlxrt's CPU kernels for every MatMul "
                                f"(they are {kernels.state}); they take an int8 or int4 head (`rlxrt train-head "
                                "--quantize int8`, the default) with cpu_kernels = rlxrt or auto on the CPU provider")
        kernels.batched_head, kernels.state = head_batch.shape(manifest), f"{kernels.state}, batched head"
    elif batched:
        why = batch_refusal(manifest, kernels)
        if why:
            raise ProviderError(f"{graph_path.parent}: cannot serve a batch: {why}")
        kernels.batched, kernels.state = dict(manifest.inputs), f"{kernels.state}, batched"

    cache_state, cache_path, session = "off", None, None
    before = resident_chunks() if config.huge_pages else None
    non_cacheable = [n for n in res.names if n not in CACHEABLE]
    if not config.cache:
        cache_state = "off: disabled in config"
    elif non_cacheable:
        cache_state = f"off: {', '.join(non_cacheable)} compiles nodes at load; ORT cannot save them"
    else:
        session, cache_state, cache_path = _cached_session(ort, graph_path, ext_files, config, res, kernels)
    if session is None:
        session = _fresh_session(ort, graph_path, session_options(ort, config), res, kernels)
    mixed = mixed_rows(proto, kernels, provider)  # after the session: a failed rewrite falls back to ORT
    del proto

    used = [short_name(p) for p in session.get_providers()]
    fallbacks = list(res.fallbacks)
    for name in res.names:
        if name not in used:
            msg = f"provider {name!r} was requested but the session silently runs on {', '.join(used)}"
            if config.strict:
                raise ProviderError(f"{msg}; strict mode is on — fix the provider or drop it from the config")
            log.warning(msg)
            fallbacks.append(msg)
    if not config.huge_pages:
        pages = HugePages("off: huge_pages = false in config")
    elif used[0] != "cpu":
        pages = HugePages(f"off: the weights live on {used[0]}")
    else:
        pages = collapse_new(before)
    inputs = [TensorSpec(i.name, tuple(i.shape), i.type) for i in session.get_inputs()]
    outputs = [TensorSpec(o.name, tuple(o.shape), o.type) for o in session.get_outputs()]
    if manifest is not None:
        check_contract(head_batch.batched_manifest(manifest) if head else batched_manifest(manifest) if batched
                       else manifest, inputs, outputs,
                       str(graph_path.parent / "rlxrt.json"))
    return CompiledGraph(
        session=session, path=graph_path, manifest=manifest, providers=used,
        requested=list(config.providers), fallbacks=fallbacks, inputs=inputs, outputs=outputs,
        cache=cache_state, cache_path=cache_path, load_seconds=time.perf_counter() - start, config=config,
        errors=ort_errors(ort), huge_pages=pages, cpu_kernels=kernels.state,
        rows_exact=bool(kernels.nodes) and kernels.rows_exact, rows_mixed=mixed, batched=batched,
    )


def _fresh_session(ort, graph_path: Path, opts, res: Resolution, kernels: cpu_kernels.Plan, work: Path | None = None):
    """A session of the graph, with rlxrt's kernels put in first when planned: the rewritten graph is written to
    ``work`` (a temporary directory when None) and removed once ONNX Runtime has read it."""
    if not kernels.nodes:
        return _make_session(ort, graph_path, opts, res)
    own = work is None
    try:
        work = Path(tempfile.mkdtemp(prefix=".rlxrt-matmul-")) if own else work
        source = cpu_kernels.rewritten(graph_path, kernels, work)
    except OSError as exc:  # nowhere to write it: ONNX Runtime's kernels, said so
        kernels.nodes, kernels.state = [], f"off: the rewritten graph could not be written ({exc})"
        log.warning("rlxrt's kernels are %s", kernels.state[5:])
        return _make_session(ort, graph_path, opts, res)
    try:
        return _make_session(ort, source, opts, res)
    finally:
        for f in (source, source.with_name(source.name + ".data")):
            f.unlink(missing_ok=True)
        if own:
            shutil.rmtree(work, ignore_errors=True)


def _cached_session(ort, graph_path: Path, ext_files: list[Path], config: Config, res: Resolution,
                    kernels: cpu_kernels.Plan):
    """(session, cache state, entry): the cached optimised graph, or a fresh compile written into the cache.
    A cache that cannot be used (read-only, a file, a full disk) gives (None, "off: why", None): the caller
    compiles without it; a bad model still fails as a bad model."""
    root = Path(config.cache_dir)
    model_hash = content_hash([graph_path, *ext_files], memo_dir=root / "hashes")
    entry = root / "graphs" / _cache_key(model_hash, ort.__version__, res, config,
                                         f"{cpu_kernels.KERNEL_VERSION}|{kernels.state}")
    session = _load_cached(ort, entry, config, res)
    if session is not None:
        return session, "hit", entry
    try:
        return _compile_into_cache(ort, graph_path, entry, config, res, kernels), "miss", entry
    except OSError as exc:
        why = exc.strerror or str(exc)
    except ModelFormatError as exc:  # ORT may fail writing the optimised graph: is it the model or the cache?
        _fresh_session(ort, graph_path, session_options(ort, config), res, kernels)  # raises if it is the model
        why = f"ONNX Runtime could not write the optimised graph there ({str(exc)[:200]})"
    state = f"off: cache dir {config.cache_dir!r} is unusable ({why})"
    log.warning("compiling %s without the cache: %s", graph_path, state[5:])
    return None, state, None


def _load_cached(ort, entry: Path, config: Config, res: Resolution):
    """The cached session, or None (a damaged entry — a file lost or of another size than written — is
    dropped so the compile that follows replaces it)."""
    graph = entry / "model.onnx"
    if not entry.exists():
        return None
    problem = _entry_problem(entry)
    if problem is None:
        try:
            return ort.InferenceSession(str(graph), sess_options=session_options(ort, config, "disable"),
                                        providers=res.providers)
        except ort_errors(ort) as exc:
            problem = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
    log.warning("cached graph %s is damaged (%s); recompiling", entry, problem)
    shutil.rmtree(entry, ignore_errors=True)
    return None


def _entry_problem(entry: Path) -> str | None:
    """What is wrong with a cache entry's files, by the sizes its meta.json recorded; None if nothing."""
    try:
        sizes = json.loads((entry / "meta.json").read_text())["sizes"]
        for name, size in sizes.items():
            if (entry / name).stat().st_size != size:
                return f"{name} has {(entry / name).stat().st_size} bytes, {size} were written"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def _compile_into_cache(ort, graph_path: Path, entry: Path, config: Config, res: Resolution,
                        kernels: cpu_kernels.Plan):
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}-", dir=entry.parent))
    try:
        opts = session_options(ort, config)
        opts.optimized_model_filepath = str(tmp / "model.onnx")
        opts.add_session_config_entry("session.optimized_model_external_initializers_file_name",
                                      "model.onnx.data")
        opts.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes",
                                      "1024")
        session = _fresh_session(ort, graph_path, opts, res, kernels, work=tmp)
        sizes = {f.name: f.stat().st_size for f in tmp.iterdir()}
        (tmp / "meta.json").write_text(json.dumps({
            "source": graph_path.name, "ort": ort.__version__, "providers": res.providers,
            "graph_optimization": config.graph_optimization, "machine": machine_fingerprint(), "sizes": sizes,
        }, indent=1))
        try:
            os.rename(tmp, entry)
        except OSError:  # another process finished first; its entry is as good as ours
            shutil.rmtree(tmp, ignore_errors=True)
        return session
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
