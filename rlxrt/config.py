"""Runtime configuration: one frozen, typed record, validated on load.

Precedence: explicit arguments > environment (``RLXRT_*``) > TOML file
(``--config``/``RLXRT_CONFIG``, else ``rlxrt.toml`` in the working directory)
> defaults. Unknown keys and bad values raise :class:`ConfigError` naming the
key, the value and what is allowed.

Example ``rlxrt.toml``::

    providers = ["cuda", "cpu"]
    strict = true
    intra_op_threads = 4
    [provider_options.cuda]
    device_id = 1
"""
from __future__ import annotations

import json
import numbers
import os
import sys
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

import numpy as np

from .errors import ConfigError
from .files import read_text
from .limits import K_MAX, MAX_THREADS
from .providers import NAMES as PROVIDER_NAMES

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

OPTIMIZATION_LEVELS = ("disable", "basic", "extended", "layout", "all")
CPU_KERNELS = ("auto", "rlxrt", "ort")
CONFIG_FILE_NAME = "rlxrt.toml"
ENV_PREFIX = "RLXRT_"


def _default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "rlxrt")


@dataclass(frozen=True)
class Config:
    """How rlxrt creates ONNX Runtime sessions."""

    providers: tuple[str, ...] = ("cpu",)
    """Execution providers in order of preference, by short name (see ``rlxrt providers``)."""
    strict: bool = False
    """If true, a preferred provider that is unavailable or silently replaced is an error, not a warning."""
    intra_op_threads: int = 0
    """Threads inside one operator; 0 lets ONNX Runtime choose (one per physical core); at most 256."""
    inter_op_threads: int = 0
    """Threads across independent operators; 0 lets ONNX Runtime choose; at most 256."""
    allow_spinning: bool | None = None
    """Let intra-op threads spin between the parallel parts of a run, never after it (ORT's
    ``session.force_spinning_stop``). None (auto): on for one thread and for a Batch's steps, off for other
    sessions of several threads, which may run beside each other (docs/configuration.md)."""
    graph_optimization: str = "all"
    """ONNX Runtime graph optimisation level: one of disable, basic, extended, layout, all."""
    cache_dir: str = field(default_factory=_default_cache_dir)
    """Where optimised graphs are cached (keyed by model hash, ORT version, providers, options, machine)."""
    cache: bool = True
    """Whether to use the on-disk cache of optimised graphs."""
    provider_options: Mapping[str, Mapping[str, str]] = field(default_factory=lambda: MappingProxyType({}))
    """Per-provider ORT options, e.g. {"cuda": {"device_id": "1"}}; values are passed to ORT as strings."""
    huge_pages: bool = True
    """Move a CPU session's weights onto transparent huge pages after loading (Linux 6.1+, in the background)."""
    cpu_kernels: str = "auto"
    """Whose kernels run MatMuls (float32, int4, int8 activations) and attention on CPU: ``rlxrt`` (rlxrt's own,
    which read each weight once per call for all rows and compute a row the same alone or in a verification),
    ``ort`` (ONNX Runtime's), or ``auto`` (rlxrt's where the variant that runs was measured faster)."""
    fixed_rows: int | None = None
    """Rows of every decoding call of a target: its pending token, the drafts, then padding. Plain steps and
    verifications then run the same kernels, so a position's logits do not depend on how many tokens its call
    verified, on kernels that compute several rows otherwise than one (ONNX Runtime's on GPUs, in half
    precision). 0: off, each call feeds what it needs; None (``auto``): 9 where the target runs on anything but
    the CPU, else off. It caps k at fixed_rows - 1 and costs plain decoding T(fixed_rows)/T(1)
    (docs/exactness.md)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            object.__setattr__(self, f.name, _coerce(f.name, getattr(self, f.name), "argument"))

    @property
    def spinning(self) -> bool:
        """The effective spinning setting."""
        if self.allow_spinning is not None:
            return self.allow_spinning
        return self.intra_op_threads == 1

    def with_overrides(self, **overrides: Any) -> "Config":
        """A copy with some fields replaced (values are validated); None values are ignored."""
        overrides = {k: v for k, v in overrides.items() if v is not None}
        _check_keys(overrides, "argument")
        return replace(self, **overrides)

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["providers"] = list(self.providers)
        out["provider_options"] = {k: dict(v) for k, v in self.provider_options.items()}
        return out


FIELD_NAMES = tuple(f.name for f in fields(Config))
_fields_init = Config.__init__


def _init(self, *args: Any, **values: Any) -> None:
    """Config's own __init__ with an unknown key a ConfigError (naming it and the known ones), not a TypeError."""
    if args:
        raise ConfigError(f"Config takes keyword arguments only (e.g. Config(intra_op_threads=1)), got {args!r}")
    _check_keys(values, "argument")
    _fields_init(self, **values)


