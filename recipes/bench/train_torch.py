#!/usr/bin/env python3
"""PyTorch eager baseline of recipes/bench/train.lua: the same Mixtral-style
model, loss and optimizer, one configuration per process.

Model (HF MixtralForCausalLM semantics, f32): embedding; per layer
h1 = h + o_proj(attn(rope(q), rope(k), v)) of RMSNorm(h),
h2 = h1 + MoE(RMSNorm(h1)); final RMSNorm, lm_head, mean CE over the S
predictions. Attention: GQA (query head h reads kv head h // (H/KV)),
rotate-half RoPE (theta 1e6), causal, EXACT and blocked: a custom autograd
function processes query blocks against all previous keys with a causal
mask on the diagonal block, saves only the output and the log-sum-exp, and
recomputes each block's probabilities in backward (flash-attention style),
so no S x S matrix exists for the whole sequence and memory stays O(S).
MoE: fp32 router, softmax, top-k, weights renormalised, SwiGLU experts
w2(silu(w1 x) * w3 x) in Hugging Face's loop (one_hot mask, per expert
index, index_add_). Losses: CE + 0.02 * HF load_balancing_loss_func over all
layers + 1e-3 * router z-loss (mean logsumexp(logits)^2), as moelua's.
Optimizer: torch.optim.AdamW(lr 3e-3, betas (0.9, 0.95), eps 1e-8,
weight_decay 0.1; 0 for norms and the embedding), global clip 1.0.
Init: normal(0, 0.02), norms 1. Tokens: random bytes (routing is near
uniform at init for both implementations).

  /usr/bin/python3 recipes/bench/train_torch.py --seq-len 4096 --dim 256 --layers 4 \
      --heads 4 --kv-heads 2 --experts 8 --topk 2 --ffn 512 --steps 3

One warm-up step, then `steps` timed steps; one JSON line with the same
field names as train.lua (tokens_per_s, step_ms medians, phases_ms,
peak_rss_bytes = VmHWM). Needs Debian's python3-torch under /usr/bin/python3;
the "blas" field names the BLAS library this process mapped (must be OpenBLAS).

Thread configuration: --threads sets torch's OpenMP pool (torch.set_num_threads);
OpenBLAS keeps its own pool (OPENBLAS_NUM_THREADS, default: every core) for the
GEMMs, and the two pools compete for the cores. OMP_WAIT_POLICY=PASSIVE in the
environment makes idle OpenMP threads sleep instead of spinning. The JSON line
records the configuration that ran ("config": t<threads>[-passive], with
"threads", "omp_wait_policy", "openblas_threads", "openblas_core"), so
train_compare.sh can pick the best one per seq_len.
"""
import argparse
import json
import math
import os
import statistics
import time

import torch
import torch.nn.functional as F

from bench_env import blas_library, thread_config


def peak_rss():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return None


# ---- exact blocked causal GQA attention ---------------------------------------

def _block_scores(qb, k, i0, scale):
    # qb [KV, G, B, hd], k [KV, n, hd] (n = i0 + B keys: all previous + this block)
    KV, G, B, hd = qb.shape
    s = torch.matmul(qb.reshape(KV, G * B, hd), k.transpose(1, 2)).mul_(scale)
    s = s.view(KV, G, B, -1)
    diag = s[..., i0:]                                   # [KV, G, B, B]: causal mask
    mask = torch.ones(B, B, dtype=torch.bool).triu_(1)
    diag.masked_fill_(mask, float("-inf"))
    return s


