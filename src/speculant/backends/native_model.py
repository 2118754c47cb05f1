"""The weights of a causal LM of the native runtime's families (``native_arch``) for ``native.NativeBackend``.

``NativeModel`` holds the weights and architecture constants: ``from_hf`` shares the tensors of a
loaded transformers model (no copy), ``from_dir`` reads a transformers safetensors directory tensor
by tensor (quantizing as it goes, so a quantized model never has its dense weights resident all at
once). Quantized linears are ``speculant.runtime.quant`` Int8Linear / Int4Linear; where q/k/v (and
gate/up) are int4 layers of speculant's kernels they are also joined into one layer each.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError, ModelLoadError
from ..runtime.packing import unpack_linears
from ..runtime.quant import QUANT_MODES, Int4Linear, joined, quantize_linear
from .native_arch import SUPPORTED, Arch, arch_for, layer_plan  # noqa: F401 (SUPPORTED re-exported)

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def block_norms(arch: Arch, weight) -> dict[str, torch.Tensor | None]:
    """A layer's norm weights as NativeBlock takes them, ``weight(name)`` giving the checkpoint's
    tensor of that layer (``input_layernorm``, ``self_attn.q_norm``, ...) or None: Gemma's
    (1 + w) folded in, and Gemma 3's query scale folded into the query norm (Gemma 2 has none:
    its attention takes the scale, ``Arch.attn_scale``)."""
    def w(name: str, scale: float = 1.0) -> torch.Tensor | None:
        t = weight(name)
        if t is None or (not arch.norm_offset and scale == 1.0):
            return t
        return ((t.float() + arch.norm_offset) * scale).to(t.dtype)

    if arch.q_scale != 1.0 and weight("self_attn.q_norm") is None:
        raise ConfigError("a query scale other than 1/sqrt(head_dim) needs q/k norms to fold it into")
    if arch.sandwich:
        return {"in_norm": w("input_layernorm"), "post_norm": w("pre_feedforward_layernorm"),
                "attn_out_norm": w("post_attention_layernorm"), "ffn_out_norm": w("post_feedforward_layernorm"),
                "q_norm": w("self_attn.q_norm", arch.q_scale), "k_norm": w("self_attn.k_norm")}
    return {"in_norm": w("input_layernorm"), "post_norm": w("post_attention_layernorm"),
            "q_norm": w("self_attn.q_norm"), "k_norm": w("self_attn.k_norm")}


def final_norm(arch: Arch, t: torch.Tensor) -> torch.Tensor:
    return ((t.float() + arch.norm_offset).to(t.dtype)) if arch.norm_offset else t


def split_linear(lin: nn.Linear, widths: tuple[int, ...]) -> list[nn.Linear]:
    """``lin`` (dense, out = sum of ``widths``) as one linear per block of its output rows, each
    sharing its rows of the weight (and bias): Phi-3's fused ``qkv_proj`` / ``gate_up_proj``."""
    out, at = [], 0
    for w in widths:
        part = nn.Linear(lin.in_features, w, bias=lin.bias is not None, device="meta")
        part.weight = nn.Parameter(lin.weight[at:at + w], requires_grad=False)
        if lin.bias is not None:
            part.bias = nn.Parameter(lin.bias[at:at + w], requires_grad=False)
        out.append(part)
        at += w
    return out


def _fused_widths(cfg) -> tuple[tuple[int, int, int], tuple[int, int]]:
    """The output widths of a fused q/k/v and of a fused gate/up projection of ``cfg``."""
    heads, kv = cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return (heads * D, kv * D, kv * D), (cfg.intermediate_size, cfg.intermediate_size)


