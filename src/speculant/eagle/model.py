"""The EAGLE drafter's network (after Li et al. 2024, EAGLE-1's layout): one decoder layer over
the target's own features.

Notation: x_0 .. x_L the tokens, h_i (H,) the target's final (normed) hidden state at position i,
the one whose output layer predicts x_{i+1}. The drafter reads, at position i, the pair
(h_i, x_{i+1}) and predicts the target's next feature:

    u_i = fc([E[x_{i+1}] ; h_i])                       E: the target's frozen input embeddings
    a_i = u_i + Attention(u_0 .. u_i)                   causal, RoPE at position i, GQA
    f_{i+1} = a_i + MLP(RMSNorm(a_i))                   SwiGLU; f_{i+1} approximates h_{i+1}
    logits = lm_head(f_{i+1})                           the target's frozen output layer: x_{i+2}

so once the target has produced h_i and x_{i+1}, the drafter guesses x_{i+2}, and a guessed token
y with the predicted f_{i+1} makes the next pair (f_{i+1}, y): a draft of any depth, each step
attending to the committed pairs and to its own ancestors in the draft tree. There is no norm
before the attention and none after the MLP (EAGLE's choice: the output is compared with h).

With ``fused_layers`` (EAGLE-3's fusion of low-, middle- and high-level features) a committed pair
also reads the target's residual stream entering those layers, g_i (kH,):

    u_i = fc([E[x_{i+1}] ; h_i]) + fuse(g_i)

A drafted pair has no such states (the target has not run there): its u is fc's alone, as if g
were zero, so a drafter whose ``fuse`` is zero is exactly the one without fusion (the warm start
of :func:`eagle.narrow.with_fused_layers`).

Parameter names are those of EAGLE checkpoints (``fc.*``, ``layers.0.self_attn.{q,k,v,o}_proj.*``,
``layers.0.mlp.{gate,up,down}_proj.weight``, ``layers.0.post_attention_layernorm.weight``), so a
state dict is written in the layout EAGLE's loaders read (``fuse.weight`` and ``fuse_scale`` are
speculant's own). Shapes: H hidden size, k fused layers, W = H (1 + k) the width of a committed
pair's target state [h ; g], Hq / Hkv query / key-value heads of D dims, n new pairs, P cached pairs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError, ModelLoadError
from ..heads.attention import attention_dtype, grouped_attention
from ..heads.layers import ContextCache
from ..heads.projection import DraftVocabulary, layer_shape

__all__ = ["EagleCache", "EagleConfig", "EagleModel"]


@dataclass(frozen=True)
class EagleConfig:
    """The drafter's shape; the attention's geometry and RoPE follow the target's."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    head_dim: int = 0  # 0: hidden_size // num_attention_heads
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False  # q/k/v biases (Qwen2)
    depth: int = 6  # the deepest draft it is trained and used for
    draft_vocab: int = 0  # propose only these many tokens (a stored id list), 0 = all
    # fc reads its inputs standardized unit by unit (a stored, frozen (2H,) scale: 1 / each unit's
    # RMS over the embeddings and over the training features). The function is the same as with
    # the scale folded into fc (what the export does); the training is not: with Adam every weight
    # moves about the same amount, so raw inputs let the features' outlier units (RMS up to ~50
    # against a median of ~3) take the largest steps
    input_scale: bool = False
    base_model: str = ""
    # the target layers (0-based) whose input states a committed pair reads beside h (EAGLE-3's
    # fusion; module docstring); () none
    fused_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "fused_layers", tuple(self.fused_layers))
        if any(not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in self.fused_layers) \
                or len(set(self.fused_layers)) != len(self.fused_layers):
            raise ConfigError(f"fused_layers must be distinct layer numbers >= 0, got {list(self.fused_layers)}")
        for name in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size",
                     "depth"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"EAGLE drafter {name} must be an integer >= 1, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"{self.num_attention_heads} query heads do not split into {self.num_key_value_heads} "
                              "key-value groups")
        if not self.head_dim and self.hidden_size % self.num_attention_heads:
            raise ConfigError(f"hidden size {self.hidden_size} is not a multiple of {self.num_attention_heads} heads: "
                              "give head_dim")
        if not isinstance(self.draft_vocab, int) or not 0 <= self.draft_vocab <= self.vocab_size:
            raise ConfigError(f"draft_vocab must be an integer in [0, {self.vocab_size}], got {self.draft_vocab!r}")

    @property
    def state_width(self) -> int:
        """W: the width of a committed pair's target state [h ; g]."""
        return self.hidden_size * (1 + len(self.fused_layers))

    @property
    def dims(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    def rope_frequencies(self) -> torch.Tensor:
        """RoPE's inverse frequencies (D/2,) float32."""
        return self.rope_theta ** (-torch.arange(0, self.dims, 2, dtype=torch.float32) / self.dims)

    @classmethod
    def for_target(cls, cfg, intermediate_size: int | None = None, **options) -> "EagleConfig":
        """The shape for a transformers config ``cfg`` of the target (Llama / Qwen2)."""
        rope = getattr(cfg, "rope_parameters", None) or {}
        return cls(hidden_size=cfg.hidden_size, intermediate_size=intermediate_size or cfg.intermediate_size,
                   num_attention_heads=cfg.num_attention_heads,
                   num_key_value_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
                   vocab_size=cfg.vocab_size, head_dim=getattr(cfg, "head_dim", 0) or 0,
                   rope_theta=float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))),
                   rms_norm_eps=float(getattr(cfg, "rms_norm_eps", 1e-6)),
                   attention_bias=cfg.model_type == "qwen2" or bool(getattr(cfg, "attention_bias", False)),
                   base_model=getattr(cfg, "_name_or_path", "") or "", **options)

    def to_json(self) -> dict:
        return {"speculant_eagle": asdict(self)}

    @classmethod
    def from_json(cls, data: dict) -> "EagleConfig":
        raw = data.get("speculant_eagle")
        if not isinstance(raw, dict):
            raise ModelLoadError("not a speculant EAGLE drafter config (no 'speculant_eagle' entry)")
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in known})