Config.__init__ = _init  # type: ignore[method-assign]


def check_config(config: Any) -> Config:
    """``config`` itself when it is a Config; ConfigError naming what was passed instead."""
    if not isinstance(config, Config):
        raise ConfigError(f"config must be an rlxrt.Config (e.g. Config(intra_op_threads=1), or "
                          f"rlxrt.load_config(...)), got {type(config).__name__} {str(config)[:80]!r}")
    return config


def _check_keys(values: Mapping[str, Any], source: str) -> None:
    for key in values:
        if key not in FIELD_NAMES:
            raise ConfigError(
                f"unknown config key {key!r} (from {source}); allowed keys: {', '.join(FIELD_NAMES)}"
            )


def _bool(key: str, value: Any, source: str) -> bool:
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("1", "true", "yes", "on"):
        return True
    if isinstance(value, str) and value.strip().lower() in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"config key {key!r} (from {source}) must be true or false, got {value!r}")


def _int(key: str, value: Any, source: str, low: int = 0, high: int | None = None) -> int:
    allowed = f"an integer in {low}..{high}" if high is not None else f"an integer >= {low}"
    if isinstance(value, (bool, np.bool_)):
        raise ConfigError(f"config key {key!r} (from {source}) must be {allowed}, got {value!r}")
    try:
        out = int(value)
    except (TypeError, ValueError, OverflowError):
        raise ConfigError(f"config key {key!r} (from {source}) must be {allowed}, got {value!r}") from None
    fractional = isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral) and value != out
    if out < low or (high is not None and out > high) or fractional:
        raise ConfigError(f"config key {key!r} (from {source}) must be {allowed}, got {value!r}")
    return out


def _providers(value: Any, source: str) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [v for v in value.replace(" ", "").split(",") if v]
    if not isinstance(value, (list, tuple)) or not value:
        raise ConfigError(
            f"config key 'providers' (from {source}) must be a non-empty list of provider names, got {value!r}; "
            f"known providers: {', '.join(PROVIDER_NAMES)}"
        )
    out = []
    for name in value:
        norm = str(name).strip().lower()
        if norm not in PROVIDER_NAMES:
            raise ConfigError(
                f"unknown provider {name!r} in config key 'providers' (from {source}); "
                f"known providers: {', '.join(PROVIDER_NAMES)}"
            )
        if norm in out:
            raise ConfigError(f"provider {name!r} is listed twice in config key 'providers' (from {source})")
        out.append(norm)
    return tuple(out)


def _provider_options(value: Any, source: str) -> Mapping[str, Mapping[str, str]]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ConfigError(
                f"config key 'provider_options' (from {source}) must be JSON like "
                f'{{"cuda": {{"device_id": 0}}}}, got {value!r} ({exc})'
            ) from None
    if not isinstance(value, Mapping):
        raise ConfigError(f"config key 'provider_options' (from {source}) must be a table of tables, got {value!r}")
    out = {}
    for name, opts in value.items():
        if name not in PROVIDER_NAMES:
            raise ConfigError(
                f"unknown provider {name!r} in config key 'provider_options' (from {source}); "
                f"known providers: {', '.join(PROVIDER_NAMES)}"
            )
        if not isinstance(opts, Mapping):
            raise ConfigError(
                f"config key 'provider_options.{name}' (from {source}) must be a table of option = value, got {opts!r}"
            )
        conv = {}
        for k, v in opts.items():
            if isinstance(v, (dict, list, tuple)) or v is None:
                raise ConfigError(
                    f"config key 'provider_options.{name}.{k}' (from {source}) must be a string, number or bool, got {v!r}"
                )
            conv[str(k)] = ("1" if v else "0") if isinstance(v, bool) else str(v)
        out[name] = MappingProxyType(conv)
    return MappingProxyType(out)


