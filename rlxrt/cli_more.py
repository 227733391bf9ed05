"""CLI commands that build on export and sessions (export, generate)."""
from __future__ import annotations

import argparse
import json
import sys


def cmd_export(args: argparse.Namespace) -> int:
    from .api import export

    report = None if args.quiet else (lambda line: print(f"  {line}", file=sys.stderr))
    if not args.quiet:
        print(f"exporting {args.src} -> {args.out}", file=sys.stderr)
    res = export(args.src, args.out, dtype=args.dtype, quantize=args.quantize, force=args.force,
                 validate=not args.no_validate, atol=args.atol, report=report)
    m = res.manifest
    v = m.validation
    if args.json:
        json.dump({"path": str(res.path), "seconds": res.seconds, "manifest": m.to_dict()}, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        check = ("not validated" if v.get("skipped") else
                 f"validated: max abs diff {v['max_abs_diff']:.2e} (allowed {v['tolerance']:.1e}), "
                 f"argmax agreement {v['argmax_agreement']:.2f}")
        print(f"{res.path}: {m.architecture}, {m.dtype}, vocab {m.vocab_size}, "
              f"{m.kv_cache.layers if m.kv_cache else 0} layers; {check}; "
              f"tokenizer {'saved' if m.tokenizer else 'none (token ids only)'}")
    return 0


def add_commands(add, runtime_flags) -> None:
    """Register the remaining sub-commands on the parser (see rlxrt.cli)."""
    p = add("export", cmd_export, "export a Hugging Face causal LM to an ONNX model directory with a KV cache")
    p.add_argument("src", help="a local Hugging Face model directory, or a hub id (needs network)")
    p.add_argument("out", help="the model directory to write")
    p.add_argument("--dtype", choices=["fp32", "fp16"], default="fp32", help="weights and cache type (fp16 for GPUs)")
    p.add_argument("--quantize", choices=["int8"], help="dynamic int8 weights (a cheap CPU draft)")
    p.add_argument("--force", action="store_true", help="replace a non-empty OUT")
    p.add_argument("--no-validate", action="store_true", help="skip the ORT-vs-PyTorch check")
    p.add_argument("--atol", type=float, help="validation tolerance (max abs logit diff, scaled by max |logit|)")
    p.add_argument("--quiet", action="store_true", help="no step report")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