class EagleCache(ContextCache):
    """The keys and values of the committed pairs: (Hkv, P, D) each (float32 for a bf16 drafter:
    see :func:`grouped_attention`), in buffers that double when full; ``length`` = P, also the
    position of the next pair. After them, ``staged`` rows of the draft tree being grown
    (:meth:`EagleModel.tree_step`), so its attention reads one slice of the buffers, no copy; the
    next commit or :meth:`unstage` drops them."""

    staged = 0

    def view(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if self.k is None:
            return None, None
        return self.k[:, :self.length], self.v[:, :self.length]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.staged = 0
        return super().append(k, v)

    def stage(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Stage b draft nodes' k, v (Hkv, b, D) after the others -> every committed and staged
        key and value (Hkv, P + staged, D), views."""
        end = self._write(k, v, self.length + self.staged)
        self.staged = end - self.length
        return self.k[:, :end], self.v[:, :end]

    def unstage(self) -> None:
        self.staged = 0

    def prefix(self, n: int) -> "EagleCache":
        """A new cache of a copy of the first ``n`` committed pairs: drafting from it leaves this
        one's pairs after ``n`` as they are."""
        out = EagleCache()
        if n:
            out.length = out._write(self.k[:, :n], self.v[:, :n], 0)
        return out


class _Attention(nn.Module):
    def __init__(self, c: EagleConfig):
        super().__init__()
        D = c.dims
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * D, bias=c.attention_bias)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * D, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * D, bias=c.attention_bias)
        self.o_proj = nn.Linear(c.num_attention_heads * D, c.hidden_size, bias=False)
        self.qkv: nn.Module | None = None  # q, k and v as one layer, for decoding (EagleModel.fuse_projections)


class _MLP(nn.Module):
    def __init__(self, c: EagleConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)
        self.gate_up: nn.Module | None = None  # gate and up as one layer, for decoding

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None:
            gate, up = self.gate_up(x).chunk(2, -1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, c: EagleConfig):
        super().__init__()
        self.self_attn = _Attention(c)
        self.mlp = _MLP(c)
        self.post_attention_layernorm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)


