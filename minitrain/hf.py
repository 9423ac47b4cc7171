"""Hugging Face's GPT-2 layout in and out (Llama's and Qwen3's for the modern block, below): `config.json` +
`model.safetensors` <-> minitrain's GPT.

The two models compute the same function: pre-LayerNorm blocks (eps 1e-5), the tanh GELU (`gelu_new`),
attention scaled by 1/sqrt(head size), learned positions, the head tied to the token embedding. Only the
layout differs: transformers keeps the four projections of a block as `Conv1D`, whose weight is (in, out),
the transpose of nn.Linear's (out, in); the blocks are `h.<i>` there, `blocks.<i>` here.

In: `model.init_from=gpt2` (a hub name, read from the hub's cache when offline) or a local directory. The
shape comes from config.json (`settle_shape`); the embedding keeps the checkpoint's rows plus zero rows up to
a multiple of 64, and `model.head_vocab` keeps the head (loss and sampling) on the checkpoint's rows, so the
loss is transformers' loss on the same batch. A head not tied to the embedding (`tie_word_embeddings=false`, or an
`lm_head.weight` of other values) is refused: minitrain's head is the embedding. Out: `export` writes what
`GPT2LMHeadModel.from_pretrained`, `AutoTokenizer.from_pretrained` and transformers' `pipeline` load as they are;
a model without biases is written with zero ones, which compute the same function. Reading these weights (or a
run's) back as a model and its tokenizer, for sampling, export and evaluation, is minitrain/weights.py's.

The modern block (minitrain/model.py's options) with rope + rmsnorm + swiglu + an untied head and no biases is
transformers' Llama, and with qk_norm Qwen3: the same rotary pairing (feature i with i + head/2, rotate_half's), the
RMSNorm eps (1e-6), attention with a key and value head per query head. Only the layout differs: our fused c_attn is
their q_proj, k_proj and v_proj stacked by rows, our c_fc their gate_proj then up_proj. `model.init_from` reads a
Llama/Qwen3 directory too: the block options come from its config.json (an option left at GPT-2's default takes
the weights' value, one set otherwise is refused), and a field the block cannot compute (grouped-query attention,
rope scaling, biases, a tied head, another width of MLP) is refused naming it. `export` writes Llama/Qwen3 for such a
run, GPT-2 for GPT-2's block, and refuses any other block naming the option that has no transformers counterpart.
"""

from __future__ import annotations

import json
from dataclasses import fields, replace
from pathlib import Path
from typing import Mapping

import torch

from .errors import ConfigError, error_reason
from .hub import SourceError, source_file
from .model import RMS_NORM_EPS
from .model_config import GPT2_BLOCK, SCRATCH, MlpActivation, ModelConfig, NormKind, PositionEncoding, as_setting, \
    padded_vocab

WEIGHTS, CONFIG, GENERATION = "model.safetensors", "config.json", "generation_config.json"
TOKENIZER, TOKENIZER_CONFIG, SPECIAL_TOKENS = "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"
# model.safetensors' metadata in an export: transformers' own ("format") and the mark that tells an earlier export,
# which a new one may replace, from another model's files, which it must not
EXPORT_METADATA = {"format": "pt", "exported_by": "minitrain"}
KEY = "model.init_from"  # the setting a source error names
_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
_BUFFERS = (".attn.bias", ".attn.masked_bias")  # causal masks older GPT-2 checkpoints saved with the weights
# What minitrain's GPT computes, as GPT-2 config.json keys (absent keys take transformers' GPT2Config defaults).
_SAME_FUNCTION = {"activation_function": ("gelu_new", "gelu_pytorch_tanh"), "layer_norm_epsilon": (1e-5,),
                  "scale_attn_weights": (True,), "scale_attn_by_inverse_layer_idx": (False,),
                  "add_cross_attention": (False,), "tie_word_embeddings": (True,)}
