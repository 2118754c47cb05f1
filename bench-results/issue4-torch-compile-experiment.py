"""Experiment: torch.compile of the native backend's per-layer function (decode step, 1.5B)."""
import time, statistics, sys, torch
import torch.nn.functional as F
from speculant.models import load
from speculant.backends.native import NativeBackend, NativeModel, _rms_norm, _rotate
from speculant.backends.base import ForwardOut

def block(blk, x, cos, sin, mask, kslab, vslab, past: int, n: int, Hq: int, Hkv: int, D: int, eps: float):
    g = Hq // Hkv
    h = _rms_norm(x, blk.in_norm, eps)
    q = _rotate(blk.q_proj(h).view(n, Hq, D), cos, sin)
    k = _rotate(blk.k_proj(h).view(n, Hkv, D), cos, sin)
    v = blk.v_proj(h).view(n, Hkv, D)
    kslab[:, past:past + n] = k.transpose(0, 1)
    vslab[:, past:past + n] = v.transpose(0, 1)
    keys, values = kslab[:, :past + n], vslab[:, :past + n]
    q = q.view(n, Hkv, g, D).permute(1, 2, 0, 3).reshape(Hkv, g * n, D)
    o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
    o = o.view(Hkv, g, n, D).permute(2, 0, 1, 3).reshape(n, Hq * D)
    x = x + blk.o_proj(o)
    h = _rms_norm(x, blk.post_norm, eps)
    return x + blk.down_proj(F.silu(blk.gate_proj(h)) * blk.up_proj(h))

class Compiled(NativeBackend):
    def __init__(self, model, fn):
        super().__init__(model); self.fn = fn
    @torch.no_grad()
    def forward(self, tokens, positions=None, tree_mask=None, rows=None, want_hidden=False):
        m, cache = self.model, self.cache
        n = tokens.shape[0]; past = cache.length
        if positions is None: positions = torch.arange(past, past + n)
        cache.reserve(past + n)
        g = m.heads // m.kv_heads
        mask = self._mask(n, past, tree_mask).repeat(g, 1)
        freqs = positions.float()[:, None] * m.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        cos, sin = emb.cos().to(m.dtype), emb.sin().to(m.dtype)
        x = m.embed[tokens]
        for i, blk in enumerate(m.blocks):
            x = self.fn(blk, x, cos, sin, mask, cache.kv[i, 0], cache.kv[i, 1], past, n, m.heads, m.kv_heads, m.head_dim, m.eps)
        cache.advance(n)
        if rows is not None: x = x.index_select(0, rows)
        h = _rms_norm(x, m.norm, m.eps)
        return ForwardOut(m.lm_head(h).float(), h if want_hidden else None)

torch.set_num_threads(1)
quant = sys.argv[1] if len(sys.argv) > 1 else "int4"
lm = load("qwen2.5-coder-1.5b-instruct", "bfloat16")
nm = NativeModel.from_hf(lm.model, quant, keep_dense=False)
eager = NativeBackend(nm)
t0 = time.perf_counter()
comp = Compiled(nm, torch.compile(block, dynamic=True))
ctx = torch.randint(100, 20000, (128,))
res = {}
with torch.inference_mode():
    for name, b in (("eager", eager), ("compiled", comp)):
        t = time.perf_counter()
        b.forward(ctx, rows=torch.empty(0, dtype=torch.long))
        for r in (1, 4):
            b.forward(ctx[:r]); b.rollback(128)
        print(name, "warm-up (prefill + 2 widths) s", round(time.perf_counter() - t, 1), flush=True)
    times = {k: {1: [], 4: []} for k in ("eager", "compiled")}
    for _ in range(7):
        for name, b in (("eager", eager), ("compiled", comp)):
            for r in (1, 4):
                t = time.process_time(); b.forward(ctx[:r]); times[name][r].append((time.process_time() - t) * 1e3); b.rollback(128)
    # identical outputs?
    a = eager.forward(ctx[:1]).logits; eager.rollback(128)
    c = comp.forward(ctx[:1]).logits; comp.rollback(128)
    print("max |logit diff|", (a - c).abs().max().item())
for k, d in times.items():
    print(quant, k, {r: round(statistics.median(v), 1) for r, v in d.items()})
