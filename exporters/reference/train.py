"""Train the reference target (next-token loss) or the draft (KL to the target's distribution).

    python -m rlxrt.exporters.reference.train target WORK --steps 1800 --threads 2   # 56 min on 2 cores
    python -m rlxrt.exporters.reference.train draft  WORK --steps 900 --threads 2    # 15 min

Resumable: a checkpoint (weights, optimizer, step) is written to WORK every
few minutes and picked up on restart; the finished model is saved with
``save_pretrained`` in WORK/target or WORK/draft. Seeds are fixed.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np

SEQ = 512
BATCH = 8
CONFIGS = {
    # 6 x 256: ~5.3M parameters; one ORT step ~3 ms on one CPU thread
    "target": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=6, num_attention_heads=8,
                   num_key_value_heads=4),
    # 1 x 128: ~0.7M parameters; one ORT step ~0.25 ms (c ~ 0.08)
    "draft": dict(hidden_size=128, intermediate_size=352, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2),
}
LR = {"target": 2e-3, "draft": 3e-3}
SEED = {"target": 1234, "draft": 4321}


def build(role: str, vocab: int, eos: int):
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=vocab, max_position_embeddings=1024, tie_word_embeddings=True,
                         bos_token_id=eos, eos_token_id=eos, rope_theta=10000.0, **CONFIGS[role])
    return tf.LlamaForCausalLM(cfg)


def batches(data: np.ndarray, rng: np.random.Generator, batch: int = BATCH):
    starts = rng.integers(0, len(data) - SEQ - 1, size=batch)
    return np.stack([data[s:s + SEQ + 1] for s in starts]).astype(np.int64)


def heldout_loss(torch, model, held: np.ndarray, windows: int = 48) -> float:
    """Mean next-token loss (nats) on fixed, evenly spaced held-out windows."""
    starts = np.linspace(0, len(held) - SEQ - 2, windows).astype(int)
    model.eval()
    total = 0.0
    with torch.no_grad():
        for i in range(0, windows, 8):
            x = torch.from_numpy(np.stack([held[s:s + SEQ + 1] for s in starts[i:i + 8]]).astype(np.int64))
            out = model(input_ids=x[:, :-1], labels=x[:, :-1].clone())
            logits = out.logits
            total += torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum").item()
    model.train()
    return total / (windows * SEQ)


def lr_at(step: int, steps: int, peak: float, warmup: int = 100) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["target", "draft"])
    ap.add_argument("work")
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--eval-every", type=int, default=200)
    ap.add_argument("--save-every-s", type=float, default=300)
    args = ap.parse_args()

    import torch
    from tokenizers import Tokenizer

    from .corpus import EOS

    torch.set_num_threads(args.threads)
    work = Path(args.work)
    tok = Tokenizer.from_file(str(work / "tokenizer" / "tokenizer.json"))
    vocab, eos = tok.get_vocab_size(), tok.token_to_id(EOS)
    data, held = np.load(work / "train.npy"), np.load(work / "heldout.npy")
    torch.manual_seed(SEED[args.role])
    model = build(args.role, vocab, eos)
    teacher = None
    if args.role == "draft":
        import transformers as tf

        teacher = tf.LlamaForCausalLM.from_pretrained(str(work / "target")).eval()
        for p in teacher.parameters():
            p.requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=LR[args.role], betas=(0.9, 0.95), weight_decay=0.1)
    ckpt = work / f"{args.role}.ckpt.pt"
    step, elapsed_before = 0, 0.0
    rng = np.random.default_rng(SEED[args.role])
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step, elapsed_before = state["step"], state["elapsed"]
        rng.bit_generator.state = state["rng"]
    log = open(work / f"{args.role}.log.jsonl", "a")
    params = sum(p.numel() for p in model.parameters())
    print(f"{args.role}: {params / 1e6:.2f}M parameters, step {step}/{args.steps}", flush=True)
    t0, last_save = time.time(), time.time()
    model.train()
    while step < args.steps:
        x = torch.from_numpy(batches(data, rng))
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.steps, LR[args.role])
        logits = model(input_ids=x[:, :-1]).logits
        if teacher is None:
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), x[:, 1:].reshape(-1))
        else:
            with torch.no_grad():
                t_logp = torch.log_softmax(teacher(input_ids=x[:, :-1]).logits, -1)
            d_logp = torch.log_softmax(logits, -1)
            loss = (t_logp.exp() * (t_logp - d_logp)).sum(-1).mean()  # KL(target || draft)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        elapsed = elapsed_before + time.time() - t0
        rec = {"step": step, "loss": round(loss.item(), 4), "tokens": step * BATCH * SEQ,
               "elapsed_s": round(elapsed, 1)}
        if step % args.eval_every == 0 or step == args.steps:
            rec["heldout_loss"] = round(heldout_loss(torch, model, held), 4)
            print(json.dumps(rec), flush=True)
        log.write(json.dumps(rec) + "\n")
        log.flush()
        if time.time() - last_save > args.save_every_s or step == args.steps:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "elapsed": elapsed,
                        "rng": rng.bit_generator.state}, str(ckpt) + ".tmp")
            Path(str(ckpt) + ".tmp").replace(ckpt)
            last_save = time.time()
    model.save_pretrained(str(work / args.role))
    print(f"saved {work / args.role}", flush=True)


if __name__ == "__main__":
    main()
