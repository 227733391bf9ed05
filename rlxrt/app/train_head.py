"""``rlxrt train-head TARGET --corpus PATH... --out HEAD``: an MTP draft head for any exported target that
has a ``hidden_states`` output (export it with ``--with-hidden-states``), trained on the target's own graph.

Steps: read the corpus (text files, directories of them, or JSON lists of texts; held-out documents split
off by file) → tokenise with the target's tokenizer → run the target over windows through rlxrt (its hidden
states and the log-normaliser of its logits) → choose the draft vocabulary (the N most frequent tokens of the
training text) and recover the target's output rows of those tokens from its own outputs → train the head
(torch, ``exporters/head_train.py``) → export and validate it → measure its acceptance per position on the
held-out documents through a real Session.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

from rlxrt.errors import InputError, UsageError
from rlxrt.files import read_json, read_text
from rlxrt.limits import MAX_CORPUS_BYTES

from .distill import read_prompts
from .teacher import WINDOW

DEFAULT_DRAFT_VOCAB = 4096
"""The default draft vocabulary is min(4096, V / 2): the whole vocabulary's output layer costs a head the most
and teaches it the least (the sweep: docs/heads.md)."""
TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".json", ".c", ".h", ".js", ".ts", ".java", ".go", ".rs", ".html")


def add_train_head(add, runtime_flags) -> None:
    p = add("train-head", cmd_train_head, "train an MTP draft head for an exported target on a text corpus "
                                          "(the target's own graph is the teacher; needs rlxrt[export] for torch)")
    p.add_argument("target", help="target model directory, exported with --with-hidden-states")
    p.add_argument("--corpus", nargs="+", required=True, help="text files, directories of text files, or .json "
                                                              "files holding a list of texts")
    p.add_argument("--out", required=True, help="the head's model directory")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch", type=int, default=8, help="windows of 256 tokens per step")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--draft-vocab", type=int, default=None,
                   help="tokens the head drafts: the N most frequent of the corpus (0: the whole vocabulary; "
                        "default: min(4096, vocabulary / 2), see DEFAULT_DRAFT_VOCAB)")
    p.add_argument("--mlp-size", type=int, default=512, metavar="I",
                   help="the width of the head's gated MLP (its hidden size and recurrent state stay as they are)")
    p.add_argument("--attention-heads", type=int, default=0, metavar="N",
                   help="give the head a causal self-attention layer of N heads over the earlier positions (EAGLE's; "
                        "it must divide the target's hidden size): it then sees the context, not only the last "
                        "hidden state, at a slower training step (default 0: none)")
    p.add_argument("--max-tokens", type=int, default=200_000, help="training tokens the target is run over")
    p.add_argument("--heldout", type=float, default=0.1, help="share of the documents held out (by file)")
    p.add_argument("--quantize", choices=("int8", "int4", "none"), default="int8",
                   help="the head's graph: int8 projections computed with int8 activations and an int8 input "
                        "embedding (default: drafts as float32 does at an int4 graph's cost, docs/heads.md), int4 "
                        "projections, or none (float32)")
    p.add_argument("--resume", action="store_true", help="continue from OUT/.train/checkpoint.pt (at the last "
                                                        "step: only export again, e.g. with another --quantize)")
    p.add_argument("--eval-prompts", metavar="FILE",
                   help="requests (a .json list, or one per line) the finished head is also measured on, greedy, "
                        "k=4, each a user turn through the target's chat template when it has one: the prompts you "
                        "will serve predict a chat bench better than windows of held-out documents")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    runtime_flags(p, threads=2)


def documents(paths: list[str], flag: str = "--corpus", at_least: int = 2) -> list[tuple[str, str]]:
    """(name, text) of every document: a text file, each file under a directory (UTF-8 text only), or each
    string of a .json list; UsageError naming ``flag`` when fewer than ``at_least`` are not empty."""
    docs = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            files = sorted(f for f in path.rglob("*") if f.is_file() and f.suffix.lower() in TEXT_SUFFIXES)
            for f in files:
                try:
                    docs.append((str(f), read_text(f, flag, limit=MAX_CORPUS_BYTES)))
                except InputError:
                    continue  # a directory may hold binary files; named files must be text (below)
        elif path.suffix.lower() == ".json":
            data = read_json(path, flag, limit=MAX_CORPUS_BYTES)
            if not isinstance(data, list) or not all(isinstance(t, str) for t in data):
                raise InputError(f"{flag} {raw!r}: a .json corpus must hold a list of texts")
            docs += [(f"{raw}[{i}]", t) for i, t in enumerate(data)]
        else:
            docs.append((raw, read_text(path, flag, limit=MAX_CORPUS_BYTES)))
    docs = [(n, t) for n, t in docs if t.strip()]
    if len(docs) < at_least and at_least < 2:
        raise InputError(f"{flag} holds no text; pass text files, directories or a .json list of texts")
    if len(docs) < at_least:
        raise InputError(f"the corpus holds {len(docs)} non-empty document(s); pass at least 2 (held-out text is "
                         "split off by document)")
    return docs


def split(docs: list, share: float) -> tuple[list, list]:
    """Every k-th document held out (k = 1 / share), at least one each way."""
    k = max(2, round(1 / share))
    held = [d for i, d in enumerate(docs) if i % k == k - 1] or docs[-1:]
    train = [d for d in docs if d not in held]
    return train, held


def cmd_train_head(args: argparse.Namespace) -> int:
    from rlxrt.backends import compile
    from rlxrt.sessions.state import decoder_for
    from rlxrt.sessions.text import codec_for

    from .flags import config_of

    for flag, value, low in (("--steps", args.steps, 1), ("--batch", args.batch, 1),
                             ("--draft-vocab", args.draft_vocab if args.draft_vocab is not None else 0, 0),
                             ("--mlp-size", args.mlp_size, 1), ("--attention-heads", args.attention_heads, 0),
                             ("--max-tokens", args.max_tokens, 2 * WINDOW)):
        if value < low:
            raise InputError(f"{flag} must be >= {low}, got {value}")
    if not (0 < args.heldout < 1) or not (math.isfinite(args.lr) and args.lr > 0):
        raise InputError(f"--heldout must be in (0, 1) and --lr positive, got {args.heldout} and {args.lr}")
    requests = read_prompts(args.eval_prompts, "--eval-prompts") if args.eval_prompts else []
    try:
        import torch
    except ImportError:
        raise UsageError("train-head trains with torch: pip install torch==2.13.0 (or 'rlxrt[export]')") from None
    config = config_of(args, intra_op_threads=2)
    graph = compile(args.target, config)
    if graph.manifest is not None and graph.manifest.draft_vocab:
        raise UsageError(f"{args.target!r} is a draft-only export (--draft-vocab: logits over "
                         f"{graph.manifest.draft_vocab['size']} tokens); a head learns from the target itself: pass "
                         "its full-vocabulary export")
    m = graph.manifest
    if m is None or not m.outputs.get("hidden_states") or m.draft_head:
        raise UsageError(f"{args.target!r} has no hidden_states output; re-export the target with "
                         "`rlxrt export SRC OUT --with-hidden-states`")
    codec = codec_for(graph)
    if codec is None:
        raise UsageError(f"{args.target!r} was exported without a tokenizer; train-head tokenises text with it")
    say = (lambda s: None) if args.quiet else (lambda s: print(s, file=sys.stderr, flush=True))
    train_docs, held_docs = split(documents(args.corpus), args.heldout)
    sep = list(m.eos_token_ids[:1])
    stream = np.array([t for _, text in train_docs for t in codec.encode(text, add_special_tokens=False) + sep],
                      np.int64)[:args.max_tokens + 1]
    held_stream = np.array([t for _, text in held_docs for t in codec.encode(text, add_special_tokens=False) + sep],
                           np.int64)
    windows, held_windows = (len(stream) - 1) // WINDOW, min(16, (len(held_stream) - 1) // WINDOW)
    if windows < 1 or held_windows < 1:
        raise UsageError(f"the corpus gives {len(stream)} training and {len(held_stream)} held-out tokens; each needs "
                         f"at least {WINDOW + 1}")
    V = m.vocab_size
    asked = args.draft_vocab if args.draft_vocab is not None else min(DEFAULT_DRAFT_VOCAB, V // 2)
    n = asked if 0 < asked < V else 0
    vocab_ids = np.sort(np.argsort(-np.bincount(stream, minlength=V), kind="stable")[:n]) if n else None
    say(f"train-head: {len(train_docs)} training / {len(held_docs)} held-out documents, {windows * WINDOW} "
        f"training tokens; draft vocabulary {n or V} of {V}")
    model = decoder_for(graph)
    width = model.fetch_hidden()  # the LM head's input, then the residual streams of m.hidden_layers
    hidden_size = width // (1 + len(m.hidden_layers))
    if args.attention_heads and hidden_size % args.attention_heads:
        raise UsageError(f"--attention-heads {args.attention_heads} must divide the target's hidden size "
                         f"{hidden_size}; pass a divisor of it, e.g. {hidden_size // 64 or 1}")
    if m.hidden_layers:
        say(f"train-head: the head reads the residual streams after layers {', '.join(map(str, m.hidden_layers))} "
            "too")
    data, held, fit_h, fit_l = _teacher_outputs(args, graph, model, stream[:windows * WINDOW + 1],
                                                held_stream[:held_windows * WINDOW + 1], vocab_ids, hidden_size, say)
    return _train_and_export(args, torch, graph, config, m, data, held, fit_h, fit_l, vocab_ids, hidden_size, say,
                             requests)


def _teacher_outputs(args, graph, model, stream, held_stream, vocab_ids, hidden_size, say):
    """The target's pass over the training and held-out windows, or the cache of an earlier run's."""
    from rlxrt.manifest import MANIFEST_NAME

    from . import teacher as t

    directory = Path(args.out) / ".train"
    key = t.cache_key(graph.path.parent / MANIFEST_NAME, stream, held_stream, vocab_ids, 4 * hidden_size)
    found = t.load(directory, key)
    if found is not None:
        say(f"train-head: the target's outputs of an earlier run with the same target and corpus are reused "
            f"({directory / t.CACHE})")
        return found
    windows, held_windows = (len(stream) - 1) // WINDOW, (len(held_stream) - 1) // WINDOW
    target = t.target_digest(graph.path.parent / MANIFEST_NAME)
    known = t.known_windows(directory, target)
    if known:
        say(f"train-head: {len(known)} windows of an earlier run with the same target are reused where this "
            f"corpus has them ({directory / t.CACHE})")
    data, fit_h, fit_l = t.teacher(model, stream, windows, 4 * hidden_size, vocab_ids, known)
    held, *_ = t.teacher(model, held_stream, held_windows, 0, vocab_ids, known)
    del known
    directory.mkdir(parents=True, exist_ok=True)
    t.save(directory, key, target, data, held, fit_h, fit_l)
    return data, held, fit_h, fit_l


def _train_and_export(args, torch, graph, config, m, data, held, fit_h, fit_l, vocab_ids, hidden_size,
                      say, requests: list[str]) -> int:
    from rlxrt.exporters.head_train import fit_summary, output_rows, train, write_log
    from rlxrt.exporters.mtp import HeadConfig, build_head, write_head

    from .api import runner

    if len(fit_h) < hidden_size:
        raise UsageError(f"the corpus is too small to recover the target's output rows ({len(fit_h)} positions, "
                         f"{hidden_size} needed); pass more text")
    w, err = output_rows(fit_h[:, :hidden_size], fit_l)
    if err > 1e-3:
        raise UsageError(f"the target's logits are not a linear function of its hidden_states output (relative "
                         f"error {err:.2g}); train-head needs hidden_states to be the LM head's input")
    torch.set_num_threads(max(1, args.threads or 2))
    torch.manual_seed(args.seed)
    n = 0 if vocab_ids is None else len(vocab_ids)
    cfg = HeadConfig(hidden_size=hidden_size, vocab_size=m.vocab_size, intermediate_size=args.mlp_size, draft_vocab=n,
                     hidden_layers=tuple(m.hidden_layers), attention_heads=args.attention_heads)
    t = torch.from_numpy
    if vocab_ids is None:  # the full vocabulary: its recovered rows, frozen, in and out (a tied target's exactly)
        head = build_head(torch, cfg, t(w))
    else:  # its rows out (frozen); in: the same rows and one for every other token, learnt
        head = build_head(torch, cfg, t(np.concatenate([w, w.mean(0, keepdims=True)])), t(w), vocab_ids,
                          train_embedding=True)
    out = Path(args.out)
    (out / ".train").mkdir(parents=True, exist_ok=True)

    def report(rec):
        line = (f"\r  step {rec['step']}/{args.steps}  loss {rec['loss']:.3f}  agree {rec['agree1']:.2f}  "
                f"{rec['tokens_per_second']:.0f} tok/s")
        if "heldout" in rec:
            line += f"  held-out agree {rec['heldout']['agree1']:.2f}\n"
        say(line) if "heldout" in rec else (None if args.quiet else print(line, end="", file=sys.stderr, flush=True))

    log = train(torch, head, data, held, steps=args.steps, batch=args.batch, lr=args.lr, seed=args.seed,
                checkpoint=out / ".train" / "checkpoint.pt", resume=args.resume, report=report)
    write_log(log, out / ".train" / "log.jsonl")
    manifest = write_head(torch, head, cfg, m, out, runner, None if args.quantize == "none" else args.quantize)
    from rlxrt.sessions import MtpHead, Session

    session = Session(graph, MtpHead(out, config), config, k=4)
    measured = measure(session, held) | (measure_requests(session, requests) if requests else {})
    record = {"draft_vocab": n or m.vocab_size, "quantize": args.quantize, "steps": args.steps,
              "output_rows_error": err,
              "heldout": log[-1].get("heldout"), "fit": fit_summary(log), "validation": manifest.validation,
              **measured}
    (out / "train_report.json").write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    print(json.dumps({k: v for k, v in record.items() if k != "validation"}, indent=2))
    if "advice" in record["fit"]:
        say(f"train-head: {record['fit']['advice']}")
    return 0


def measure(session, held, prompts: int = 8, prompt_len: int = 64, new_tokens: int = 48) -> dict:
    """Greedy acceptance per draft position of ``session`` (the target with the head, k = 4) on held-out
    windows."""
    runs = [session.generate(w[:prompt_len].tolist(), max_new_tokens=new_tokens, ignore_eos=True)
            for w in held.tokens[:prompts]]
    return {"heldout_acceptance_per_position": _per_position(runs), "heldout_prompts": len(runs),
            "acceptance_measured_with": f"greedy, k=4, {prompt_len}-token prompts, {new_tokens} new tokens"}


def measure_requests(session, requests: list[str], new_tokens: int = 128) -> dict:
    """Greedy acceptance per draft position of ``session`` (k = 4) on ``requests``, each a user turn through the
    target's chat template when it has one (a reply ends at its end of turn), else a plain prompt."""
    chat = session.has_chat_template
    runs = [session.chat([{"role": "user", "content": text}], max_new_tokens=new_tokens) if chat
            else session.generate(text, max_new_tokens=new_tokens) for text in requests]
    return {"eval_acceptance_per_position": _per_position(runs), "eval_prompts": len(runs),
            "eval_measured_with": f"greedy, k=4, {'chat requests' if chat else 'prompts'}, up to {new_tokens} "
                                  "new tokens"}


def _per_position(runs) -> list[float]:
    """Accepted / drafted at each of the 4 draft positions over ``runs`` (Generations)."""
    drafted, accepted = np.zeros(4), np.zeros(4)
    for g in runs:
        d, a = g.stats.drafted_per_position, g.stats.accepted_per_position
        drafted[:len(d)] += d
        accepted[:len(a)] += a
    return [round(float(a / d), 4) if d else 0.0 for a, d in zip(accepted, drafted)]