class BlockedAttention(torch.autograd.Function):
    """q [S, H, hd], k, v [S, KV, hd] -> o [S, H, hd]; exact causal softmax attention."""

    @staticmethod
    def forward(ctx, q, k, v, block):
        S, H, hd = q.shape
        KV = k.shape[1]
        G = H // KV
        scale = 1.0 / math.sqrt(hd)
        qh = q.permute(1, 0, 2).reshape(KV, G, S, hd)   # head h = kv * G + g
        kh = k.permute(1, 0, 2).contiguous()             # [KV, S, hd]
        vh = v.permute(1, 0, 2).contiguous()
        o = torch.empty(KV, G, S, hd, dtype=q.dtype)
        lse = torch.empty(KV, G, S, dtype=q.dtype)
        for i0 in range(0, S, block):
            i1 = min(S, i0 + block)
            s = _block_scores(qh[:, :, i0:i1], kh[:, :i1], i0, scale)
            m = torch.logsumexp(s, dim=-1)
            lse[:, :, i0:i1] = m
            p = s.sub_(m.unsqueeze(-1)).exp_()
            o[:, :, i0:i1] = torch.matmul(p.view(KV, -1, i1), vh[:, :i1]).view(KV, G, i1 - i0, hd)
        ctx.save_for_backward(qh, kh, vh, o, lse)
        ctx.block, ctx.scale = block, scale
        return o.reshape(H, S, hd).permute(1, 0, 2)

    @staticmethod
    def backward(ctx, do):
        qh, kh, vh, o, lse = ctx.saved_tensors
        block, scale = ctx.block, ctx.scale
        KV, G, S, hd = qh.shape
        H = KV * G
        doh = do.permute(1, 0, 2).reshape(KV, G, S, hd)
        delta = (doh * o).sum(-1)                          # [KV, G, S]
        dq = torch.empty_like(qh)
        dk = torch.zeros_like(kh)
        dv = torch.zeros_like(vh)
        for i0 in range(0, S, block):
            i1 = min(S, i0 + block)
            B = i1 - i0
            s = _block_scores(qh[:, :, i0:i1], kh[:, :i1], i0, scale)
            p = s.sub_(lse[:, :, i0:i1].unsqueeze(-1)).exp_()        # [KV, G, B, n]
            dob = doh[:, :, i0:i1].reshape(KV, G * B, hd)
            pf = p.view(KV, G * B, i1)
            dv[:, :i1] += torch.matmul(pf.transpose(1, 2), dob)
            dp = torch.matmul(dob, vh[:, :i1].transpose(1, 2)).view(KV, G, B, i1)
            ds = p.mul_(dp.sub_(delta[:, :, i0:i1].unsqueeze(-1))).mul_(scale).view(KV, G * B, i1)
            dq[:, :, i0:i1] = torch.matmul(ds, kh[:, :i1]).view(KV, G, B, hd)
            dk[:, :i1] += torch.matmul(ds.transpose(1, 2), qh[:, :, i0:i1].reshape(KV, G * B, hd))
        dq = dq.reshape(H, S, hd).permute(1, 0, 2)
        return dq, dk.permute(1, 0, 2), dv.permute(1, 0, 2), None


# ---- the model ------------------------------------------------------------------

def rms_norm(x, w, eps=1e-5):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope_tables(S, hd, theta):
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    ang = torch.outer(torch.arange(S, dtype=torch.float64), inv)
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos().float()[:, None, :], ang.sin().float()[:, None, :]


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


def moe_hf(x, wg, w1, w3, w2, k):
    logits = x @ wg.t()
    probs = F.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    y = torch.zeros_like(x)
    mask = F.one_hot(experts, num_classes=wg.shape[0]).permute(2, 1, 0)
    for e in range(wg.shape[0]):
        slot, tok = torch.where(mask[e])
        if tok.numel() == 0:
            continue
        xe = x[tok]
        h = F.silu(xe @ w1[e].t()) * (xe @ w3[e].t())
        y.index_add_(0, tok, (h @ w2[e].t()) * weights[tok, slot, None])
    return y, logits, probs, experts


