"""``rlxrt distill TARGET --prompts FILE --out CORPUS.json``: the target writes replies to prompts, a corpus
for ``rlxrt train-head`` (self-distillation).

A head drafts best on the text it will meet when drafting: the target's own replies. Each prompt is rendered
with the target's chat template when it has one (a user turn), the target replies (rlxrt Session, prompt
lookup to go faster: exact, so the replies are the target's own; plainly on a graph whose verification rows
are not computed like one-row steps, e.g. int8 activations on ONNX Runtime's kernels, where a Session refuses
speculation), and the rendered prompt plus the reply (plus the end-of-turn token when the reply ended with
it) is one document of the output: a JSON list of texts, written after every reply, so that a stopped run
continues where it stopped. Temperatures cycle over the prompts (``--temperatures 0,0.7``: half greedy, half sampled with a per-prompt seed).

With no instructions at hand, ``--self-prompts N`` lets the target write them too (as Magpie does): from its
chat template's empty user turn it samples a request (temperature 0.7, top-p 0.9, at most 64 tokens), each
opened by one of a few generic openers (``OPENERS``) for variety; a request is kept when the target ended the
turn itself, it has at least three words and it is new. The requests are written to ``OUT-prompts.json`` first
and reused by a continued run (while they are written, ``OUT-prompts.partial.json`` keeps the ones found so
far after every try, so a run stopped then continues too). ``--exclude FILE...`` keeps other requests out (an earlier batch, and above all
the prompts you will measure the head on): a written request equal to one of them, or holding 80 % of its
words, is dropped.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
import time
from pathlib import Path

from rlxrt.errors import InputError, UsageError
from rlxrt.files import read_json, read_text
from rlxrt.limits import MAX_CORPUS_BYTES


def add_distill(add, runtime_flags) -> None:
    p = add("distill", cmd_distill, "let a target reply to prompts and write the dialogues as a train-head corpus")
    p.add_argument("target", help="target model directory")
    p.add_argument("--prompts", help="a .json list of prompts, or a text file with one per line")
    p.add_argument("--self-prompts", type=int, default=0, metavar="N",
                   help="the target also writes N requests itself (needs a chat template)")
    p.add_argument("--exclude", nargs="+", default=[], metavar="FILE",
                   help="with --self-prompts: drop written requests equal to (or holding 80%% of the words of) a "
                        "prompt in these files (.json lists or one per line), e.g. your evaluation prompts")
    p.add_argument("--out", required=True, help="the corpus to write: a .json list of texts (continued if present)")
    p.add_argument("--max-new-tokens", type=int, default=192)
    p.add_argument("--temperatures", default="0,0.7", help="comma-separated, cycled over the prompts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--limit", type=int, default=None, help="reply to the first N prompts only")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    runtime_flags(p, threads=2)


OPENERS = ("", "Write a Python function", "Explain", "How do I", "What is", "Can you", "Give me", "Describe",
           "Write a short", "Why")
"""How self-written requests start, cycled ("" leaves the whole request to the target)."""
NEAR = 0.8
"""A written request holding this share of an excluded prompt's words counts as that prompt."""
PROMPT_TOKENS = 64
TRIES = 4
"""Samples drawn per requested prompt at most, before giving up with fewer."""


def self_prompts(session, n: int, seed: int = 0, progress=None, exclude: list[str] = (),
                 start: tuple[list[str], int] = ((), 0)) -> list[str]:
    """Up to ``n`` user requests the target writes itself from its chat template's empty user turn, none
    equal or near (``NEAR``) to one of ``exclude``; ``progress(kept, tries)`` is called after each try with the
    requests kept so far. ``start`` = (kept, tries) continues a run stopped after that many tries: try i always
    samples with seed + i, so the result equals an uninterrupted run's."""
    if not session.has_chat_template:
        raise UsageError("--self-prompts needs a model with a chat template; pass --prompts FILE instead")
    marker = "\x00"
    text = session.chat_text([{"role": "user", "content": marker}])
    prefix = text[:text.index(marker)]
    kept: list[str] = list(start[0])
    seen: set[str] = set(exclude) | set(kept)
    avoid = [w for w in map(_words, exclude) if w]
    for i in range(start[1], n * TRIES):
        if len(kept) == n:
            break
        opener = OPENERS[i % len(OPENERS)]
        ids = session.codec.encode(prefix + opener, add_special_tokens=False)  # the template has its own BOS
        g = session.generate(ids, max_new_tokens=PROMPT_TOKENS, temperature=0.7, top_p=0.9, seed=seed + i)
        prompt = (opener + g.text).strip()
        if _ended(g) and len(prompt.split()) >= 3 and prompt not in seen and not _near(_words(prompt), avoid):
            kept.append(prompt)
            seen.add(prompt)
        if progress:
            progress(kept, i + 1)
    return kept


def _words(text: str) -> set[str]:
    return set(re.findall(r"\w+", text.lower()))


def _near(words: set[str], avoid: list[set[str]]) -> bool:
    """True when ``words`` hold NEAR of the words of one of ``avoid``."""
    return any(len(words & a) >= NEAR * len(a) for a in avoid)


def _ended(g) -> bool:
    """True when generation ended at an end-of-sequence token (not a stop string, not the length)."""
    return g.finish_reason == "stop" and g.stop_reason is not None and not isinstance(g.stop_reason, str)


def read_prompts(path: str, flag: str = "--prompts") -> list[str]:
    if path.lower().endswith(".json"):
        data = read_json(Path(path), flag)
        if not isinstance(data, list) or not all(isinstance(p, str) for p in data):
            raise InputError(f"{flag} {path!r}: a .json file must hold a list of prompt strings")
        prompts = data
    else:
        prompts = read_text(Path(path), flag).splitlines()
    prompts = [p for p in prompts if p.strip()]
    if not prompts:
        raise InputError(f"{flag} {path!r} holds no prompt")
    return prompts


