"""The EAGLE drafter written for other engines: EAGLE-1 draft models as vLLM and SGLang load them.

Both engines read a transformers Llama config and one safetensors file of the decoder layer's
tensors (names as speculant's, see ``model.py``; shapes H hidden, Hq / Hkv heads of D dims,
F the MLP width):

    fc.weight                                      (H, 2H)  over [E[x_{i+1}] ; h_i], in that order
    fc.bias                                        (H,)     sglang only
    layers.0.self_attn.{q,k,v}_proj.weight         (Hq·D, H), (Hkv·D, H), (Hkv·D, H)
    layers.0.self_attn.{q,k,v,o}_proj.bias         with "attention_bias": true
    layers.0.self_attn.o_proj.weight               (H, Hq·D)
    layers.0.mlp.{gate,up}_proj.weight             (F, H);  layers.0.mlp.down_proj.weight (H, F)
    layers.0.post_attention_layernorm.weight       (H,)

No ``input_layernorm`` (both engines drop it from the first layer, as EAGLE does), no final norm,
no ``embed_tokens`` and no ``lm_head``: the engines share the target's. Neither engine tolerates
tensors it has no parameter for, so nothing else is written.

``vllm``: ``EagleLlamaForCausalLM`` (vllm/model_executor/models/llama_eagle.py), reached through
``"architectures": ["LlamaForCausalLM"]`` and ``speculative_config={"method": "eagle", ...}``. Its
``fc`` has no bias, so speculant's is folded into the attention's biases, exactly: with u = W x
and b the fc bias, W_q (u + b) + b_q = W_q u + (b_q + W_q b) (k and v alike), and b reaches the
residual stream through o_proj's bias. Hence ``attention_bias`` is always on there.

``sglang``: ``LlamaForCausalLMEagle`` (python/sglang/srt/models/llama_eagle.py), whose ``fc`` has
a bias. Its Llama attention has one bias switch for q, k, v and o, so a drafter with q/k/v biases
(a Qwen2 target) gets a zero o_proj bias.

The draft vocabulary (FR-Spec, ``draft_vocab`` ids): EAGLE-1 readers project through the target's
whole output layer, so the drafter proposes from every token there; it still works, since it is
trained to regress the target's features, which the output layer ranks. For SGLang the ids are
also written as ``token_map.pt`` (its ``--speculative-token-map`` file); vLLM has no counterpart.

EAGLE-3 (``LlamaForCausalLMEagle3``: fc (H, 3H) over three fused target layers, a decoder layer
reading [norm(embedding) ; norm(feature)] (2H), its own output layer) cannot hold this drafter
and is refused. The directory is written under a temporary name and renamed when complete.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from ..errors import ConfigError, ModelLoadError
from ..heads.export import write_export_dir
from .checkpoint import is_eagle_dir, load_eagle
from .model import EagleConfig, EagleModel

__all__ = ["ARCHITECTURES", "DEFAULT_MAX_POSITIONS", "EXPORT_FORMATS", "TOKEN_MAP_NAME", "export_eagle",
           "load_for_export"]

EXPORT_FORMATS = ("vllm", "sglang", "eagle3")
ARCHITECTURES = {"vllm": "LlamaForCausalLM", "sglang": "LlamaForCausalLMEagle"}
DEFAULT_MAX_POSITIONS = 131072  # RoPE table length when the target's is unknown: long enough for any context
TOKEN_MAP_NAME = "token_map.pt"
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_ATTN = "layers.0.self_attn."


def _tensors(model: EagleModel, fmt: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The drafter's tensors in ``fmt``'s layout (module docstring), folded in float64."""
    c = model.config
    state = {k: t.detach().to("cpu", torch.float64) for k, t in model.state_dict().items() if k != "draft_vocab"}
    if "input_scale" in state:  # fc(x * s) = (W diag(s)) x + b: the scale folded into fc, exactly
        state["fc.weight"] = state["fc.weight"] * state.pop("input_scale")[None]
    if fmt == "vllm" or c.attention_bias:
        for p in "qkv":
            weight = state[f"{_ATTN}{p}_proj.weight"]
            state.setdefault(f"{_ATTN}{p}_proj.bias", weight.new_zeros(weight.shape[0]))
        state[f"{_ATTN}o_proj.bias"] = state["fc.bias"].new_zeros(c.hidden_size)
    if fmt == "vllm":
        b = state.pop("fc.bias")
        for p in "qkv":
            state[f"{_ATTN}{p}_proj.bias"] += state[f"{_ATTN}{p}_proj.weight"] @ b
        state[f"{_ATTN}o_proj.bias"] += b
    return {k: t.to(dtype).contiguous() for k, t in sorted(state.items())}


