#!/usr/bin/python3
"""An independent plain-PyTorch reference of the Mixtral forward, to cross-check
moelua checkpoints (tests/tools/mixtral_check.sh runs it against recipes/eval.lua).

    /usr/bin/python3 tests/tools/mixtral_check.py --ckpt DIR --data FILE [--seq-len N]
                     [--format bytes|u16|u32] [--dtype float32|float64]

DIR is a step directory, a ckpt root with a `latest` file, or any directory with
config.json and model.safetensors (or a sharded model.safetensors.index.json).
Nothing of moelua is used: the safetensors reader and the model below follow the
safetensors format and Hugging Face's modeling_mixtral.py (MixtralForCausalLM,
load_balancing_loss_func), written out in plain torch (no transformers package).

FILE is cut into its full (S+1)-token windows in order, from offset 0, no
shuffling, a last partial window left out (as recipes/eval.lua does). Printed as
one JSON object:
  loss      mean over windows of the mean next-token cross-entropy of the S predictions
  aux_loss  HF load_balancing_loss_func over the router logits of all layers and
            all windows concatenated (no attention mask), unscaled by the coefficient
  z_loss    mean over (layer, token) of logsumexp(router logits)^2
  tokens    windows x S
"""
import argparse
import json
import math
import os
import struct
import sys

import torch
import torch.nn.functional as F

# ---- safetensors -------------------------------------------------------------

DTYPES = {"F32": (torch.float32, 4), "BF16": (torch.bfloat16, 2), "F16": (torch.float16, 2)}


class FormatError(Exception):
    pass


def read_safetensors(path):
    """{name: float32 tensor} of one .safetensors file, checked strictly: header
    length, JSON header, dtype, shape, and data offsets that tile the data area
    exactly (no gaps, no overlaps, nothing past the end)."""
    if sys.byteorder != "little":
        raise FormatError("this reader assumes a little-endian host")
    with open(path, "rb") as f:
        blob = f.read()
    if len(blob) < 8:
        raise FormatError(f"{path}: {len(blob)} bytes, too short for the header length")
    (n,) = struct.unpack("<Q", blob[:8])
    if n > len(blob) - 8:
        raise FormatError(f"{path}: header length {n} runs past the end of the file ({len(blob)} bytes)")
    try:
        header = json.loads(blob[8:8 + n].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FormatError(f"{path}: header is not valid UTF-8 JSON ({e})")
    if not isinstance(header, dict):
        raise FormatError(f"{path}: header is not a JSON object")
    data = memoryview(blob)[8 + n:]
    out, spans = {}, []
    for name, info in header.items():
        if name == "__metadata__":
            if not isinstance(info, dict) or not all(isinstance(v, str) for v in info.values()):
                raise FormatError(f"{path}: __metadata__ must map strings to strings")
            continue
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise FormatError(f"{path}: {name}: expected exactly dtype, shape, data_offsets")
        if info["dtype"] not in DTYPES:
            raise FormatError(f"{path}: {name}: unsupported dtype {info['dtype']!r} (F32, BF16, F16)")
        dt, size = DTYPES[info["dtype"]]
        shape = info["shape"]
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                  for d in shape):
            raise FormatError(f"{path}: {name}: bad shape {shape!r}")
        offs = info["data_offsets"]
        if (not isinstance(offs, list) or len(offs) != 2
                or not all(isinstance(o, int) and not isinstance(o, bool) for o in offs)):
            raise FormatError(f"{path}: {name}: bad data_offsets {offs!r}")
        b, e = offs
        if not 0 <= b <= e <= len(data):
            raise FormatError(f"{path}: {name}: data_offsets {offs} outside the {len(data)}-byte data area")
        if e - b != math.prod(shape) * size:
            raise FormatError(f"{path}: {name}: {e - b} bytes for shape {shape} of {info['dtype']}")
        spans.append((b, e, name))
        raw = bytearray(data[b:e])
        t = torch.frombuffer(raw, dtype=dt) if raw else torch.empty(0, dtype=dt)
        out[name] = t.reshape(shape).to(torch.float32)
    pos = 0
    for b, e, name in sorted(spans):
        if b != pos:
            raise FormatError(f"{path}: {name}: data at {b}, expected {pos} (gap or overlap)")
        pos = e
    if pos != len(data):
        raise FormatError(f"{path}: {len(data) - pos} bytes after the last tensor")
    return out


