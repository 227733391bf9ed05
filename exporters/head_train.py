"""Training an MTP head on what a target's own graph computed (``rlxrt train-head``): no PyTorch model and no
Hugging Face weights of the target, only its hidden states and the log-normaliser of its logits per position.

The target's logits are a linear function of its ``hidden_states`` output (the LM head's input): over the
head's vocabulary they are ``h @ W.T`` with ``W`` the target's output rows of those tokens, which the caller
recovers from the graph's own outputs (``output_rows``). Loss per position p, as for the shipped head
(``reference/train_mtp.py``): the cross-entropy of the target's distribution at p+1 against the head's
(tokens outside a reduced vocabulary carry their mass out of the sum: the head learns p restricted to its
tokens), the same one chained step further on the head's own hidden state, and a regression of the head's
hidden state on the target's.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from rlxrt.errors import ExportError

from .reference.train import lr_at

SECOND_STEP = 0.5
REGRESSION = 1.0


@dataclass
class TeacherData:
    """What the target computed over windows of T + 1 tokens."""

    tokens: np.ndarray
    """[n, T + 1] int64."""
    hidden: np.ndarray
    """[n, T, F] float16: the target's hidden states after each of the first T tokens (its ``hidden_states``
    output: the LM head's input, H wide, then any residual streams of ``hidden_layers``)."""
    lse: np.ndarray
    """[n, T] float32: log-sum-exp of the target's logits over the whole vocabulary at each position."""


def output_rows(hidden: np.ndarray, logits: np.ndarray) -> tuple[np.ndarray, float]:
    """``W`` [N, H] with ``logits ≈ hidden @ W.T`` by least squares over the rows given ([n, H], [n, N], n >= H),
    and the largest absolute reconstruction error relative to the largest logit."""
    h = hidden.astype(np.float64)
    w, *_ = np.linalg.lstsq(h, logits.astype(np.float64), rcond=None)
    err = float(np.abs(h @ w - logits).max() / max(1.0, np.abs(logits).max()))
    return w.T.astype(np.float32), err


def losses(torch, head, x, h, lse):
    """x [B, T+1] ids, h [B, T, F], lse [B, T] -> (loss, first-step cross-entropy, chained, regression,
    first-step argmax agreement with the target within the head's vocabulary). ``h`` is the target's
    ``hidden_states``: the LM head's input (H wide), then any residual streams the head reads."""
    F = torch.nn.functional
    last = h[..., :head.embed.shape[1]]                             # the LM head's input
    t_logp = last @ head.out_weight().t() - lse[..., None]          # log p of the head's tokens
    e, log_a, b = head.gates(x[:, 1:-1])                           # x_{p+1} for p = 0..T-2
    states = head.scan_loop(log_a, b, torch.zeros(b.shape[0], b.shape[2]))
    logits1, hid1, logits2 = head.two_steps(h[:, :-1], e, states)  # x_{p+2} (imitating h_{p+1}); chained x_{p+3}
    ce1 = -(t_logp[:, 1:].exp() * F.log_softmax(logits1, -1)).sum(-1).mean()
    reg = F.smooth_l1_loss(hid1, last[:, 1:])
    ce2 = -(t_logp[:, 2:].exp() * F.log_softmax(logits2, -1)).sum(-1).mean()
    agree = (logits1.argmax(-1) == t_logp[:, 1:].argmax(-1)).float().mean()
    return ce1 + SECOND_STEP * ce2 + REGRESSION * reg, ce1, ce2, reg, agree


def _batch(torch, data: TeacherData, idx: np.ndarray):
    return (torch.from_numpy(data.tokens[idx]), torch.from_numpy(data.hidden[idx].astype(np.float32)),
            torch.from_numpy(data.lse[idx]))