_GPT2_DEFAULTS = {"vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12,
                  "n_inner": None, "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
                  "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "add_cross_attention": False,
                  "tie_word_embeddings": True}


# Llama's and Qwen3's classes: our block with rope + rmsnorm + swiglu + an untied head and no biases (Qwen3: and
# qk_norm, its q_norm and k_norm). Feature pairs (i, i + head/2) as our rope turns them (rotate_half).
_LLAMA_CLASSES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# The block options of Llama's and Qwen3's weights, besides the rope base (their config.json's) and qk_norm (Qwen3's)
LLAMA_BLOCK = {"position": PositionEncoding.rope, "norm": NormKind.rmsnorm, "mlp": MlpActivation.swiglu,
               "tie_head": False, "logit_softcap": None, "bias": False}
_LLAMA_SHAPE = {"n_layer": "num_hidden_layers", "n_head": "num_attention_heads", "n_embd": "hidden_size"}
# What minitrain's block computes, as Llama/Qwen3 config.json keys (absent keys take transformers' defaults)
_LLAMA_SAME_FUNCTION = {"hidden_act": "silu", "rms_norm_eps": RMS_NORM_EPS, "attention_bias": False,
                        "mlp_bias": False, "tie_word_embeddings": False, "pretraining_tp": 1,
                        "use_sliding_window": False, "rope_scaling": None, "partial_rotary_factor": 1.0}


class WeightsError(ConfigError):
    """Weights that are not a checkpoint minitrain can read; the message names the file or key."""


# -- config.json ------------------------------------------------------------------------------------------
def read_config(source: str) -> tuple[dict, Path]:
    """`source`'s config.json (GPT-2's, Llama's or Qwen3's), checked to describe a function minitrain's GPT
    computes."""
    path = source_file(source, CONFIG, KEY)
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise WeightsError(f"{path} is unreadable ({error_reason(e)})") from None
    kind = config.get("model_type") if isinstance(config, dict) else type(config).__name__
    if kind in _LLAMA_CLASSES:
        return read_llama_config(config, path), path
    if kind != "gpt2":
        raise WeightsError(f"{path}: model_type={kind!r} is not GPT-2 ('gpt2'), Llama ('llama') or Qwen3 ('qwen3'); "
                           f"{KEY} reads these checkpoints only")
    config = {**_GPT2_DEFAULTS, **config}
    for key, allowed in _SAME_FUNCTION.items():
        if config[key] not in allowed:
            raise WeightsError(f"{path}: {key}={config[key]!r}, where minitrain's GPT computes {allowed[0]!r}")
    if config["n_inner"] not in (None, 4 * config["n_embd"]):
        raise WeightsError(f"{path}: n_inner={config['n_inner']}, where minitrain's MLP is 4 x n_embd "
                           f"= {4 * config['n_embd']} wide")
    return config, path