def load_checkpoint(d):
    """(config dict, {HF name: float32 tensor}) of a checkpoint directory."""
    latest = os.path.join(d, "latest")
    if os.path.isfile(latest) and not os.path.isfile(os.path.join(d, "config.json")):
        with open(latest) as f:
            d = os.path.join(d, f.read().strip())
    with open(os.path.join(d, "config.json")) as f:
        config = json.load(f)
    single = os.path.join(d, "model.safetensors")
    index = os.path.join(d, "model.safetensors.index.json")
    if os.path.isfile(single):
        weights = read_safetensors(single)
    elif os.path.isfile(index):
        with open(index) as f:
            wmap = json.load(f)["weight_map"]
        weights = {}
        for shard in sorted(set(wmap.values())):
            for k, v in read_safetensors(os.path.join(d, shard)).items():
                if wmap.get(k) != shard:
                    raise FormatError(f"{shard}: {k} is not mapped to this shard by the index")
                weights[k] = v
        missing = set(wmap) - set(weights)
        if missing:
            raise FormatError(f"{index}: tensors missing from their shards: {sorted(missing)[:5]}")
    else:
        raise FormatError(f"{d}: no model.safetensors or model.safetensors.index.json")
    return d, config, weights


# ---- the model (HF modeling_mixtral semantics) --------------------------------