def cmd_distill(args: argparse.Namespace) -> int:
    from rlxrt.backends import compile
    from rlxrt.sessions import PromptLookup, Session

    from .flags import config_of

    try:
        temps = [float(t) for t in args.temperatures.split(",")]
    except ValueError:
        raise UsageError(f"--temperatures must be comma-separated numbers, got {args.temperatures!r}") from None
    if not temps or any(not 0 <= t <= 10 for t in temps) or args.max_new_tokens < 1:
        raise InputError(f"--temperatures must lie in 0..10 and --max-new-tokens be >= 1, got {args.temperatures!r} "
                         f"and {args.max_new_tokens}")
    if args.self_prompts < 0 or (args.prompts is None and args.self_prompts < 1):
        raise UsageError(f"distill needs --prompts FILE or --self-prompts N (N >= 1), got --self-prompts "
                         f"{args.self_prompts}")
    if args.exclude and not args.self_prompts:
        raise UsageError("--exclude filters the requests --self-prompts writes; pass --self-prompts N too")
    exclude = [q for f in args.exclude for q in read_prompts(f, "--exclude")]
    prompts = read_prompts(args.prompts) if args.prompts else []
    out = Path(args.out)
    docs = read_json(out, "--out", limit=MAX_CORPUS_BYTES) if out.is_file() else []
    if not isinstance(docs, list):
        raise InputError(f"--out {args.out!r} exists and is not a JSON list; pass a new path")
    config = config_of(args, intra_op_threads=2)
    graph = compile(args.target, config)
    # a target whose verification rows are not computed like one-row steps takes no speculator
    session = Session(graph, None if graph.rows_mixed else PromptLookup())
    if args.self_prompts:
        prompts += _self_prompts(session, args, out, exclude)
    prompts = prompts[:args.limit]
    chat = session.has_chat_template
    end = (session.manifest.chat or {}).get("eos_token") or ""
    t0, tokens = time.perf_counter(), 0
    for i in range(len(docs), len(prompts)):
        t = temps[i % len(temps)]
        messages = [{"role": "user", "content": prompts[i]}]
        opts = dict(max_new_tokens=args.max_new_tokens, temperature=t, seed=args.seed + i)
        g = session.chat(messages, **opts) if chat else session.generate(prompts[i], **opts)
        text = session.chat_text(messages) if chat else prompts[i]
        docs.append(text + g.text + (end if chat and _ended(g) else ""))
        tokens += len(g.token_ids)
        _write(out, docs)
        if not args.quiet:
            rate = tokens / (time.perf_counter() - t0)
            print(f"\r  {i + 1}/{len(prompts)} replies  {tokens} tokens  {rate:.0f} tok/s", end="", file=sys.stderr,
                  flush=True)
    if not args.quiet:
        print(file=sys.stderr)
    print(json.dumps({"out": str(out), "documents": len(docs), "new_tokens": tokens,
                      "seconds": round(time.perf_counter() - t0, 1), "chat_template": chat}))
    return 0


def _self_prompts(session, args: argparse.Namespace, out: Path, exclude: list[str]) -> list[str]:
    """The self-written requests: read from OUT-prompts.json when a previous run wrote it, else written now.
    While they are written, OUT-prompts.partial.json holds the requests kept so far after every try, so a
    stopped run continues from its last try (with the same --self-prompts, --seed and --exclude)."""
    path = out.with_name(out.stem + "-prompts.json")
    if path.is_file():
        return read_prompts(str(path))
    partial = out.with_name(out.stem + "-prompts.partial.json")
    run = {"self_prompts": args.self_prompts, "seed": args.seed,
           "exclude_sha256": hashlib.sha256(json.dumps(exclude).encode()).hexdigest()}
    start: tuple[list[str], int] = ([], 0)
    if partial.is_file():
        saved = read_json(partial, "--out")
        if not isinstance(saved, dict) or {k: saved.get(k) for k in run} != run:
            raise UsageError(f"{str(partial)!r} holds the requests of a stopped run with other --self-prompts, --seed "
                             "or --exclude; rerun with those, or delete it to start afresh")
        kept, tries = saved.get("kept"), saved.get("tries")
        if not (isinstance(kept, list) and all(isinstance(q, str) for q in kept) and isinstance(tries, int)
                and len(kept) <= tries <= args.self_prompts * TRIES):
            raise InputError(f"{str(partial)!r} is damaged (it needs 'kept', a list of requests, and 'tries'); "
                             "delete it to start afresh")
        start = (kept, tries)
    t0 = time.perf_counter()

    def progress(found: list[str], tries: int) -> None:
        _write(partial, {**run, "tries": tries, "kept": found})
        if not args.quiet:
            print(f"\r  {len(found)}/{args.self_prompts} requests written ({tries} tries)", end="", file=sys.stderr,
                  flush=True)

    prompts = self_prompts(session, args.self_prompts, args.seed, progress, exclude, start)
    if not prompts:
        raise UsageError(f"the target wrote no usable request in {args.self_prompts * TRIES} tries; "
                         "pass --prompts FILE instead")
    _write(path, prompts)
    partial.unlink(missing_ok=True)
    if not args.quiet:
        print(f"\n  {len(prompts)} requests in {time.perf_counter() - t0:.0f} s -> {path}", file=sys.stderr)
    return prompts


def _write(path: Path, docs: list) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(docs, ensure_ascii=False), encoding="utf-8")
    os.replace(tmp, path)