def settle_shape(cfg: ModelConfig) -> ModelConfig:
    """The model config with the shape of `cfg.init_from`'s weights; a shape key set otherwise is refused naming
    both values. block_size may be lower than the weights' n_positions (shorter windows, positions cut) and
    vocab_size higher than their vocab (more padding)."""
    if cfg.init_from == SCRATCH:
        return cfg
    config, path = read_config(cfg.init_from)
    where = f"{cfg.init_from}'s weights ({path}"

    def conflict(key: str, theirs, hf_key: str, how: str = "") -> ConfigError:
        return ConfigError(f"model.{key}={getattr(cfg, key)} conflicts with {where}: {hf_key}={theirs}){how}; "
                           f"with {KEY} the shape comes from the weights, so leave model.{key} out")

    llama = config["model_type"] in _LLAMA_CLASSES
    names = _LLAMA_SHAPE if llama else {key: key for key in ("n_layer", "n_head", "n_embd")}
    shape = {key: config[hf_key] for key, hf_key in names.items()}
    for key, theirs in shape.items():
        if getattr(cfg, key) not in (None, theirs):
            raise conflict(key, theirs, names[key])
    rows = config["vocab_size"]
    positions, positions_key = (config["max_position_embeddings"], "max_position_embeddings") if llama else \
        (config["n_positions"], "n_positions")
    if cfg.block_size is not None and cfg.block_size > positions:
        raise conflict("block_size", positions, positions_key, " (a lower block_size is allowed)")
    if cfg.vocab_size is not None and cfg.vocab_size < rows:
        raise conflict("vocab_size", rows, "vocab_size", " (a higher vocab_size is padding)")
    if cfg.head_vocab not in (None, rows):
        raise conflict("head_vocab", rows, "vocab_size")
    if not llama and not cfg.bias:
        raise ConfigError(f"model.bias=false conflicts with {where}): every GPT-2 layer has biases; leave model.bias "
                          "out")
    if not llama and cfg.rope_base != _DEFAULT_BLOCK["rope_base"]:
        raise ConfigError(f"model.rope_base={cfg.rope_base:g} conflicts with {where}): GPT-2 has learned positions, "
                          "no rotary; leave model.rope_base out")
    block = llama_block(config) if llama else GPT2_BLOCK
    for key, theirs in block.items():
        if getattr(cfg, key) not in (_DEFAULT_BLOCK[key], theirs):
            raise ConfigError(f"model.{key}={as_setting(getattr(cfg, key))} conflicts with {where}), whose block "
                              f"has model.{key}={as_setting(theirs)}; with {KEY} the block comes from the weights, so "
                              f"leave model.{key} out")
    return replace(cfg, **shape, **block, block_size=cfg.block_size or positions, head_vocab=rows,
                   vocab_size=cfg.vocab_size or padded_vocab(rows))


def read_llama_config(config: dict, path: Path) -> dict:
    """A Llama or Qwen3 config.json, with transformers' defaults for absent keys and its rope base as rope_theta,
    checked to describe the function minitrain's block computes."""
    kind = config["model_type"]
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size",
                "max_position_embeddings"):
        if not isinstance(config.get(key), int):
            raise WeightsError(f"{path}: model_type={kind!r} is not GPT-2 ('gpt2') and has no {key}, which a "
                               f"{_LLAMA_CLASSES[kind]} config.json holds")
    config = {**_LLAMA_SAME_FUNCTION, **config}
    for key, same in _LLAMA_SAME_FUNCTION.items():
        if config[key] != same:
            raise WeightsError(f"{path}: {key}={config[key]!r}, where minitrain's block computes {same!r}")
    rope = config.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default" or rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise WeightsError(f"{path}: rope_parameters={rope!r}, where minitrain's rope is the default one (rope_type "
                           "'default', every feature turned, no scaling)")
    heads, width = config["num_attention_heads"], config["hidden_size"]
    head_dim = config.get("head_dim") or (128 if kind == "qwen3" else width // heads)  # transformers' defaults
    if width % heads or head_dim != width // heads:
        raise WeightsError(f"{path}: head_dim={head_dim}, where minitrain's heads are hidden_size / "
                           f"num_attention_heads = {width / heads:g} wide")
    if config.get("num_key_value_heads") not in (None, heads):
        raise WeightsError(f"{path}: num_key_value_heads={config['num_key_value_heads']}, where minitrain's "
                           f"attention has a key and value head per query head (num_attention_heads={heads})")
    if any(layer != "full_attention" for layer in config.get("layer_types") or ()):
        raise WeightsError(f"{path}: layer_types={config['layer_types']!r}, where minitrain's layers all attend "
                           "to the whole context ('full_attention')")
    hidden = ModelConfig(n_embd=width, n_head=heads, mlp=MlpActivation.swiglu).mlp_hidden
    if config["intermediate_size"] != hidden:
        raise WeightsError(f"{path}: intermediate_size={config['intermediate_size']}, where minitrain's SwiGLU MLP "
                           f"at hidden_size={width} is {hidden} wide (8/3 x hidden_size up to a multiple of 64)")
    return {**config, "rope_theta": float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))}