class Mixtral:
    def __init__(self, config, weights, dtype):
        c = config
        if c.get("model_type", "mixtral") != "mixtral":
            raise ValueError(f"model_type {c.get('model_type')!r} is not mixtral")
        if c.get("sliding_window") not in (None,):
            print(f"warning: sliding_window {c['sliding_window']} ignored (windows are shorter)",
                  file=sys.stderr)
        if c.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {c['hidden_act']!r} is not silu")
        self.D = c["hidden_size"]
        self.L = c["num_hidden_layers"]
        self.H = c["num_attention_heads"]
        self.KV = c.get("num_key_value_heads") or self.H
        self.hd = c.get("head_dim") or self.D // self.H
        self.E = c["num_local_experts"]
        self.k = c["num_experts_per_tok"]
        self.eps = c["rms_norm_eps"]
        self.theta = c.get("rope_theta", 1e6)
        self.dtype = dtype
        self.used = set()
        self.w = weights
        if c.get("tie_word_embeddings") and "lm_head.weight" not in weights:
            weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
        self.expect = {
            "model.embed_tokens.weight": [c["vocab_size"], self.D],
            "model.norm.weight": [self.D],
            "lm_head.weight": [c["vocab_size"], self.D],
        }
        for i in range(self.L):
            p = f"model.layers.{i}."
            I = c["intermediate_size"]
            self.expect.update({
                p + "input_layernorm.weight": [self.D],
                p + "post_attention_layernorm.weight": [self.D],
                p + "self_attn.q_proj.weight": [self.H * self.hd, self.D],
                p + "self_attn.k_proj.weight": [self.KV * self.hd, self.D],
                p + "self_attn.v_proj.weight": [self.KV * self.hd, self.D],
                p + "self_attn.o_proj.weight": [self.D, self.H * self.hd],
                p + "block_sparse_moe.gate.weight": [self.E, self.D],
            })
            for e in range(self.E):
                q = p + f"block_sparse_moe.experts.{e}."
                self.expect.update({q + "w1.weight": [I, self.D], q + "w2.weight": [self.D, I],
                                    q + "w3.weight": [I, self.D]})
        for name, shape in self.expect.items():
            if name not in weights:
                raise FormatError(f"missing tensor {name}")
            if list(weights[name].shape) != shape:
                raise FormatError(f"{name}: shape {list(weights[name].shape)}, expected {shape}")
        extra = set(weights) - set(self.expect)
        if extra:
            raise FormatError(f"unexpected tensors: {sorted(extra)[:5]}")
        self.w = {k: v.to(dtype) for k, v in weights.items()}

    def rmsnorm(self, x, w):
        # MixtralRMSNorm: variance in fp32, then weight * x (cast back)
        xf = x.to(torch.float32) if self.dtype != torch.float64 else x
        var = xf.pow(2).mean(-1, keepdim=True)
        return w * (xf * torch.rsqrt(var + self.eps)).to(x.dtype)

    def rope(self, S):
        inv = 1.0 / (self.theta ** (torch.arange(0, self.hd, 2, dtype=torch.int64).to(self.dtype) / self.hd))
        pos = torch.arange(S, dtype=torch.int64).to(self.dtype)
        freqs = torch.outer(pos, inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    @staticmethod
    def rotate_half(x):
        x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
        return torch.cat((-x2, x1), dim=-1)

    def attention(self, x, p, cos, sin):
        S = x.shape[0]
        w = self.w
        q = (x @ w[p + "q_proj.weight"].T).view(S, self.H, self.hd).transpose(0, 1)
        k = (x @ w[p + "k_proj.weight"].T).view(S, self.KV, self.hd).transpose(0, 1)
        v = (x @ w[p + "v_proj.weight"].T).view(S, self.KV, self.hd).transpose(0, 1)
        q = q * cos + self.rotate_half(q) * sin
        k = k * cos + self.rotate_half(k) * sin
        rep = self.H // self.KV             # repeat_kv: query head h reads kv head h // rep
        k = k.repeat_interleave(rep, dim=0)
        v = v.repeat_interleave(rep, dim=0)
        scores = (q @ k.transpose(1, 2)) / math.sqrt(self.hd)
        mask = torch.ones(S, S, dtype=torch.bool).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
        probs = torch.softmax(scores.to(torch.float32) if self.dtype != torch.float64 else scores,
                              dim=-1).to(self.dtype)
        o = (probs @ v).transpose(0, 1).reshape(S, self.H * self.hd)
        return o @ w[p + "o_proj.weight"].T

    def moe(self, x, p):
        w = self.w
        logits = x @ w[p + "gate.weight"].T                       # [S, E]
        lf = logits.to(torch.float32) if self.dtype != torch.float64 else logits
        rw = torch.softmax(lf, dim=-1)
        topw, topi = torch.topk(rw, self.k, dim=-1)
        topw = (topw / topw.sum(dim=-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(x)
        for e in range(self.E):
            tok, slot = torch.where(topi == e)
            if tok.numel() == 0:
                continue
            q = p + f"experts.{e}."
            xe = x[tok]
            h = F.silu(xe @ w[q + "w1.weight"].T) * (xe @ w[q + "w3.weight"].T)
            y = (h @ w[q + "w2.weight"].T) * topw[tok, slot, None]
            out.index_add_(0, tok, y)
        return out, logits

    def forward(self, ids):
        """ids [S] -> (logits [S, V], [router logits [S, E] per layer])"""
        S = ids.shape[0]
        cos, sin = self.rope(S)
        h = self.w["model.embed_tokens.weight"][ids]
        routers = []
        for i in range(self.L):
            p = f"model.layers.{i}."
            h = h + self.attention(self.rmsnorm(h, self.w[p + "input_layernorm.weight"]), p + "self_attn.", cos, sin)
            m, r = self.moe(self.rmsnorm(h, self.w[p + "post_attention_layernorm.weight"]), p + "block_sparse_moe.")
            h = h + m
            routers.append(r)
        h = self.rmsnorm(h, self.w["model.norm.weight"])
        return h @ self.w["lm_head.weight"].T, routers


def load_balancing_loss(gate_logits, E, k):
    """HF load_balancing_loss_func with attention_mask None."""
    cat = torch.cat(gate_logits, dim=0)
    routing = torch.softmax(cat, dim=-1)
    _, sel = torch.topk(routing, k, dim=-1)
    mask = F.one_hot(sel, E)
    tokens_per_expert = mask.to(routing.dtype).mean(dim=0)        # [k, E]
    router_prob = routing.mean(dim=0)                             # [E]
    return (tokens_per_expert * router_prob.unsqueeze(0)).sum() * E


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--format", default="bytes", choices=["bytes", "u16", "u32"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    a = ap.parse_args()
    dtype = getattr(torch, a.dtype)
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    d, config, weights = load_checkpoint(a.ckpt)
    model = Mixtral(config, weights, dtype)

    width = {"bytes": 1, "u16": 2, "u32": 4}[a.format]
    with open(a.data, "rb") as f:
        raw = f.read()
    if len(raw) % width:
        raise SystemExit(f"{a.data}: {len(raw)} bytes is not a whole number of {a.format} tokens")
    if a.format == "bytes":
        toks = torch.tensor(list(raw), dtype=torch.int64)
    else:
        dt = {"u16": "<u2", "u32": "<u4"}[a.format]
        import array
        arr = array.array({"u16": "H", "u32": "I"}[a.format])
        arr.frombytes(raw)
        toks = torch.tensor(list(arr), dtype=torch.int64)
    S, W = a.seq_len, a.seq_len + 1
    nwin = toks.numel() // W
    if nwin < 1:
        raise SystemExit(f"{a.data}: {toks.numel()} tokens, fewer than one window of {W}")
    if int(toks.max()) >= config["vocab_size"]:
        raise SystemExit(f"{a.data}: token {int(toks.max())} >= vocab_size {config['vocab_size']}")

    loss_sum, z_sum, n_lt, gates = 0.0, 0.0, 0, []
    with torch.no_grad():
        for i in range(nwin):
            win = toks[i * W:(i + 1) * W]
            logits, routers = model.forward(win[:-1])
            lf = logits.to(torch.float32) if dtype != torch.float64 else logits
            loss_sum += float(F.cross_entropy(lf, win[1:]))
            for r in routers:
                rf = r.to(torch.float32) if dtype != torch.float64 else r
                z_sum += float(torch.logsumexp(rf, dim=-1).pow(2).sum())
                n_lt += r.shape[0]
                gates.append(rf)
        aux = float(load_balancing_loss(gates, model.E, model.k))
    print(json.dumps({"loss": loss_sum / nwin, "aux_loss": aux, "z_loss": z_sum / n_lt,
                      "tokens": nwin * S, "windows": nwin, "seq_len": S, "ckpt": d,
                      "data": a.data, "dtype": a.dtype}))


if __name__ == "__main__":
    try:
        main()
    except FormatError as e:
        raise SystemExit(f"mixtral_check.py: {e}")
