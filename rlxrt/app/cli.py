"""The ``rlxrt`` command line.

Each command imports the sub-package it needs inside its own function, so
``rlxrt --help`` and ``rlxrt generate`` never import torch.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback
from typing import Callable

from rlxrt import __version__
from rlxrt.errors import RlxrtError, UsageError

from .flags import config_of, print_json

EXIT_ERROR = 1  # an RlxrtError: bad input, missing provider, failed export ...
EXIT_USAGE = 2  # argparse's own exit code for bad flags; also flags that exclude each other
EXIT_INTERNAL = 3  # a bug in rlxrt: printed with its traceback, to be reported


def cmd_providers(args: argparse.Namespace) -> int:
    from rlxrt.backends import default_registry

    config = config_of(args)
    reg = default_registry()
    statuses = reg.all()
    try:
        res = reg.resolve(config)
        chosen, fallbacks, error = res.names, res.fallbacks, None
    except RlxrtError as exc:
        chosen, fallbacks, error = [], [], str(exc)
    ort = reg.ort
    if args.json:
        print_json({"onnxruntime": getattr(ort, "__version__", None), "configured": list(config.providers),
                     "would_use": chosen, "fallbacks": fallbacks, "error": error,
                     "providers": [s.to_dict() for s in statuses]})
        return 0 if error is None else EXIT_ERROR
    print(f"onnxruntime {getattr(ort, '__version__', 'not installed')}")
    for s in statuses:
        mark = "yes" if s.available else "no "
        print(f"  {s.name:<9} {mark}  {s.reason if not s.available else s.ort_name}")
    print(f"configured: {', '.join(config.providers)}")
    if error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_ERROR
    print(f"would use:  {', '.join(chosen)}")
    return 0


def cmd_compile(args: argparse.Namespace) -> int:
    from rlxrt.backends import compile

    graph = compile(args.model, config_of(args))
    graph.huge_pages.wait()  # a one-shot command: report where the weights ended up
    if args.json:
        print_json(graph.to_dict())
    else:
        print(f"{graph.path}: providers {', '.join(graph.providers)}; cache {graph.cache}; "
              f"loaded in {graph.load_seconds:.3f} s; huge pages {graph.huge_pages.state}; "
              f"rlxrt's kernels {graph.cpu_kernels}")
        for f in graph.fallbacks:
            print(f"  fallback: {f}")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from .inspect import inspect_model

    info = inspect_model(args.model)
    if args.json:
        print_json(info)
        return 0
    print(f"graph:  {info['graph']}  ({info['size_bytes'] / 1e6:.1f} MB, opset {info['opset']})")
    for kind in ("inputs", "outputs"):
        print(f"{kind}:")
        for t in info[kind]:
            print(f"  {t['name']:<32} {t['dtype']:<8} {t['shape']}")
    if info["manifest"]:
        m = info["manifest"]
        dv = m.get("draft_vocab")
        drafts = f" (a draft: logits over {dv['size']} of them)" if dv else ""
        layers = m.get("hidden_layers") or (m.get("draft_head") or {}).get("hidden_layers")
        streams = f"; hidden_states also holds the residual streams after layers {layers}" if layers else ""
        print(f"manifest: {m['architecture']} ({m['model_type']}), vocab {m['vocab_size']}{drafts}, "
              f"max positions {m['max_positions']}, dtype {m['dtype']}{streams}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlxrt", description="Exact speculative decoding on ONNX Runtime.")
    parser.add_argument("--version", action="version", version=f"rlxrt {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    def add(name: str, fn: Callable[[argparse.Namespace], int], help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help)
        p.set_defaults(func=fn, parser=p)
        return p

    def runtime_flags(p: argparse.ArgumentParser, threads: int | None = None) -> None:
        p.add_argument("--providers", help="comma-separated preference list, e.g. cuda,cpu")
        p.add_argument("--strict", action="store_true", help="fail instead of falling back to another provider")
        p.add_argument("--threads", type=int,
                       help="intra-op threads, 0..256 (0 = ORT default; default: from RLXRT_INTRA_OP_THREADS or the "
                            f"config file, else {threads if threads is not None else 0})")
        p.add_argument("--config", help="TOML config file (default: ./rlxrt.toml if present)")

    p = add("providers", cmd_providers, "list execution providers: available or not, why, and which would be used")
    runtime_flags(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")

    p = add("compile", cmd_compile, "compile a model into an optimised, cached ORT session")
    p.add_argument("model", help="an .onnx file or a directory made by `rlxrt export`")
    runtime_flags(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")

    p = add("inspect", cmd_inspect, "show a model's inputs, outputs, opset, size and manifest")
    p.add_argument("model", help="an .onnx file or a directory made by `rlxrt export`")
    p.add_argument("--json", action="store_true", help="print one JSON object")

    from .commands import add_commands

    add_commands(add, runtime_flags)
    from .serve.command import add_serve_commands

    add_serve_commands(add, runtime_flags)
    from .distill import add_distill
    from .train_head import add_train_head

    add_train_head(add, runtime_flags)
    add_distill(add, runtime_flags)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="rlxrt: %(levelname)s: %(message)s")
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_USAGE
    try:
        return args.func(args)
    except UsageError as exc:
        print(f"{args.parser.prog}: usage error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except RlxrtError as exc:
        print(f"rlxrt: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("rlxrt: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`rlxrt inspect M | head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_ERROR
    except Exception:  # a bug: say so, with everything needed to report it
        print(f"rlxrt: internal error, please report it with this traceback (rlxrt {__version__}):",
              file=sys.stderr)
        traceback.print_exc()
        return EXIT_INTERNAL