def llama_block(config: dict) -> dict:
    """The block options of a Llama or Qwen3 config.json (read_llama_config's)."""
    return {**LLAMA_BLOCK, "rope_base": config["rope_theta"], "qk_norm": config["model_type"] == "qwen3"}


_DEFAULT_BLOCK = {f.name: f.default for f in fields(ModelConfig)}


def with_weights_shape(cfg):
    """The run's config (a minitrain.config.Config) with the model's shape settled from model.init_from's weights."""
    return replace(cfg, model=settle_shape(cfg.model)) if cfg.model.init_from != SCRATCH else cfg


# -- weights ------------------------------------------------------------------------------------------------
def layout(cfg: ModelConfig) -> list[tuple[str, str]]:
    """(transformers' name, minitrain's name) of every GPT-2 tensor, biases included."""
    pairs = [("wte.weight", "wte.weight"), ("wpe.weight", "wpe.weight")]
    for i in range(cfg.n_layer):
        for part in ("ln_1", "attn.c_attn", "attn.c_proj", "ln_2", "mlp.c_fc", "mlp.c_proj"):
            pairs += [(f"h.{i}.{part}.{kind}", f"blocks.{i}.{part}.{kind}") for kind in ("weight", "bias")]
    return pairs + [("ln_f.weight", "ln_f.weight"), ("ln_f.bias", "ln_f.bias")]