class NativeBlock(nn.Module):
    """One decoder layer's weights (modules and tensors shared with their source).

    Where q/k/v (and gate/up) are int4 layers of one of speculant's kernels without dense weights,
    they are also joined into one layer each (``qkv``, ``gate_up``): one kernel call instead of three
    (two), the activations quantized once, the same bits (every output channel is computed on its
    own)."""

    def __init__(self, in_norm: torch.Tensor, post_norm: torch.Tensor, proj: dict[str, nn.Module],
                 qkv: nn.Module | None = None, gate_up: nn.Module | None = None,
                 q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                 attn_out_norm: torch.Tensor | None = None, ffn_out_norm: torch.Tensor | None = None):
        """``qkv`` / ``gate_up``: the joined layers when the caller has them (``proj``'s are then
        views of them); else they are joined here where possible. ``q_norm`` / ``k_norm`` (D,):
        RMSNorm weights applied to each head's query / key before RoPE (Qwen3, Gemma 3), or None;
        ``attn_out_norm`` / ``ffn_out_norm`` (H,): norms of the attention's and the MLP's outputs
        before their residual adds (Gemma 2 and 3's sandwich), or None. ``in_norm`` is the attention's
        input norm, ``post_norm`` the MLP's."""
        super().__init__()
        self.in_norm, self.post_norm = in_norm, post_norm  # (H,) each
        self.q_norm, self.k_norm = q_norm, k_norm
        self.attn_out_norm, self.ffn_out_norm = attn_out_norm, ffn_out_norm
        for name in PROJECTIONS:
            setattr(self, name, proj[name])
        self.qkv = qkv if qkv is not None else joined([proj["q_proj"], proj["k_proj"], proj["v_proj"]])
        self.gate_up = gate_up if gate_up is not None else joined([proj["gate_proj"], proj["up_proj"]])
        self.widths = (proj["q_proj"].out_features, proj["k_proj"].out_features, proj["v_proj"].out_features)

    def project_qkv(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.qkv is None:
            return self.q_proj(h), self.k_proj(h), self.v_proj(h)
        return self.qkv(h).split(self.widths, dim=-1)

    def mlp(self, h: torch.Tensor, gelu: bool = False) -> torch.Tensor:
        """down(act(gate(h)) * up(h)), act SiLU or (``gelu``) GELU-tanh."""
        if self.gate_up is None:
            gate, up = self.gate_proj(h), self.up_proj(h)
        else:
            gate, up = self.gate_up(h).chunk(2, dim=-1)
        return self.down_proj((F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)) * up)


