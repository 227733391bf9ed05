"""Train the MTP head of the reference target (exporters/mtp.py) on the target's own hidden states.

    python -m rlxrt.exporters.reference.train_mtp WORK --steps 600 --threads 2   # ~20 min on 2 cores

Loss, per position p: KL(target || head) for the token after next (the
target's distribution at p+1), a regression of the head's hidden state on the
target's h_{p+1}, and the same KL one chained step further, where the head
reads its own predicted hidden state (as it does when drafting). The target
is frozen; the head's output embedding is the target's. Writes WORK/mtp.pt
(weights + HeadConfig) and WORK/mtp.log.jsonl.
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from ..mtp import HeadConfig, build_head
from .train import batches, lr_at

SEED = 2468
LR = 2e-3
SECOND_STEP = 0.5
REGRESSION = 1.0


def losses(torch, head, target, x):
    """x [B, T+1] token ids -> first-step KL, chained-step KL, hidden regression, and the argmax agreement
    with the target of the first and the chained step."""
    F = torch.nn.functional
    with torch.no_grad():
        h = target.model(input_ids=x[:, :-1]).last_hidden_state         # [B, T, H], after the final norm
        t_logp = torch.log_softmax(h @ head.out_weight().t(), -1)               # the target's next-token rows
    e, log_a, b = head.gates(x[:, 1:-1])                                  # x_{p+1} for p = 0..T-2
    states = head.scan_loop(log_a, b, torch.zeros(b.shape[0], b.shape[2]))
    logits1, hid1 = head.mix(h[:, :-1], e, states)                        # predicts x_{p+2}, imitates h_{p+1}
    kl1 = (t_logp[:, 1:].exp() * (t_logp[:, 1:] - torch.log_softmax(logits1, -1))).sum(-1).mean()
    reg = F.smooth_l1_loss(hid1, h[:, 1:])
    logits2, _ = head.mix(hid1[:, :-1], e[:, 1:], states[:, 1:])           # chained: own hidden, token x_{p+2}
    kl2 = (t_logp[:, 2:].exp() * (t_logp[:, 2:] - torch.log_softmax(logits2, -1))).sum(-1).mean()
    agree = (logits1.argmax(-1) == t_logp[:, 1:].argmax(-1)).float().mean()
    agree2 = (logits2.argmax(-1) == t_logp[:, 2:].argmax(-1)).float().mean()
    return kl1, kl2, reg, agree, agree2


def heldout_agreement(torch, head, target, held: np.ndarray, windows: int = 16) -> dict:
    """Held-out KLs and how often the head's argmax is the target's, for the first and the chained step."""
    x = torch.from_numpy(batches(held, np.random.default_rng(0), windows))
    with torch.no_grad():
        kl1, kl2, _, a1, a2 = losses(torch, head, target, x)
    return {"heldout_kl1": round(kl1.item(), 4), "heldout_kl2": round(kl2.item(), 4),
            "heldout_agree1": round(a1.item(), 4), "heldout_agree2": round(a2.item(), 4)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("work")
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args()

    import torch
    import transformers as tf

    torch.set_num_threads(args.threads)
    work = Path(args.work)
    data, held = np.load(work / "train.npy"), np.load(work / "heldout.npy")
    target = tf.LlamaForCausalLM.from_pretrained(str(work / "target"), dtype=torch.float32).eval()
    for p in target.parameters():
        p.requires_grad_(False)
    cfg = HeadConfig(hidden_size=target.config.hidden_size, vocab_size=target.config.vocab_size,
                     rms_norm_eps=target.config.rms_norm_eps)
    torch.manual_seed(SEED)
    head = build_head(torch, cfg, target.get_input_embeddings().weight)
    params = [p for p in head.parameters() if p.requires_grad]
    print(f"mtp head: {sum(p.numel() for p in params) / 1e6:.2f}M trained parameters", flush=True)
    opt = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
    rng = np.random.default_rng(SEED)
    log = open(work / "mtp.log.jsonl", "w")
    t0 = time.time()
    for step in range(1, args.steps + 1):
        x = torch.from_numpy(batches(data, rng, args.batch))
        for g in opt.param_groups:
            g["lr"] = lr_at(step - 1, args.steps, LR, warmup=50)
        kl1, kl2, reg, agree, _ = losses(torch, head, target, x)
        loss = kl1 + SECOND_STEP * kl2 + REGRESSION * reg
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        rec = {"step": step, "kl1": round(kl1.item(), 4), "kl2": round(kl2.item(), 4), "reg": round(reg.item(), 4),
               "agree1": round(agree.item(), 4), "tokens": step * args.batch * 512,
               "elapsed_s": round(time.time() - t0, 1)}
        if step % 100 == 0 or step == args.steps:
            rec.update(heldout_agreement(torch, head, target, held))
            print(json.dumps(rec), flush=True)
        log.write(json.dumps(rec) + "\n")
        log.flush()
    torch.save({"config": asdict(cfg), "state_dict": {k: v for k, v in head.state_dict().items() if k not in ("embed", "unembed")}},
               str(work / "mtp.pt"))
    print(f"saved {work / 'mtp.pt'}", flush=True)


if __name__ == "__main__":
    main()