def evaluate(torch, head, data: TeacherData, windows: int = 16) -> dict:
    idx = np.linspace(0, len(data.tokens) - 1, min(windows, len(data.tokens))).astype(int)
    with torch.no_grad():
        loss, ce1, ce2, reg, agree = losses(torch, head, *_batch(torch, data, idx))
    return {"loss": round(loss.item(), 4), "ce1": round(ce1.item(), 4), "ce2": round(ce2.item(), 4),
            "agree1": round(agree.item(), 4)}


def train(torch, head, data: TeacherData, held: TeacherData, *, steps: int, batch: int, lr: float, seed: int,
          checkpoint: Path, resume: bool = False, report: Callable[[dict], None] | None = None) -> list[dict]:
    """Train ``head`` for ``steps`` steps of ``batch`` windows (AdamW, warm-up then cosine to a tenth),
    checkpointing to ``checkpoint`` every 50 steps and at the end; ``resume`` continues from it. Returns the
    log: one record per step, with the held-out loss every 50 steps and at the end."""
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    rng = np.random.default_rng(seed)
    start, log = 0, []
    if resume:
        if not checkpoint.is_file():
            raise ExportError(f"--resume: no checkpoint at {str(checkpoint)!r}; start without --resume")
        saved = torch.load(str(checkpoint), weights_only=False)
        if saved["steps"] != steps:
            raise ExportError(f"--resume: the checkpoint was made for --steps {saved['steps']}, not {steps}")
        saved["head"].pop("masked", None)  # a buffer that heads of earlier versions kept
        try:
            head.load_state_dict(saved["head"])
        except RuntimeError:  # tensors of other shapes
            raise ExportError("--resume: the checkpoint's head has another shape; resume with the --mlp-size, "
                              "--draft-vocab and --attention-heads it was made with, or start without --resume") from None
        opt.load_state_dict(saved["opt"])
        rng.bit_generator.state = saved["rng"]
        start, log = saved["step"], saved["log"]
    t0, tokens = time.perf_counter(), 0
    for step in range(start + 1, steps + 1):
        idx = rng.integers(0, len(data.tokens), size=batch)
        for g in opt.param_groups:
            g["lr"] = lr_at(step - 1, steps, lr, warmup=min(50, steps // 10 + 1))
        loss, ce1, ce2, reg, agree = losses(torch, head, *_batch(torch, data, idx))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        tokens += batch * (data.tokens.shape[1] - 1)
        rec = {"step": step, "loss": round(loss.item(), 4), "ce1": round(ce1.item(), 4), "agree1": round(agree.item(), 4),
               "tokens_per_second": round(tokens / (time.perf_counter() - t0), 1)}
        if step % 50 == 0 or step == steps:
            rec["heldout"] = evaluate(torch, head, held)
            torch.save({"step": step, "steps": steps, "head": head.state_dict(), "opt": opt.state_dict(),
                        "rng": rng.bit_generator.state, "log": log + [rec]}, str(checkpoint))
        log.append(rec)
        if report:
            report(rec)
    return log


OVERFIT_GAP = 0.1
"""Training agreement this far above the held-out one means the corpus, not the steps, limits the head."""


def fit_summary(log: list[dict], last: int = 50) -> dict:
    """The mean training agreement of the last ``last`` steps beside the final held-out one, and advice when
    the head fits its training text much better than held-out text."""
    recent = [r["agree1"] for r in log[-last:]]
    train_agree = round(float(np.mean(recent)), 4) if recent else None
    held_agree = (log[-1].get("heldout") or {}).get("agree1") if log else None
    out = {"train_agree1": train_agree, "heldout_agree1": held_agree}
    if train_agree is not None and held_agree is not None and train_agree - held_agree > OVERFIT_GAP:
        out["advice"] = (f"training agreement {train_agree:.2f} against {held_agree:.2f} held out: the head has "
                         "learnt its corpus by heart; more text (e.g. more `rlxrt distill` replies) will help it more "
                         "than more steps")
    return out


def write_log(log: list[dict], path: Path) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in log), encoding="utf-8")