class Model(torch.nn.Module):
    def __init__(self, a):
        super().__init__()
        V, D, L, H, KV, E, Fh = 256, a.dim, a.layers, a.heads, a.kv_heads, a.experts, a.ffn
        hd = D // H
        self.a, self.hd = a, hd
        P = torch.nn.Parameter

        def w(*shape):
            return P(torch.randn(*shape) * 0.02)
        self.embed = w(V, D)
        self.layers = torch.nn.ModuleList()
        for _ in range(L):
            m = torch.nn.Module()
            m.q, m.k, m.v, m.o = w(H * hd, D), w(KV * hd, D), w(KV * hd, D), w(D, H * hd)
            m.n1, m.n2 = P(torch.ones(D)), P(torch.ones(D))
            m.wg = w(E, D)
            m.w1, m.w3, m.w2 = w(E, Fh, D), w(E, Fh, D), w(E, D, Fh)
            self.layers.append(m)
        self.norm = P(torch.ones(D))
        self.lm_head = w(V, D)

    def forward(self, tokens, cos, sin):
        a, hd = self.a, self.hd
        ids, targets = tokens[:-1], tokens[1:]
        S = ids.shape[0]
        h = self.embed[ids]
        all_probs, all_experts, z = [], [], 0.0
        for m in self.layers:
            x = rms_norm(h, m.n1)
            q = (x @ m.q.t()).view(S, a.heads, hd)
            k = (x @ m.k.t()).view(S, a.kv_heads, hd)
            v = (x @ m.v.t()).view(S, a.kv_heads, hd)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            o = BlockedAttention.apply(q, k, v, a.block)
            h = h + o.reshape(S, -1) @ m.o.t()
            x = rms_norm(h, m.n2)
            y, logits, probs, experts = moe_hf(x, m.wg, m.w1, m.w3, m.w2, a.topk)
            h = h + y
            all_probs.append(probs)
            all_experts.append(experts)
            z = z + torch.logsumexp(logits, dim=-1).pow(2).mean()
        h = rms_norm(h, self.norm)
        ce = F.cross_entropy(h @ self.lm_head.t(), targets)
        # HF load_balancing_loss_func over all layers' tokens
        E = a.experts
        probs = torch.cat(all_probs)
        mask = F.one_hot(torch.cat(all_experts), E).float()        # [N, k, E]
        aux = E * torch.sum(mask.mean(0) * probs.mean(0).unsqueeze(0))
        z = z / len(self.layers)
        return ce, aux, z


def main():
    ap = argparse.ArgumentParser()
    for name, d in [("seq-len", 1024), ("dim", 64), ("layers", 2), ("heads", 4), ("kv-heads", 2),
                    ("ffn", 128), ("experts", 4), ("topk", 2), ("steps", 3), ("block", 512),
                    ("threads", 2), ("seed", 0)]:
        ap.add_argument("--" + name, type=int, default=d)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--aux-weight", type=float, default=0.02)
    ap.add_argument("--z-weight", type=float, default=1e-3)
    ap.add_argument("--clip", type=float, default=1.0)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    model = Model(a)
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (no_decay if n in ("embed", "norm") or n.endswith(".n1") or n.endswith(".n2") else decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), eps=1e-8)
    S = a.seq_len
    cos, sin = rope_tables(S, a.dim // a.heads, 1e6)
    gen = torch.Generator().manual_seed(a.seed)

    def step(i):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        tokens = torch.randint(0, 256, (S + 1,), generator=gen)
        t1 = time.perf_counter()
        ce, aux, z = model(tokens, cos, sin)
        loss = ce + a.aux_weight * aux + a.z_weight * z
        t2 = time.perf_counter()
        loss.backward()
        t3 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip)
        opt.step()
        t4 = time.perf_counter()
        return {"data": t1 - t0, "fwd": t2 - t1, "bwd": t3 - t2, "optim": t4 - t3, "total": t4 - t0}, ce.item()

    w, _ = step(0)
    times, phases, losses = [], {k: [] for k in ("data", "fwd", "bwd", "optim")}, []
    for i in range(1, a.steps + 1):
        t, loss = step(i)
        times.append(t["total"])
        for k in phases:
            phases[k].append(t[k])
        losses.append(loss)
    step_s = statistics.median(times)
    print(json.dumps({
        "impl": "torch", "seq_len": S, "dim": a.dim, "layers": a.layers, "heads": a.heads,
        "kv_heads": a.kv_heads, "experts": a.experts, "topk": a.topk, "ffn": a.ffn,
        "block": a.block, **thread_config(torch), "steps": a.steps,
        "warmup_ms": w["total"] * 1e3, "tokens_per_s": S / step_s, "step_ms": step_s * 1e3,
        "step_ms_all": [x * 1e3 for x in times],
        "phases_ms": {k: statistics.median(v) * 1e3 for k, v in phases.items()},
        "loss_first": losses[0], "loss_last": losses[-1], "peak_rss_bytes": peak_rss(),
        "torch": torch.__version__, "blas": blas_library(),
    }))


if __name__ == "__main__":
    main()