class EagleModel(DraftVocabulary, nn.Module):
    """The drafter (module docstring), sharing the target's frozen output layer ``lm_head`` and
    input embeddings ``embed`` (neither is a parameter nor saved)."""

    def __init__(self, config: EagleConfig, lm_head: nn.Module, embed: nn.Module):
        super().__init__()
        shape = layer_shape(lm_head)
        if shape != (config.vocab_size, config.hidden_size):
            raise ModelLoadError(f"the EAGLE drafter is shaped for a (V, H) = ({config.vocab_size}, "
                                 f"{config.hidden_size}) output layer, the target's is {shape}: it was trained for "
                                 f"another model ({config.base_model or 'unknown'})")
        embed_shape = layer_shape(embed)
        if embed_shape is None or embed_shape[1] != config.hidden_size:
            raise ModelLoadError(f"the EAGLE drafter needs the target's input embeddings (V, {config.hidden_size})")
        self.config = config
        H = config.hidden_size
        self.fc = nn.Linear(2 * H, H, bias=True)
        k = len(config.fused_layers)
        self.fuse = nn.Linear(k * H, H, bias=False) if k else None
        self.layers = nn.ModuleList([_Layer(config)])
        if config.draft_vocab:
            self.register_buffer("draft_vocab", torch.arange(config.draft_vocab, dtype=torch.long))
        else:
            self.draft_vocab = None
        if config.input_scale:
            self.register_buffer("input_scale", torch.ones(2 * H))
            self.register_buffer("fuse_scale", torch.ones(k * H) if k else None)
        else:
            self.input_scale = self.fuse_scale = None
        self._share_target(lm_head, embed)
        self.coarse_ranking = True
        self.register_buffer("inv_freq", config.rope_frequencies(), persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.layers[0].post_attention_layernorm.weight.dtype

    # ---- the pieces -------------------------------------------------------------------------
    def _inputs(self, hidden: torch.Tensor, tokens: torch.Tensor, drafted: bool = False) -> torch.Tensor:
        """hidden (..., W) committed pairs' target states [h ; g] or, ``drafted``, (..., H) drafted
        pairs' own features; tokens (...,) long -> u = fc([E[tokens]; h]) (+ fuse(g)) (..., H)
        (module docstring)."""
        H = self.config.hidden_size
        want = H if drafted else self.config.state_width
        if hidden.shape[-1] != want:
            what = "drafted pairs' own features" if drafted else \
                f"the target's states (the final one and those entering layers {list(self.config.fused_layers)})"
            raise ValueError(f"the EAGLE drafter reads {what} of width {want}, got {hidden.shape[-1]}")
        e = F.embedding(tokens, self.input_embeddings.weight.detach()).to(self.dtype)
        x = torch.cat([e, hidden[..., :H].to(self.dtype)], -1)
        u = self.fc(x if self.input_scale is None else x * self.input_scale.to(x.dtype))
        if self.fuse is not None and not drafted:
            g = hidden[..., H:].to(self.dtype)
            u = u + self.fuse(g if self.fuse_scale is None else g * self.fuse_scale.to(g.dtype))
        return u

    def _rotation(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE's cos and sin (n, D) at positions (n,) (rotate-half layout)."""
        ang = positions.to(torch.float32)[:, None] * self.inv_freq[None]  # (n, D/2)
        return tuple(torch.cat([f(ang)] * 2, -1).to(dtype) for f in (torch.cos, torch.sin))

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x (..., n, D) rotated by :meth:`_rotation`'s cos and sin (n, D)."""
        half = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin

    def _qkv(self, u: torch.Tensor, positions: torch.Tensor):
        """u (..., n, H) -> q (..., Hq, n, D), k and v (..., Hkv, n, D); q and k rotated."""
        c, attn = self.config, self.layers[0].self_attn
        D = c.dims
        if attn.qkv is not None:
            q, k, v = attn.qkv(u).split([c.num_attention_heads * D, c.num_key_value_heads * D,
                                         c.num_key_value_heads * D], -1)
        else:
            q, k, v = attn.q_proj(u), attn.k_proj(u), attn.v_proj(u)
        q = q.unflatten(-1, (c.num_attention_heads, D)).transpose(-3, -2)
        k = k.unflatten(-1, (c.num_key_value_heads, D)).transpose(-3, -2)
        v = v.unflatten(-1, (c.num_key_value_heads, D)).transpose(-3, -2)
        cos, sin = self._rotation(positions, u.dtype)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin), v

    @property
    def kv_dtype(self) -> torch.dtype:
        """The dtype decoding keeps keys and values in (:func:`grouped_attention`'s)."""
        return attention_dtype(self.dtype)

    def _rest(self, u: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """u (..., n, H), attention output o (..., Hq, n, D) -> the features (..., n, H)."""
        layer = self.layers[0]
        a = u + layer.self_attn.o_proj(o.transpose(-3, -2).flatten(-2))
        return a + layer.mlp(layer.post_attention_layernorm(a))

    # ---- training: whole sequences ----------------------------------------------------------
    def forward(self, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Teacher-forced: hidden (B, T, W) = h_0 .. h_{T-1}, tokens (B, T) = x_1 .. x_T ->
        features (B, T, H), row i approximating h_{i+1} (right padding is harmless: causal)."""
        u = self._inputs(hidden, tokens)
        q, k, v = self._qkv(u, torch.arange(u.shape[-2], device=u.device))
        return self._rest(u, F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))

    def unrolled(self, hidden: torch.Tensor, tokens: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Training-time test (after EAGLE-3): the teacher-forced pass, then ``steps`` - 1 passes
        that read the drafter's own features as drafting does. hidden (B, T, W) = h_0 .. h_{T-1};
        tokens (B, T + steps - 1) = x_1 .. x_{T+steps-1}. Returns [f^1, .., f^steps], each (B, T, H):
        f^s at row p is the s-th draft step from the committed pairs 0 .. p, its pair
        (f^{s-1}_p, x_{p+s}) at position p + s - 1 attending to the committed pairs 0 .. p, to its
        own earlier steps' pairs and to itself; f^s_p approximates h_{p+s} and predicts x_{p+s+1}.
        ``steps`` = 1 is :meth:`forward`."""
        T = hidden.shape[-2]
        pos = torch.arange(T, device=hidden.device)
        u = self._inputs(hidden, tokens[..., :T])
        q, k, v = self._qkv(u, pos)
        feats = [self._rest(u, F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))]
        keys, values = [k], [v]
        causal, eye = torch.ones(T, T, dtype=torch.bool).tril_(), torch.eye(T, dtype=torch.bool)
        for s in range(2, steps + 1):
            u = self._inputs(feats[-1], tokens[..., s - 1:s - 1 + T], drafted=True)
            q, k, v = self._qkv(u, pos + s - 1)
            keys.append(k), values.append(v)
            mask = torch.cat([causal] + [eye] * (s - 1), 1)  # (T, s T)
            o = F.scaled_dot_product_attention(q, torch.cat(keys, -2), torch.cat(values, -2), attn_mask=mask,
                                               enable_gqa=True)
            feats.append(self._rest(u, o))
        return feats

    # ---- decoding ---------------------------------------------------------------------------
    @torch.no_grad()
    def extend(self, cache: EagleCache, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Commit n pairs after ``cache.length``: hidden (n, W), tokens (n,) -> features (n, H)
        (what :meth:`forward` gives those rows)."""
        u = self._inputs(hidden, tokens)
        n, P = u.shape[0], cache.length
        q, k, v = self._qkv(u, torch.arange(P, P + n))
        kv = self.kv_dtype
        keys, values = cache.append(k.to(kv), v.to(kv))
        if P == 0 and n > 1:
            # a prompt's pairs: PyTorch's causal attention without a mask tensor, in the cache's
            # dtype, given a batch dimension (4-D inputs take its flash path, 3-D ones its
            # reference path): 48 ms at 1,500 pairs against 160 for either masked product
            o = F.scaled_dot_product_attention(q.to(kv)[None], keys[None], values[None], is_causal=True,
                                               enable_gqa=True)[0]
            return self._rest(u, o.to(q.dtype))
        mask = torch.ones(n, P + n, dtype=torch.bool).tril_(P)
        return self._rest(u, grouped_attention(q, keys, values, mask))

    @torch.no_grad()
    def extend_last(self, cache: EagleCache, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Commit n pairs as :meth:`extend` (the same keys and values), computing the feature of the
        last one alone (H,): the others' attention and MLP are skipped, since only the next root's
        feature is read. A prompt's pairs: its attention is one row instead of n, its MLP one row
        instead of n (at 3,000 pairs most of the work of :meth:`extend`)."""
        u = self._inputs(hidden, tokens)
        n, P = u.shape[0], cache.length
        q, k, v = self._qkv(u, torch.arange(P, P + n))
        kv = self.kv_dtype
        keys, values = cache.append(k.to(kv), v.to(kv))
        o = grouped_attention(q[..., -1:, :], keys, values, torch.ones(1, P + n, dtype=torch.bool))
        return self._rest(u[-1:], o)[0]

    @torch.no_grad()
    def tree_step(self, cache: EagleCache, sees: torch.Tensor | None, state: torch.Tensor, tokens: torch.Tensor,
                  positions: torch.Tensor) -> torch.Tensor:
        """b draft nodes at once: each node's pair (its parent's feature ``state`` (b, H), its token
        ``tokens`` (b,)) at ``positions`` (b,), attending to every committed pair, to the E nodes
        staged in ``cache`` that it ``sees`` ((b, E) bool: its ancestors; None when E = 0), and to
        itself. The nodes are staged after the others (the next ones can see them). Returns their
        features (b, H)."""
        u = self._inputs(state, tokens, drafted=True)
        b, P, E = u.shape[0], cache.length, cache.staged
        if (0 if sees is None else sees.shape[1]) != E:
            raise ValueError(f"sees must say which of the {E} staged nodes each new node sees, got "
                             f"{None if sees is None else tuple(sees.shape)}")
        q, k, v = self._qkv(u, positions)
        kv = self.kv_dtype
        keys, values = cache.stage(k.to(kv), v.to(kv))
        masks = [torch.ones(b, P, dtype=torch.bool)] + ([sees] if E else []) + [torch.eye(b, dtype=torch.bool)]
        return self._rest(u, grouped_attention(q, keys, values, torch.cat(masks, 1)))

    @torch.no_grad()
    def init_for_training(self, features: torch.Tensor, seed: int = 0) -> None:
        """Start as "the next feature is this one, plus the token", given a sample of the target's
        states (n, W): fc = [W_e, I] with W_e random at a scale that gives the token term the
        features' RMS (the embeddings are ~100x smaller than the features, so at the default scale
        the token would hardly count), zero bias, and the attention's and MLP's output projections
        zero (the layer starts as the identity). With ``config.input_scale`` the stored scale is
        set from the embeddings and ``features`` and fc's identity block undoes the features'."""
        H = self.config.hidden_size
        g = torch.Generator().manual_seed(seed)
        feats = features.detach().float()
        feature_rms = float(feats.pow(2).mean().sqrt())
        embed = self.input_embeddings.weight.detach().float()
        self.fc.weight.zero_()
        self.fc.bias.zero_()
        if self.input_scale is not None:
            unit_h = feats.pow(2).mean(0).sqrt().clamp(min=1e-3)  # (H,)
            unit_e = embed.pow(2).mean(0).sqrt().clamp(min=1e-6)
            self.input_scale.copy_(torch.cat([1 / unit_e, 1 / unit_h]))
            self.fc.weight[:, H:] = torch.diag(unit_h)
            self.fc.weight[:, :H] = torch.randn(H, H, generator=g) * (feature_rms / H ** 0.5)
        else:
            e_rms = float(embed.pow(2).mean().sqrt())
            self.fc.weight[:, H:] = torch.eye(H, dtype=self.fc.weight.dtype)
            self.fc.weight[:, :H] = torch.randn(H, H, generator=g) * (feature_rms / (max(e_rms, 1e-12) * H ** 0.5))
        self.layers[0].self_attn.o_proj.weight.zero_()
        self.layers[0].mlp.down_proj.weight.zero_()

    @torch.no_grad()
    def init_fusion(self, states: torch.Tensor) -> None:
        """``fuse`` zero (the drafter computes what it did without the fused layers) and, with
        ``config.input_scale``, ``fuse_scale`` 1 / each tapped unit's RMS over ``states`` (n, W)."""
        H = self.config.hidden_size
        self.fuse.weight.zero_()
        if self.fuse_scale is not None:
            self.fuse_scale.copy_(1 / states.detach()[:, H:].float().pow(2).mean(0).sqrt().clamp(min=1e-3))

    def fuse_projections(self, join) -> bool:
        """For decoding: q, k and v run as one layer, and gate and up as one, where ``join`` (a list
        of layers -> one layer computing them side by side with the same bits, or None:
        ``runtime.quant.joined``) can join them: fewer, larger calls for the few rows a drafting step has.
        Returns whether both were joined."""
        attn, mlp = self.layers[0].self_attn, self.layers[0].mlp
        attn.qkv = join([attn.q_proj, attn.k_proj, attn.v_proj])
        mlp.gate_up = join([mlp.gate_proj, mlp.up_proj])
        return attn.qkv is not None and mlp.gate_up is not None

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        self.load_state_dict(state)