def _coerce(key: str, value: Any, source: str) -> Any:
    if key == "providers":
        return _providers(value, source)
    if key in ("strict", "cache", "huge_pages"):
        return _bool(key, value, source)
    if key in ("intra_op_threads", "inter_op_threads"):
        return _int(key, value, source, 0, MAX_THREADS)
    if key == "allow_spinning":
        if value is None or (isinstance(value, str) and value.strip().lower() in ("", "auto")):
            return None
        return _bool(key, value, source)
    if key == "graph_optimization":
        norm = str(value).strip().lower()
        if norm not in OPTIMIZATION_LEVELS:
            raise ConfigError(
                f"config key 'graph_optimization' (from {source}) must be one of "
                f"{', '.join(OPTIMIZATION_LEVELS)}, got {value!r}"
            )
        return norm
    if key == "cpu_kernels":
        norm = str(value).strip().lower()
        if norm not in CPU_KERNELS:
            raise ConfigError(f"config key 'cpu_kernels' (from {source}) must be one of {', '.join(CPU_KERNELS)}, "
                              f"got {value!r}")
        return norm
    if key == "fixed_rows":
        if value is None or (isinstance(value, str) and value.strip().lower() in ("", "auto")):
            return None
        rows = _int(key, value, source, 0, K_MAX + 1)
        if rows == 1:
            raise ConfigError(f"config key 'fixed_rows' (from {source}) must be 0 (off), auto or 2..{K_MAX + 1}: "
                              "one row leaves no room for a draft; got 1")
        return rows
    if key == "cache_dir":
        if not isinstance(value, (str, os.PathLike)) or not str(value):
            raise ConfigError(f"config key 'cache_dir' (from {source}) must be a directory path, got {value!r}")
        return str(Path(value).expanduser())
    if key == "provider_options":
        return _provider_options(value, source)
    raise ConfigError(f"unknown config key {key!r} (from {source}); allowed keys: {', '.join(FIELD_NAMES)}")


NOT_CONFIG_ENV = ("CONFIG", "SMOLLM2_DIR", "CPU_KERNELS_ISA")
"""RLXRT_ variables that are not config fields: the config file's path, where the SmolLM2 recipe builds, and
the vector width rlxrt's CPU kernels use (generic, avx2, avx512; default the widest the CPU runs)."""


def _from_env(env: Mapping[str, str]) -> dict[str, str]:
    out = {}
    for name, value in env.items():
        if not name.startswith(ENV_PREFIX) or name[len(ENV_PREFIX):] in NOT_CONFIG_ENV:
            continue
        key = name[len(ENV_PREFIX):].lower()
        if key not in FIELD_NAMES:
            allowed = ", ".join(ENV_PREFIX + k.upper() for k in FIELD_NAMES)
            raise ConfigError(
                f"unknown environment variable {name}={value!r}; allowed: {allowed}, "
                + ", ".join(ENV_PREFIX + n for n in NOT_CONFIG_ENV)
            )
        out[key] = value
    return out


def _from_file(path: Path) -> dict[str, Any]:
    text = read_text(path, "config file", ConfigError)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {str(path)!r} is not valid TOML: {exc}; fix the file") from None
    _check_keys(data, f"file {path}")
    return data


def load_config(path: str | os.PathLike | None = None, *, env: Mapping[str, str] | None = None,
                cwd: str | os.PathLike | None = None, defaults: Mapping[str, Any] | None = None,
                **overrides: Any) -> Config:
    """Build a :class:`Config` from defaults, a TOML file, the environment and explicit arguments.

    ``path`` is the TOML file (else ``RLXRT_CONFIG``, else ``rlxrt.toml`` in
    ``cwd`` if it exists). ``overrides`` whose value is None are ignored, so
    CLI flags can be passed straight through. ``defaults`` replace the built-in
    defaults (lowest precedence: a file or the environment still wins).
    """
    env = os.environ if env is None else env
    merged: dict[str, tuple[Any, str]] = {}
    _check_keys(defaults or {}, "defaults")
    for k, v in (defaults or {}).items():
        merged[k] = (v, "defaults")
    file_path = path if path is not None else env.get(ENV_PREFIX + "CONFIG")
    if file_path is None:
        candidate = Path(cwd if cwd is not None else os.getcwd()) / CONFIG_FILE_NAME
        if candidate.is_file():
            file_path = candidate
    if file_path is not None:
        for k, v in _from_file(Path(file_path)).items():
            merged[k] = (v, f"file {file_path}")
    for k, v in _from_env(env).items():
        merged[k] = (v, f"environment {ENV_PREFIX}{k.upper()}")
    explicit = {k: v for k, v in overrides.items() if v is not None}
    _check_keys(explicit, "argument")
    for k, v in explicit.items():
        merged[k] = (v, "argument")
    values = {k: _coerce(k, v, src) for k, (v, src) in merged.items()}
    return Config(**values)