def _target_facts(base_model: str, c: EagleConfig) -> int | None:
    """The target's max_position_embeddings when ``base_model`` is a transformers directory (its
    geometry checked against the drafter's), else None."""
    path = Path(base_model) / "config.json" if base_model else None
    if path is None or not path.is_file():
        return None
    try:
        cfg = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read the target's config {path}: {e}") from None
    cfg = cfg.get("text_config") or cfg
    if cfg.get("hidden_size") not in (None, c.hidden_size):
        raise ConfigError(f"the drafter has hidden size {c.hidden_size} but {base_model} has {cfg['hidden_size']}: "
                          "it was trained for another model; pass the target it was trained for")
    return cfg.get("max_position_embeddings")


def _config(c: EagleConfig, fmt: str, base_model: str, dtype: torch.dtype, positions: int) -> dict:
    """A transformers LlamaConfig (one layer, the target's geometry) for ``fmt``."""
    rope = {"rope_type": "default", "rope_theta": c.rope_theta}
    return {"architectures": [ARCHITECTURES[fmt]], "model_type": "llama", "hidden_size": c.hidden_size,
            "intermediate_size": c.intermediate_size, "num_hidden_layers": 1,
            "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
            "head_dim": c.dims, "hidden_act": "silu", "rms_norm_eps": c.rms_norm_eps, "vocab_size": c.vocab_size,
            "max_position_embeddings": positions, "rope_theta": c.rope_theta, "rope_scaling": None,
            "rope_parameters": rope, "attention_bias": fmt == "vllm" or c.attention_bias, "mlp_bias": False,
            "tie_word_embeddings": False, "torch_dtype": str(dtype).removeprefix("torch."),
            "base_model_name_or_path": base_model,
            "speculant_export": {"format": fmt, "trained_depth": c.depth, "draft_vocab": c.draft_vocab}}


def _readme(c: EagleConfig, fmt: str, base_model: str, token_map: bool) -> str:
    base = base_model or "TARGET"
    engine = "vLLM" if fmt == "vllm" else "SGLang (without the token map below)"
    vocab = (f"The drafter was trained to propose from {c.draft_vocab} tokens only (FR-Spec). {engine} projects "
             "through the target's whole output layer, so it may propose any token; the drafter still works, "
             "since it predicts the target's next hidden state, which that output layer ranks.\n\n"
             if c.draft_vocab else "")
    if fmt == "vllm":
        how = ("```python\nfrom vllm import LLM\n\n"
               f'llm = LLM(model="{base}", speculative_config={{"method": "eagle", "model": "DIR", '
               f'"num_speculative_tokens": {c.depth}}})\n```\n\n'
               "The fc bias of speculant's drafter is folded into the attention's biases (vLLM's EAGLE fc has "
               "none): the same function, exactly.\n")
    else:
        extra = f" \\\n    --speculative-token-map DIR/{TOKEN_MAP_NAME}" if token_map else ""
        how = ("```\npython -m sglang.launch_server --model-path " + base + " \\\n"
               "    --speculative-algorithm EAGLE --speculative-draft-model-path DIR \\\n"
               f"    --speculative-num-steps {c.depth} --speculative-eagle-topk 8 --speculative-num-draft-tokens 32"
               f"{extra}\n```\n")
        if token_map:
            vocab += (f"`{TOKEN_MAP_NAME}` lists those {c.draft_vocab} token ids; with `--speculative-token-map` "
                      "SGLang drafts from them only, as speculant does.\n\n")
    return (f"# EAGLE drafter for {base}\n\nAn EAGLE-1 draft model written by speculant (`speculant export-eagle "
            f"--format {fmt}`): one decoder layer over the target's last hidden state and the next token, sharing "
            f"the target's embeddings and output layer. It was trained for drafts up to {c.depth} tokens deep. "
            f"Replace DIR with this directory.\n\n{how}\n{vocab}").rstrip() + "\n"