def _from_conv1d(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """A Conv1D weight (in, out) as nn.Linear's (out, in); any other tensor as it is."""
    return tensor.T if name.endswith(_CONV1D) else tensor


@torch.no_grad()
def load_hf_state(targets: Mapping[str, torch.Tensor], cfg: ModelConfig, tensors: Mapping[str, torch.Tensor],
                  where: str) -> None:
    """Copy GPT-2 tensors (transformers' names, with or without the `transformer.` prefix) into `targets`
    (minitrain's state dict of a model of `cfg`, written in place): Conv1D weights transposed, the embedding's
    rows beyond the checkpoint's zeroed, the positions beyond block_size cut."""
    names = {name.removeprefix("transformer."): name for name in tensors}
    expected = dict(layout(cfg))
    unknown = sorted(n for n in names if n not in expected and not n.endswith(_BUFFERS) and n != "lm_head.weight")
    if unknown:
        raise WeightsError(f"{where} holds {unknown[0]}, which the GPT-2 of its config.json has not "
                           f"({len(unknown)} such tensors)")
    for hf_name, name in expected.items():
        if hf_name not in names:
            raise WeightsError(f"{where} has no {hf_name}: it is not the checkpoint its config.json describes")
        tensor, target = _from_conv1d(name, tensors[names[hf_name]]), targets[name]
        rows = cfg.head_vocab if name == "wte.weight" else target.shape[0]
        cut = name == "wpe.weight"  # n_positions rows, of which block_size are kept
        if tensor.shape[1:] != target.shape[1:] or (tensor.shape[0] < rows if cut else tensor.shape[0] != rows):
            raise WeightsError(f"{where}: {hf_name} is {tuple(tensors[names[hf_name]].shape)}, which does not match "
                               "its config.json")
        target[rows:].zero_()
        target[:rows].copy_(tensor[:rows])
    head = names.get("lm_head.weight")
    if head is not None and not torch.equal(tensors[head], tensors[names["wte.weight"]]):
        raise WeightsError(f"{where}: lm_head.weight is not the token embedding, and minitrain's head is tied to it")


def llama_layout(cfg: ModelConfig) -> list[tuple[tuple[str, ...], str]]:
    """(transformers' names, minitrain's name) of every Llama/Qwen3 tensor: our fused matrices are theirs stacked
    by rows, c_attn q, k, v and SwiGLU's c_fc the gate then the up projection."""
    pairs = [(("model.embed_tokens.weight",), "wte.weight")]
    for i in range(cfg.n_layer):
        theirs, ours = f"model.layers.{i}", f"blocks.{i}"
        pairs += [((f"{theirs}.input_layernorm.weight",), f"{ours}.ln_1.weight"),
                  (tuple(f"{theirs}.self_attn.{p}_proj.weight" for p in "qkv"), f"{ours}.attn.c_attn.weight"),
                  ((f"{theirs}.self_attn.o_proj.weight",), f"{ours}.attn.c_proj.weight"),
                  ((f"{theirs}.post_attention_layernorm.weight",), f"{ours}.ln_2.weight"),
                  ((f"{theirs}.mlp.gate_proj.weight", f"{theirs}.mlp.up_proj.weight"), f"{ours}.mlp.c_fc.weight"),
                  ((f"{theirs}.mlp.down_proj.weight",), f"{ours}.mlp.c_proj.weight")]
        if cfg.qk_norm:
            pairs += [((f"{theirs}.self_attn.{p}_norm.weight",), f"{ours}.attn.{p}_norm.weight") for p in "qk"]
    return pairs + [(("model.norm.weight",), "ln_f.weight"), (("lm_head.weight",), "lm_head.weight")]


@torch.no_grad()
def load_llama_state(targets: Mapping[str, torch.Tensor], cfg: ModelConfig, tensors: Mapping[str, torch.Tensor],
                     where: str) -> None:
    """Copy Llama/Qwen3 tensors into `targets` (minitrain's state dict of a model of `cfg`, written in place): the
    stacked ones concatenated, the embedding's and head's rows beyond the checkpoint's zeroed."""
    expected, present = llama_layout(cfg), set(tensors)
    known = {name for names, _ in expected for name in names}
    unknown = sorted(n for n in present - known if not n.endswith("rotary_emb.inv_freq"))
    if unknown:
        raise WeightsError(f"{where} holds {unknown[0]}, which the {_LLAMA_CLASSES[_llama_kind(cfg)]} of its "
                           f"config.json has not ({len(unknown)} such tensors)")
    for hf_names, name in expected:
        missing = [n for n in hf_names if n not in present]
        if missing:
            raise WeightsError(f"{where} has no {missing[0]}: it is not the checkpoint its config.json describes")
        tensor, target = torch.cat([tensors[n] for n in hf_names]), targets[name]
        rows = cfg.head_vocab if name in ("wte.weight", "lm_head.weight") else target.shape[0]
        if tensor.shape != (rows, *target.shape[1:]):
            raise WeightsError(f"{where}: {', '.join(hf_names)} {'is' if len(hf_names) == 1 else 'are'} "
                               f"{' + '.join(str(tuple(tensors[n].shape)) for n in hf_names)}, which does not match "
                               "its config.json")
        target[rows:].fill_(0)
        target[:rows].copy_(tensor)


class _SafetensorsFile(Mapping):
    """An open safetensors file as a mapping that reads each tensor when asked (not the whole file at once)."""

    def __init__(self, handle):
        self.handle, self.names = handle, list(handle.keys())

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.handle.get_tensor(name)

    def __iter__(self):
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def load_weights(model) -> Path:
    """`model.cfg.init_from`'s model.safetensors into `model` (built with settle_shape's config)."""
    from safetensors import SafetensorError, safe_open

    path = source_file(model.cfg.init_from, WEIGHTS, KEY)
    try:
        with safe_open(str(path), "pt") as handle:
            load = load_hf_state if model.cfg.position == PositionEncoding.learned else load_llama_state
            load(model.state_dict(), model.cfg, _SafetensorsFile(handle), str(path))
    except SafetensorError as e:
        raise WeightsError(f"{path} is unreadable ({e}): a partial download or copy? Fetch it again") from None
    return path


def hf_state(state: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """minitrain's state dict in transformers' names and layout: the head's rows of the embedding only, and zero
    biases for a model without (they add nothing)."""
    out = {}
    for hf_name, name in layout(cfg):
        if name in state:
            tensor = state[name]
        else:  # bias=false: a zero bias as long as its layer's output
            weight = state[name.removesuffix("bias") + "weight"]
            tensor = weight.new_zeros(weight.shape[0])
        tensor = _from_conv1d(name, tensor)  # and back: the transpose is its own inverse
        out[f"transformer.{hf_name}"] = tensor[: head_rows(cfg)] if name == "wte.weight" else tensor
    return {k: v.detach().cpu().contiguous() for k, v in out.items()}


def llama_state(state: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """minitrain's state dict in Llama's/Qwen3's names: the fused matrices split by rows, the embedding's and
    head's rows of the vocab only."""
    out = {}
    for hf_names, name in llama_layout(cfg):
        tensor = state[name][: head_rows(cfg)] if name in ("wte.weight", "lm_head.weight") else state[name]
        out |= zip(hf_names, tensor.chunk(len(hf_names)))
    return {k: v.detach().cpu().contiguous() for k, v in out.items()}


def head_rows(cfg: ModelConfig) -> int:
    return cfg.head_vocab or cfg.vocab_size


def hf_config(cfg: ModelConfig, eot_id, dtype: torch.dtype) -> dict:
    """config.json of transformers' GPT2LMHeadModel computing what `cfg`'s GPT computes."""
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": head_rows(cfg),
            "n_positions": cfg.block_size, "n_embd": cfg.n_embd, "n_layer": cfg.n_layer, "n_head": cfg.n_head,
            **{k: _GPT2_DEFAULTS[k] for k in ("n_inner", *_SAME_FUNCTION)},
            "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout, "attn_pdrop": cfg.dropout,
            "initializer_range": 0.02, "reorder_and_upcast_attn": False, "use_cache": True,
            "bos_token_id": eot_id, "eos_token_id": eot_id, "dtype": str(dtype).removeprefix("torch.")}


def llama_config(cfg: ModelConfig, eot_id, dtype: torch.dtype) -> dict:
    """config.json of transformers' LlamaForCausalLM (Qwen3ForCausalLM with qk_norm) computing what `cfg`'s GPT
    computes; the rope base as transformers 5 reads it (rope_parameters) and as 4 did (rope_theta)."""
    kind = _llama_kind(cfg)
    return {"architectures": [_LLAMA_CLASSES[kind]], "model_type": kind, "vocab_size": head_rows(cfg),
            "hidden_size": cfg.n_embd, "intermediate_size": cfg.mlp_hidden, "num_hidden_layers": cfg.n_layer,
            "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.n_head, "head_dim": cfg.n_embd // cfg.n_head,
            "max_position_embeddings": cfg.block_size, **_LLAMA_SAME_FUNCTION,
            "rope_theta": cfg.rope_base, "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_base},
            "attention_dropout": cfg.dropout, "initializer_range": 0.02, "use_cache": True,
            "eos_token_id": eot_id, "bos_token_id": eot_id, "dtype": str(dtype).removeprefix("torch.")}


def _llama_kind(cfg: ModelConfig) -> str:
    return "qwen3" if cfg.qk_norm else "llama"


def counterpart(cfg: ModelConfig) -> str:
    """The transformers model_type computing what `cfg`'s GPT computes: 'gpt2' for GPT-2's block (learned
    positions; biases or zero ones), 'llama' for rope + rmsnorm + swiglu + an untied head without biases, 'qwen3' for
    that and qk_norm. Any other block is refused naming its first option that neither has (zero_init_proj is an init
    only: any)."""
    gpt2 = cfg.position == PositionEncoding.learned
    family, block = ("GPT-2 uses", GPT2_BLOCK) if gpt2 else ("Llama and Qwen3 use", LLAMA_BLOCK)
    for key, want in block.items():
        if getattr(cfg, key) != want:
            raise ConfigError(f"model.{key}={as_setting(getattr(cfg, key))} has no transformers counterpart with "
                              f"model.position={cfg.position.value} ({family} model.{key}={as_setting(want)}); export "
                              "supports GPT-2's block and rope + rmsnorm + swiglu + an untied head without biases "
                              "(Llama; with qk_norm, Qwen3)")
    return "gpt2" if gpt2 else _llama_kind(cfg)


# -- export ---------------------------------------------------------------------------------------------------
def hf_generation_config(cfg: ModelConfig, eot_id) -> dict:
    """generation_config.json: end at `<|endoftext|>`, and at most the context (max_length counts the prompt).
    Without a max_length transformers' text-generation pipeline asks for 256 new tokens, past the last position
    of a shorter context."""
    return {"bos_token_id": eot_id, "eos_token_id": eot_id, "max_length": cfg.block_size}


def _may_export_into(out_dir: Path, names) -> bool:
    """Whether an export may write into `out_dir`: a new or empty directory, or one that holds an earlier export
    only (its file names, and weights that carry the export's mark)."""
    from safetensors import safe_open

    if not out_dir.exists():
        return True
    if not out_dir.is_dir() or any(p.name not in names for p in out_dir.iterdir()):
        return False
    if not any(out_dir.iterdir()):
        return True
    try:
        with safe_open(str(out_dir / WEIGHTS), "pt") as handle:
            return handle.metadata() == EXPORT_METADATA
    except Exception:  # no weights, or unreadable ones: not an export's
        return False


def export(weights, out_dir: Path) -> list[Path]:
    """`weights` (minitrain/weights.py's Weights: a config, a state dict and a tokenizer) in `out_dir` as
    transformers' GPT-2, Llama or Qwen3 (`counterpart`, which refuses any other block): config.json,
    model.safetensors, generation_config.json and the tokenizer
    (tokenizer.json and the files AutoTokenizer reads, `<|endoftext|>` as bos and eos, the context as its
    model_max_length). A directory holding anything but an earlier export is refused."""
    from safetensors.torch import save_file

    from .data import EOT

    gpt2 = counterpart(weights.cfg) == "gpt2"
    files = {name: out_dir / name for name in (CONFIG, WEIGHTS, GENERATION, TOKENIZER, TOKENIZER_CONFIG,
                                                SPECIAL_TOKENS)}
    if not _may_export_into(out_dir, files):
        raise SourceError(f"{out_dir} is neither empty nor an earlier export (its files would mix with this "
                          "model's); export into a new or empty directory")
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg, eot = weights.cfg, weights.tokenizer.token_to_id(EOT)
    tensors = (hf_state if gpt2 else llama_state)(weights.state, cfg)
    save_file(tensors, files[WEIGHTS], metadata=EXPORT_METADATA)
    dtype = next(iter(tensors.values())).dtype
    files[CONFIG].write_text(json.dumps((hf_config if gpt2 else llama_config)(cfg, eot, dtype), indent=2) + "\n")
    files[GENERATION].write_text(json.dumps(hf_generation_config(cfg, eot), indent=2) + "\n")
    weights.tokenizer.save(str(files[TOKENIZER]))
    special = {"bos_token": EOT, "eos_token": EOT, "unk_token": EOT}
    files[TOKENIZER_CONFIG].write_text(json.dumps(
        {"tokenizer_class": "GPT2Tokenizer", **special, "add_prefix_space": False, "add_bos_token": False,
         "model_max_length": cfg.block_size, "clean_up_tokenization_spaces": False}, indent=2) + "\n")
    files[SPECIAL_TOKENS].write_text(json.dumps(special, indent=2) + "\n")
    return list(files.values())