class NativeModel(nn.Module):
    """Weights + architecture constants of a causal LM of ``native_arch``'s families, for NativeBackend.

    ``config`` and ``generation_config`` are the transformers ones; ``get_output_embeddings()``
    returns the output layer (so heads sharing it and ``LoadedModel.logits_dim`` work as with a
    transformers model).
    """

    def __init__(self, config, embed: torch.Tensor, blocks: list[NativeBlock], norm: torch.Tensor,
                 lm_head: nn.Module, generation_config=None, quant: str = "none"):
        super().__init__()
        arch_for(config)
        self.config, self.generation_config, self.quant = config, generation_config, quant
        self.embed = embed  # (V_in, H)
        self.blocks = nn.ModuleList(blocks)
        self.norm = norm  # (H,)
        self.lm_head = lm_head  # (V, H) linear, dense or quantized
        self.dtype = embed.dtype
        self.hidden = config.hidden_size
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(config, "head_dim", None) or self.hidden // self.heads
        self.eps = float(config.rms_norm_eps)
        self.arch = arch_for(config)
        # the distinct RoPEs, each layer's among them, each layer's sliding window (0: none)
        self.ropes, self.layer_rope, self.windows = layer_plan(config, self.head_dim)
        # positions past this are refused (0: none): a RoPE fixed at its original context's
        # frequencies, beyond which the native backend would not compute what the reference does
        limits = [r.max_context for r in self.ropes if r.max_context]
        self.max_context = min(limits) if limits else 0
        self.vocab_size = lm_head.out_features
        # speculant's x86 kernels (bf16 norms, RoPE, attention) take head dims that are multiples of 16 up
        # to 256, 1 to 8 query heads per kv head and widths that are multiples of 16; others run on PyTorch
        width = getattr(config, "intermediate_size", None) or 0
        g = self.heads // self.kv_heads
        self.kernel_shapes = (self.head_dim % 16 == 0 and self.head_dim <= 256 and 1 <= g <= 8
                              and self.hidden % 16 == 0 and width % 16 == 0)

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def get_input_embeddings(self) -> nn.Module:
        """The input embeddings as an ``nn.Embedding`` sharing ``embed`` (read by sequential heads)."""
        return nn.Embedding(*self.embed.shape, _weight=self.embed, _freeze=True)

    # ---------------------------------------------------------------- construction

    @classmethod
    def from_hf(cls, model: nn.Module, quant: str = "none", quant_head: bool = False,
                keep_dense: bool = True, group_size: int = 64) -> "NativeModel":
        """Share the weights of a transformers ``LlamaForCausalLM`` / ``Qwen2ForCausalLM``.

        quant: weight-only quantization of every decoder linear (and the output layer with
        ``quant_head``); the quantized copies are new, the dense tensors stay shared.
        keep_dense: quantized layers keep (a reference to) the dense weight for inputs of many
        rows; it costs nothing here, the transformers model holds it anyway.
        """
        unpack_linears(model)  # plain nn.Linear weights to share (a no-op unless an HFBackend packed them)
        cfg = model.config.get_text_config()
        arch = arch_for(cfg)
        _check_quant(quant, next(model.parameters()).dtype)
        decoder = model.get_decoder()

        def q(lin):
            return lin if quant == "none" else quantize_linear(lin, quant, group_size, keep_dense)

        blocks = []
        qkv_widths, gu_widths = _fused_widths(cfg)
        for layer in decoder.layers:
            attn, mlp = layer.self_attn, layer.mlp
            if hasattr(attn, "qkv_proj"):  # Phi-3: q/k/v and gate/up fused in the checkpoint
                parts = dict(zip(("q_proj", "k_proj", "v_proj"), split_linear(attn.qkv_proj, qkv_widths)))
                parts.update(zip(("gate_proj", "up_proj"), split_linear(mlp.gate_up_proj, gu_widths)))
                parts.update(o_proj=attn.o_proj, down_proj=mlp.down_proj)
                proj = {n: q(parts[n]) for n in PROJECTIONS}
            else:
                proj = {n: q(getattr(attn if n.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else mlp, n))
                        for n in PROJECTIONS}
            def weight(name: str, layer=layer) -> torch.Tensor | None:
                mod = layer
                for part in name.split("."):
                    mod = getattr(mod, part, None)
                return None if mod is None else mod.weight

            norms = block_norms(arch, weight)
            blocks.append(NativeBlock(norms.pop("in_norm"), norms.pop("post_norm"), proj, **norms))
        head = model.get_output_embeddings()
        head = q(head) if quant_head else head
        return cls(cfg, decoder.embed_tokens.weight, blocks, final_norm(arch, decoder.norm.weight), head,
                   getattr(model, "generation_config", None), quant)

    @classmethod
    def from_dir(cls, path: str | Path, dtype: torch.dtype = torch.bfloat16, quant: str = "none",
                 quant_head: bool = False, group_size: int = 64, keep_dense: bool = False) -> "NativeModel":
        """Read a transformers model directory (config.json + *.safetensors) tensor by tensor.

        With ``quant``, each linear is quantized right after it is read and, unless
        ``keep_dense``, its dense weight dropped (inputs of many rows then dequantize per call),
        so the peak memory is the quantized model plus one dense tensor.
        """
        from safetensors import safe_open

        path = Path(path)
        _check_quant(quant, dtype)
        cfg, gen, files = read_dir_config(path)
        where: dict[str, Path] = {}  # tensor name -> file
        for f in files:
            try:
                with safe_open(str(path / f), framework="pt") as h:
                    where.update(dict.fromkeys(h.keys(), path / f))
            except Exception as e:  # safetensors raises its own error types
                raise ModelLoadError(f"cannot read the weights file {path / f} ({type(e).__name__}: {e}): "
                                     "it is damaged "
                                     "or incomplete; if it is in speculant's cache, delete its directory to have the "
                                     "model converted again") from e
        prefix = "model." if any(k.startswith("model.layers.") for k in where) else ""

        kind = int4_layout(group_size) if quant == "int4" and not keep_dense else None
        if kind is None:
            return cls._read_dir(path, files, where, prefix, cfg, gen, dtype, quant, quant_head, group_size, keep_dense)
        from ..runtime.process import file_lock, release_memory
        from .native_store import load_store, remove_partial_saves, save_store, store_path

        store = store_path(path, [path / f for f in files], quant_head, kind, group_size)
        model = load_store(store, cfg, gen, dtype)
        if model is not None:
            return model
        with file_lock(store.with_name(store.name + ".lock")):
            model = load_store(store, cfg, gen, dtype, quiet=True)  # made by another process meanwhile?
            if model is not None:
                return model
            remove_partial_saves(store)
            print(f"speculant: quantizing {path.name} to int4 once for this machine's kernel ({kind}); "
                  f"saved to {store}", file=sys.stderr, flush=True)
            model = cls._read_dir(path, files, where, prefix, cfg, gen, dtype, quant, quant_head, group_size,
                                  keep_dense)
            if all(b.qkv is not None and b.gate_up is not None for b in model.blocks):
                try:
                    save_store(model, store, kind, group_size, quant_head)
                except OSError as e:
                    print(f"speculant: could not save the int4 model ({e}); it will be quantized again next time",
                          file=sys.stderr, flush=True)
                    return model
                del model  # read it back: the embedding mapped, not resident
                release_memory()
                return load_store(store, cfg, gen, dtype)
            return model

    @classmethod
    def _read_dir(cls, path: Path, files: list[str], where: dict, prefix: str, cfg, gen, dtype: torch.dtype,
                  quant: str, quant_head: bool, group_size: int, keep_dense: bool) -> "NativeModel":
        """from_dir's reading and quantizing, tensor by tensor."""
        from safetensors import safe_open

        from ..runtime.process import release_memory

        def get(name: str, copy: bool = True) -> torch.Tensor:
            if name not in where:
                raise ModelLoadError(f"{path} lacks the tensor {name!r}")
            # the file is mapped for this one tensor only (a mapping held open would count every
            # page read so far in RSS), and the tensor is a private copy, not a view of the map;
            # with copy=False it is the mapping itself (its pages read when touched)
            with safe_open(str(where[name]), framework="pt") as h:
                t = h.get_tensor(name)
            return t.to(dtype) if t.dtype != dtype else t.clone() if copy else t

        def linear(name: str, do_quant: bool) -> nn.Module:
            b = get(name + ".bias") if name + ".bias" in where else None
            if do_quant and quant == "int4" and not keep_dense and int4_layout(group_size) is not None:
                with safe_open(str(where[name + ".weight"]), framework="pt") as h:
                    sl = h.get_slice(name + ".weight")
                    n, k = sl.get_shape()
                    if n > 8192 and n % 16 == 0 and b is None:  # a large output layer: 4,096 rows at a time,
                        parts = []                               # never the whole dense matrix in memory
                        for r in range(0, n, 4096):
                            lin = nn.Linear(k, min(4096, n - r), bias=False, device="meta")
                            lin.weight = nn.Parameter(sl[r:r + 4096].to(dtype), requires_grad=False)
                            parts.append(quantize_linear(lin, quant, group_size, keep_dense=False))
                        return Int4Linear.concat(parts)
            w = get(name + ".weight")
            lin = nn.Linear(w.shape[1], w.shape[0], bias=b is not None, device="meta")
            lin.weight = nn.Parameter(w, requires_grad=False)
            if b is not None:
                lin.bias = nn.Parameter(b, requires_grad=False)
            if do_quant and quant != "none":
                return quantize_linear(lin, quant, group_size, keep_dense=keep_dense)
            return lin

        def split(name: str, names: tuple[str, ...], widths: tuple[int, ...]) -> dict[str, nn.Module]:
            dense = split_linear(linear(name, False), widths)
            return {n: quantize_linear(d, quant, group_size, keep_dense=keep_dense) if quant != "none" else d
                    for n, d in zip(names, dense)}

        arch = arch_for(cfg)
        qkv_widths, gu_widths = _fused_widths(cfg)
        blocks = []
        for i in range(cfg.num_hidden_layers):
            p = f"{prefix}layers.{i}."
            if p + "self_attn.qkv_proj.weight" in where:  # Phi-3: fused in the checkpoint
                proj = {**split(p + "self_attn.qkv_proj", ("q_proj", "k_proj", "v_proj"), qkv_widths),
                        **split(p + "mlp.gate_up_proj", ("gate_proj", "up_proj"), gu_widths),
                        "o_proj": linear(p + "self_attn.o_proj", True), "down_proj": linear(p + "mlp.down_proj", True)}
            else:
                proj = {n: linear(p + ("self_attn." if n in PROJECTIONS[:4] else "mlp.") + n, True)
                        for n in PROJECTIONS}
            norms = block_norms(arch, lambda name, p=p: get(p + name + ".weight")
                                if p + name + ".weight" in where else None)
            blocks.append(NativeBlock(norms.pop("in_norm"), norms.pop("post_norm"), proj, **norms))
            if quant != "none":
                release_memory()  # the layer's dense weights and quantizing temporaries, freed: give them back
        untied = "lm_head.weight" in where and not getattr(cfg, "tie_word_embeddings", False)
        head = linear("lm_head", quant_head) if untied else None  # before the embedding: a lower peak
        # a quantized model's embedding: the mapped tensor, not a second copy of 0.5 GB (1.5B model)
        embed = get(f"{prefix}embed_tokens.weight", copy=quant == "none")
        if head is None:  # tied: the output layer is the embedding matrix
            head = nn.Linear(embed.shape[1], embed.shape[0], bias=False, device="meta")
            head.weight = nn.Parameter(embed, requires_grad=False)
            if quant_head and quant != "none":
                head = quantize_linear(head, quant, group_size, keep_dense=True)  # embed stays anyway
        norm = final_norm(arch, get(f"{prefix}norm.weight"))
        model = cls(cfg, embed, blocks, norm, head, gen, quant)
        model.requires_grad_(False)
        return model.eval()