def export_eagle(model: EagleModel, out: str | Path, fmt: str = "vllm", base_model: str = "",
                 dtype: torch.dtype = torch.bfloat16, max_position_embeddings: int = 0) -> Path:
    """Write the drafter ``model`` to the new directory ``out`` as ``fmt`` (``vllm`` or ``sglang``,
    module docstring): config.json, model.safetensors, README.md (and for SGLang with a draft
    vocabulary token_map.pt). ``base_model``: the target's transformers directory or hub id,
    recorded (and, if a local directory, read for its context length);
    ``max_position_embeddings``: 0 = the target's, else DEFAULT_MAX_POSITIONS. Returns ``out``."""
    from safetensors.torch import save_file

    if fmt == "eagle3":
        raise ConfigError("an EAGLE-3 export is not possible: this drafter reads one feature (the target's last "
                          "hidden state) through fc (H, 2H) over [embedding ; feature], while EAGLE-3 readers "
                          "expect fc (H, 3H) fusing three target layers and a layer reading [norm(embedding) ; "
                          "norm(feature)] with its own output layer; export with --format vllm or sglang (EAGLE-1, "
                          "the engines' method \"eagle\")")
    if fmt not in EXPORT_FORMATS:
        raise ConfigError(f"unknown export format {fmt!r}: choose vllm or sglang")
    if not isinstance(model, EagleModel):
        raise ConfigError(f"only an EAGLE drafter (EagleModel) can be exported this way, got {type(model).__name__}; "
                          "Medusa heads are exported with speculant export-heads")
    if model.config.fused_layers:
        raise ConfigError(f"this drafter also reads the target's states entering layers "
                          f"{list(model.config.fused_layers)} (speculant's fusion, fc over [embedding ; feature] "
                          "plus a projection of those states), which neither the EAGLE-1 layouts of vLLM and SGLang "
                          "nor EAGLE-3's carry: export a drafter trained without --fuse-layers")
    if dtype not in DTYPES:
        raise ConfigError(f"unsupported dtype {dtype}: use torch.float16, torch.bfloat16 or torch.float32")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out} exists and is not an empty directory: choose a new directory for the export")
    c = model.config
    positions = max_position_embeddings or _target_facts(base_model, c) or DEFAULT_MAX_POSITIONS
    tensors = _tensors(model, fmt, dtype)
    token_map = fmt == "sglang" and model.draft_vocab is not None

    def write(tmp: Path) -> None:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(_config(c, fmt, base_model, dtype, positions), indent=2) + "\n")
        (tmp / "README.md").write_text(_readme(c, fmt, base_model, token_map))
        if token_map:
            torch.save(model.draft_vocab.tolist(), tmp / TOKEN_MAP_NAME)

    return write_export_dir(out, write)


class _SharedLayers:
    """Stand-ins (meta device, no memory) for the target's output layer and embeddings, which a
    drafter shares but an export never writes."""

    def __init__(self, c: EagleConfig):
        with torch.device("meta"):
            self._head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
            self._embed = nn.Embedding(c.vocab_size, c.hidden_size)

    def get_output_embeddings(self) -> nn.Module:
        return self._head

    def get_input_embeddings(self) -> nn.Module:
        return self._embed


def load_for_export(path: str | Path) -> EagleModel:
    """The drafter saved at ``path`` (``save_eagle``), without its target: float32 weights of its
    own, enough to export (not to run: the shared layers are placeholders)."""
    directory = Path(path)
    if not is_eagle_dir(directory):
        raise ModelLoadError(f"no EAGLE drafter at {path}: expected a directory with config.json and "
                             "model.safetensors written by speculant train-eagle")
    try:
        config = EagleConfig.from_json(json.loads((directory / "config.json").read_text()))
    except (ConfigError, TypeError) as e:
        raise ModelLoadError(f"{directory / 'config.json'} is invalid: {e}") from None
    return load_eagle(directory, _SharedLayers(config), dtype=torch.float32)
