"""CLI commands that build on export and sessions (export, generate)."""
from __future__ import annotations

import argparse
import json
import math
import sys

from rlxrt.errors import InputError, UsageError
from rlxrt.files import read_text
from rlxrt.limits import MAX_USER_FILE_BYTES

from .flags import config_of, head_dir, pair_of, prompts_of
from .speculators import KINDS as SPECULATOR_KINDS


def _hidden_layers(text: str | None) -> list[int] | str | None:
    """``--hidden-layers``: None, ``auto`` or comma-separated layer counts."""
    if text is None or text == "auto":
        return text
    try:
        return [int(j) for j in text.split(",")]
    except ValueError:
        raise UsageError(f"--hidden-layers takes comma-separated layer counts (e.g. 3,15,27) or auto, got "
                         f"{text!r}") from None


def cmd_export(args: argparse.Namespace) -> int:
    from .api import export

    if args.atol is not None and not (math.isfinite(args.atol) and args.atol > 0):
        raise InputError(f"--atol must be a positive number, got {args.atol}")
    if args.max_context is not None and args.max_context < 1:
        raise InputError(f"--max-context must be >= 1, got {args.max_context}")
    report = None if args.quiet else (lambda line: print(f"  {line}", file=sys.stderr))
    if not args.quiet:
        print(f"exporting {args.src} -> {args.out}", file=sys.stderr)
    res = export(args.src, args.out, dtype=args.dtype, quantize=args.quantize, force=args.force,
                 validate=not args.no_validate, atol=args.atol, report=report,
                 with_hidden_states=args.with_hidden_states, graph=args.graph, max_context=args.max_context,
                 int4_compute=args.int4_compute, greedy_head=args.greedy_head, draft_vocab=args.draft_vocab,
                 vocab_corpus=args.vocab_corpus, hidden_layers=_hidden_layers(args.hidden_layers))
    m = res.manifest
    v = m.validation
    if args.json:
        json.dump({"path": str(res.path), "seconds": res.seconds, "manifest": m.to_dict()}, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        check = ("not validated" if v.get("skipped") else
                 f"validated: max abs diff {v['max_abs_diff']:.2e} (allowed {v['tolerance']:.1e}), "
                 f"argmax agreement {v['argmax_agreement']:.2f}")
        vocab = (f"vocab {m.vocab_size}" if not m.draft_vocab else
                 f"drafts {m.draft_vocab['size']} of {m.vocab_size} tokens ({m.draft_vocab['corpus_coverage']:.0%} "
                 "of the corpus)")
        print(f"{res.path}: {m.architecture}, {m.dtype}, {vocab}, "
              f"{_cache_kind(m)}; {check}; "
              f"tokenizer {'saved' if m.tokenizer else 'none (token ids only)'}")
    return 0


def _cache_kind(m) -> str:
    parts = ([f"{m.kv_cache.layers} KV layers"] if m.kv_cache else []) + \
        (["recurrent state, per-position"] if m.state else [])
    return " + ".join(parts)


def _prompt(args: argparse.Namespace) -> str:
    if args.prompt is not None and args.prompt_file is not None:
        raise UsageError("pass either --prompt or --prompt-file, not both")
    if args.prompt_file is not None:
        if args.prompt_file == "-":
            data = sys.stdin.buffer.read(MAX_USER_FILE_BYTES + 1)
            if len(data) > MAX_USER_FILE_BYTES:
                raise InputError(f"the prompt on standard input is longer than {MAX_USER_FILE_BYTES} bytes; send a "
                                 "shorter one")
            try:
                return data.decode("utf-8")
            except UnicodeDecodeError:
                raise InputError("the prompt on standard input is not UTF-8 text; send UTF-8") from None
        return read_text(args.prompt_file, "--prompt-file")
    if args.prompt is None:
        raise UsageError("no prompt: pass --prompt TEXT or --prompt-file FILE (- for stdin)")
    return args.prompt


def _speculator(args: argparse.Namespace, config):
    """The speculator the generate flags ask for (None: plain decoding); conflicting flags are usage errors."""
    from . import speculators

    kind = args.speculator or ("draft" if args.draft else "mtp" if args.head else "none")
    model = speculators.model_of(kind)
    if args.draft and args.head:
        raise UsageError("--draft and --head exclude each other: pass one speculator")
    if args.draft and model != "draft":
        raise UsageError(f"--draft and --speculator {kind} exclude each other")
    if args.head and model != "mtp":
        raise UsageError(f"--head and --speculator {kind} exclude each other")
    if model == "draft" and not args.draft:
        raise UsageError(f"--speculator {kind} needs --draft DIR")
    if kind == "none":
        for flag, value in (("-k", args.k), ("--adaptive-k", args.adaptive_k),
                            ("--draft-providers", args.draft_providers), ("--min-draft-prob", args.min_draft_prob)):
            if value:
                raise UsageError(f"{flag} needs a speculator (--draft, --head or --speculator prompt-lookup|mtp); "
                                 "plain decoding drafts nothing")
    if kind == "prompt-lookup" and (args.draft_providers or args.min_draft_prob):
        raise UsageError(f"--{'draft-providers' if args.draft_providers else 'min-draft-prob'} needs a draft model "
                         "or head; prompt lookup runs no model")
    if not 0 <= args.min_draft_prob < 1:
        raise InputError(f"--min-draft-prob must be in [0, 1), got {args.min_draft_prob}")
    draft_config = config.with_overrides(providers=args.draft_providers) if args.draft_providers else config
    helper = args.draft if model == "draft" else head_dir(args.head, args.target) if model == "mtp" else None
    return speculators.build(kind, helper, draft_config, args.min_draft_prob)


def cmd_generate(args: argparse.Namespace) -> int:
    from rlxrt.sessions import Session


    prompt = _prompt(args)
    config = config_of(args)
    session = Session(args.target, _speculator(args, config), config, k=args.k, adaptive_k=args.adaptive_k)
    if args.chat or args.system is not None:
        if not session.has_chat_template:
            raise UsageError(f"--chat: {args.target!r} has no chat template (its source had none); drop --chat "
                             "and --system to continue the prompt as plain text")
        system = [{"role": "system", "content": args.system}] if args.system is not None else []
        prompt = session.chat_prompt(system + [{"role": "user", "content": prompt}])
    kwargs = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                  top_p=args.top_p, seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos)
    if args.chat or args.system is not None:
        kwargs["stop_token_ids"] = list(session.manifest.chat["end_of_turn_ids"])
    if args.json:
        g = session.generate(prompt, **kwargs)
        json.dump({"text": g.text, "token_ids": g.token_ids, "finish_reason": g.finish_reason,
                   "stop_reason": g.stop_reason, "prompt_tokens": len(g.prompt_token_ids),
                   "stats": g.stats.to_dict()}, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    with session.stream(prompt, **kwargs) as stream:
        for piece in stream:
            sys.stdout.write(piece)
            sys.stdout.flush()
    sys.stdout.write("\n")
    g = stream.generation
    print(f"[{g.finish_reason}] {g.stats.summary()}; providers {g.stats.providers}", file=sys.stderr)
    return 0


def _at_least(args: argparse.Namespace, **flags: int) -> None:
    for name, low in flags.items():
        value = getattr(args, name)
        if value is not None and value < low:
            raise InputError(f"--{name.replace('_', '-')} must be >= {low}, got {value}")


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo
    from .reference import reference_head

    _at_least(args, prompt_index=0, max_new_tokens=1, repeats=1)
    if args.model == "smollm2":
        return _demo_smollm2(args)
    config = config_of(args, intra_op_threads=1)
    target, draft = pair_of(args, config=config)
    prompts = prompts_of(args, args.prompt_index + 1)
    if args.prompt_index >= len(prompts):
        raise InputError(f"--prompt-index {args.prompt_index} is out of range: there are {len(prompts)} prompt(s) "
                         f"(0..{len(prompts) - 1})")
    kind = args.speculator or "draft"
    head = None
    if kind.endswith("mtp"):
        if args.target:
            raise UsageError("--speculator mtp in the demo runs the shipped head, which fits only the shipped target;"
                             " drop --target, or try your head with `rlxrt generate --target DIR --head DIR`")
        head = reference_head()
        if head is None:
            raise UsageError("this install lacks the shipped MTP head; reinstall rlxrt or pick --speculator draft")
    run_demo(target, draft, prompts[args.prompt_index], max_new_tokens=args.max_new_tokens, k=args.k,
             config=config, repeats=args.repeats, head=head,
             lookup=kind.startswith("lookup+"))
    return 0


def _demo_smollm2(args: argparse.Namespace) -> int:
    """The chat demo on SmolLM2-135M-Instruct with the MTP head rlxrt trained for it."""
    from .demo import run_demo
    from .smollm2 import DEMO_K, HEAD_HOURS, PROMPTS, SPECULATOR, build_target, paths, work_dir

    if args.draft or args.prompt_file:
        raise UsageError("--model smollm2 runs the target with its MTP head and its own prompts; drop --draft and "
                         "--prompt-file (pass --target DIR for a SmolLM2 export elsewhere)")
    if args.speculator and not args.speculator.endswith("mtp"):
        raise UsageError(f"--model smollm2 drafts with its MTP head: pass --speculator mtp or lookup+mtp, not "
                         f"{args.speculator!r} (it has no draft model)")
    target, head = paths(args.target)
    if head is None:
        raise UsageError(f"no MTP head for SmolLM2 was found (none is committed, and none is in the work "
                         f"directory); train one (about {HEAD_HOURS} hours on 2 cores) with:\n"
                         "  python -m rlxrt.app.recipe --smollm2 --train-head")
    if args.prompt_index >= len(PROMPTS):
        raise InputError(f"--prompt-index {args.prompt_index} is out of range: 0..{len(PROMPTS) - 1}")
    if not (target / "rlxrt.json").is_file():
        if args.target:
            raise UsageError(f"--target {args.target!r} holds no export (no rlxrt.json); drop --target to build "
                             "SmolLM2 in its default place")
        _require_export_stack()
        build_target(work_dir())
    kind = args.speculator or SPECULATOR
    run_demo(target, None, PROMPTS[args.prompt_index], max_new_tokens=args.max_new_tokens, k=args.k or DEMO_K,
             config=config_of(args, intra_op_threads=1), repeats=args.repeats, head=head, chat=True,
             lookup=kind.startswith("lookup+"))
    return 0


def _require_export_stack() -> None:
    """Building SmolLM2's export needs rlxrt[export] (torch and transformers dequantise its GGUF)."""
    import importlib.util

    missing = [m for m in ("torch", "transformers", "gguf") if importlib.util.find_spec(m) is None]
    if missing:
        from rlxrt.errors import MissingDependencyError

        raise MissingDependencyError(
            f"building SmolLM2's export needs {', '.join(missing)}: pip install torch==2.13.0 --index-url "
            "https://download.pytorch.org/whl/cpu && pip install 'rlxrt[export]'")


def _numbers(text: str, flag: str, convert, low: float, high: float) -> list:
    try:
        values = [convert(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"{flag} must be a comma-separated list of numbers, got {text!r}") from None
    if not values or any(not low <= v <= high for v in values):
        raise InputError(f"{flag} values must lie in {low}..{high}, got {text!r}")
    return values


def cmd_bench(args: argparse.Namespace) -> int:
    from pathlib import Path

    from rlxrt.limits import K_MAX

    from .bench import format_table, run_bench, write_outputs
    from .reference import reference_head

    _at_least(args, prompts=1, max_new_tokens=1, repeats=1)
    if args.head and args.no_head:
        raise UsageError("--head and --no-head exclude each other")
    if bool(args.hf_target) != bool(args.hf_draft):
        raise UsageError("pass both --hf-target and --hf-draft, or neither")
    if args.no_hf and args.hf_target:
        raise UsageError("--no-hf and --hf-target/--hf-draft exclude each other")
    if args.oga_draft and not args.oga_target:
        raise UsageError("--oga-draft needs --oga-target (onnxruntime-genai's directory of the target)")
    if args.chat and (args.oga_target or args.hf_target):
        raise UsageError("--chat runs rlxrt's rows only; drop --oga-target/--hf-target (or --chat)")
    temps = _numbers(args.temperatures, "--temperatures", float, 0.0, 100.0)
    ks = _numbers(args.ks, "--ks", int, 1, K_MAX)
    if args.min_draft_prob is not None and not 0 < args.min_draft_prob < 1:
        raise InputError(f"--min-draft-prob must be in (0, 1), got {args.min_draft_prob}")
    config = config_of(args, intra_op_threads=1)
    target, draft = pair_of(args, draft_optional=True, config=config)
    prompts = prompts_of(args, args.prompts)
    hf = None
    if not args.no_hf and not args.chat:
        hf_target = Path(args.hf_target) if args.hf_target else None
        hf_draft = Path(args.hf_draft) if args.hf_draft else None
        if hf_target is None and not args.target:
            from .reference import reference_weights

            hf_target, hf_draft = reference_weights() or (None, None)
        if hf_target and hf_draft:
            try:
                import torch  # noqa: F401
                import transformers  # noqa: F401

                hf = (hf_target, hf_draft)
            except ImportError:
                print("rlxrt: torch/transformers not installed; skipping the Hugging Face peers", file=sys.stderr)
    head = None if args.no_head else [Path(h) for h in args.head] if args.head else \
        None if args.target else reference_head()
    oga = (Path(args.oga_target), Path(args.oga_draft) if args.oga_draft else None) if args.oga_target else None
    res = run_bench(target, draft, prompts, max_new_tokens=args.max_new_tokens, repeats=args.repeats,
                    temperatures=temps, ks=ks, config=config, hf_dirs=hf, progress=not args.quiet, head_dir=head,
                    oga_dirs=oga, other_target=Path(args.other_target) if args.other_target else None,
                    other_draft=Path(args.other_draft) if args.other_draft else None,
                    chat=args.chat, min_prob=args.min_draft_prob)
    js, png = write_outputs(res, Path(args.out))
    print(format_table(res))
    print(f"wrote {js}" + (f" and {png}" if png else " (no PNG: matplotlib is not installed)"))
    return 0


def add_commands(add, runtime_flags) -> None:
    """Register the remaining sub-commands on the parser (see rlxrt.cli)."""
    p = add("export", cmd_export, "export a Hugging Face causal LM to an ONNX model directory with a KV cache")
    p.add_argument("src", help="a local Hugging Face model directory, a .gguf file (or a directory holding one), "
                               "or a hub id (needs network)")
    p.add_argument("out", help="the model directory to write")
    p.add_argument("--dtype", choices=["fp32", "fp16"], default="fp32", help="weights and cache type (fp16 for GPUs)")
    p.add_argument("--quantize", choices=["int8", "int4"],
                   help="int8: 8-bit blocks of 32 computed with int8 activations in a fused graph (made for "
                        "drafts: a quarter of the bytes, the same proposals), dynamic int8 in a portable one (no "
                        "speculation over it as a target: one activation scale for all rows); int4: "
                        "MatMulNBits blocks of 32 computed in fp32 (fused graphs; a GGUF's own Q4_0/Q4_1/Q8_0 "
                        "blocks are kept, not quantised again); exactness is then relative to the quantised graph")
    p.add_argument("--int4-compute", choices=["fp32", "int8"], default="fp32",
                   help="int8: int4 weights computed with int8 activations, faster plain decoding; speculation "
                        "over such a target is exact on rlxrt's CPU kernels and refused on ONNX Runtime's; a draft "
                        "may use it either way")
    p.add_argument("--greedy-head", action=argparse.BooleanOptionalAction, default=None,
                   help="fused fp32 graphs: greedy decoding reads the exact argmax found through int8 candidates "
                        "instead of the full logits (default on; --no-greedy-head leaves it out)")
    p.add_argument("--draft-vocab", type=int, metavar="N",
                   help="a draft-only fused graph whose logits cover the N tokens --vocab-corpus uses most (and the "
                        "end-of-generation ones): a cheaper draft step, exact output all the same; refused as a target")
    p.add_argument("--vocab-corpus", nargs="+", metavar="PATH",
                   help="text files, directories or .json lists of texts whose tokens --draft-vocab counts")
    p.add_argument("--force", action="store_true", help="replace a non-empty OUT")
    p.add_argument("--no-validate", action="store_true", help="skip the ORT-vs-PyTorch check")
    p.add_argument("--atol", type=float, help="validation tolerance (max abs logit diff, scaled by max |logit|)")
    p.add_argument("--graph", choices=["fused", "portable"],
                   help="fused: rlxrt's own graph (fused attention, a KV buffer bound in place, only the logits rows "
                        "needed; default for llama, mistral, qwen2, qwen3 in fp32; no torch needed); portable: optimum's")
    p.add_argument("--max-context", type=int, help="fused graphs: KV buffer length (default: the model's max positions)")
    p.add_argument("--with-hidden-states", action="store_true",
                   help="also output the last hidden state (needed by an MTP head drafting for this target)")
    p.add_argument("--hidden-layers", nargs="?", const="auto", metavar="L,L,...",
                   help="fused graphs: hidden_states also holds the residual stream after these layers (default: "
                        "auto, a low, a middle and a high layer), for an MTP head that reads them; implies "
                        "--with-hidden-states")
    p.add_argument("--quiet", action="store_true", help="no step report")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")

    p = add("generate", cmd_generate, "generate text with a target model, sped up by a draft or prompt lookup")
    p.add_argument("--target", required=True, help="target model directory (made by `rlxrt export`)")
    p.add_argument("--draft", help="draft model directory (same tokenizer as the target)")
    p.add_argument("--head", help="MTP head directory (drafts from the target's hidden states; the target "
                                  "must be exported with --with-hidden-states)")
    p.add_argument("--speculator", choices=list(SPECULATOR_KINDS),
                   help="what drafts tokens (default: the --draft model or --head if given, else none = plain "
                        "decoding; mtp without --head: the shipped head, for the shipped target; lookup+X: prompt "
                        "lookup where the text repeats itself, else X)")
    p.add_argument("-k", type=int, help="tokens drafted per round, 1..32 (default 4)")
    p.add_argument("--adaptive-k", action="store_true",
                   help="pick each round's k (1..2k) for the most tokens a second, from the rounds so far")
    p.add_argument("--min-draft-prob", type=float, default=0.0, metavar="P",
                   help="a draft model's or head's chain ends where its likeliest token is below P (its first token is "
                        "always drafted; exact either way); 0 (default): k tokens every round")
    p.add_argument("--prompt", help="the prompt text")
    p.add_argument("--prompt-file", help="read the prompt from a file (- for stdin)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the end-of-sequence token")
    p.add_argument("--draft-providers", help="providers for the draft model or head (default: as the target)")
    runtime_flags(p)
    p.add_argument("--chat", action="store_true", help="render the prompt as a user message with the model's "
                   "chat template; the reply ends at its end-of-turn token")
    p.add_argument("--system", help="a system message before the prompt (implies --chat)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")

    p = add("demo", cmd_demo, "stream a completion with the shipped reference pair and show the speedup")
    p.add_argument("--model", choices=["reference", "smollm2"], default="reference",
                   help="reference: the shipped pair (default); smollm2: chat with SmolLM2-135M-Instruct and its "
                        "trained MTP head (build it with `python -m rlxrt.app.recipe --smollm2`)")
    p.add_argument("--target", help="target model directory (default: the shipped reference target)")
    p.add_argument("--draft", help="draft model directory (default: the shipped reference draft)")
    p.add_argument("--prompt-file", help="a text file, or a JSON list of prompts (default: held-out prompts)")
    p.add_argument("--prompt-index", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("-k", type=int, default=None, help="tokens drafted per round (default 4: the draft's default, and the smollm2 demo's)")
    p.add_argument("--speculator", choices=["draft", "mtp", "lookup+draft", "lookup+mtp"],
                   help="what drafts (default: draft with the reference pair, lookup+mtp with smollm2); mtp runs "
                        "the model's committed head; lookup+X: prompt lookup where the text repeats, else X")
    p.add_argument("--repeats", type=int, default=3, help="side-by-side timing repeats")
    runtime_flags(p, threads=1)

    p = add("bench", cmd_bench, "benchmark plain vs speculative decoding (and peers) on held-out prompts")
    p.add_argument("--target", help="target model directory (default: the shipped reference target)")
    p.add_argument("--draft", help="draft model directory (default: the shipped reference draft)")
    p.add_argument("--prompt-file", help="a text file, or a JSON list of prompts (default: held-out prompts)")
    p.add_argument("--prompts", type=int, default=8, help="number of prompts")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--temperatures", default="0,0.7")
    p.add_argument("--ks", default="2,4,6", help="draft lengths to try")
    p.add_argument("--hf-target", help="Hugging Face weights of the target, for the transformers peers")
    p.add_argument("--hf-draft", help="Hugging Face weights of the draft")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers peers")
    p.add_argument("--oga-target", help="onnxruntime-genai's model directory of the same target weights "
                                        "(scripts/build_oga.sh): adds its plain and n-gram rows, greedy")
    p.add_argument("--oga-draft", help="onnxruntime-genai's directory of the draft: adds its draft-model row")
    p.add_argument("--other-target", help="another export of the same target (e.g. --graph portable): adds its "
                                          "plain row, measured in the same loop")
    p.add_argument("--other-draft", help="another export of the draft (e.g. --quantize int8): adds its draft "
                                         "rows, measured in the same loop")
    p.add_argument("--head", nargs="+", help="MTP head(s) for the target (default: the shipped head with the "
                                             "shipped pair); several heads run side by side")
    p.add_argument("--no-head", action="store_true", help="skip the MTP head rows")
    p.add_argument("--min-draft-prob", type=float, metavar="P",
                   help="also run each draft and head row with its chain ending where its likeliest token is "
                        "below P (rows named '... p>=P')")
    p.add_argument("--chat", action="store_true", help="send each prompt as a user message through the target's "
                                                       "chat template; replies end at its end-of-turn token")
    p.add_argument("--out", default="bench-out", help="directory for bench.json and bench.png")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    runtime_flags(p, threads=1)