def read_dir_config(path: Path) -> tuple:
    """(the text config, the generation config or None, the safetensors weight files' names) of
    the transformers model directory ``path``; a clear error where it has no readable config of a
    supported family, or no weights."""
    from transformers import AutoConfig, GenerationConfig

    try:
        cfg = AutoConfig.from_pretrained(str(path)).get_text_config()
    except Exception as e:
        raise ModelLoadError(f"cannot read the config of {path}: {type(e).__name__}: {e}") from e
    arch_for(cfg)
    try:
        gen = GenerationConfig.from_pretrained(str(path))
    except Exception:  # noqa: BLE001 -- a missing or unreadable generation_config.json: the defaults
        gen = None
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = [p.name for p in sorted(path.glob("*.safetensors"))]
    if not files:
        raise ModelLoadError(f"no safetensors weights in {path}")
    return cfg, gen, files


def int4_layout(group_size: int) -> str | None:
    """The packed layout int4 layers get here: "x86" (speculant's kernel), else None."""
    from ..kernels import int4_isa

    if group_size != 64:
        return None
    return "x86" if int4_isa() is not None else None


def _check_quant(quant: str, dtype: torch.dtype) -> None:
    if quant not in QUANT_MODES:
        raise ConfigError(f"unknown quantization {quant!r}: choose one of {', '.join(QUANT_MODES)}")
    if quant == "int4" and dtype != torch.bfloat16:
        raise ConfigError("int4 weights need a bfloat16 model: load it with dtype='bfloat16'")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float32, scaled in the model dtype (as transformers' Llama / Qwen2 do; Gemma's
    (1 + w) is folded into its weights when they are read)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE. x (n, heads, D); cos, sin (n, 1, D) in x's dtype."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
