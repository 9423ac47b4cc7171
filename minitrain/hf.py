"""Hugging Face's GPT-2 layout in and out: `config.json` + `model.safetensors` <-> minitrain's GPT.

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
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Mapping

import torch

from .config import SCRATCH, ConfigError, ModelConfig, error_reason, padded_vocab
from .hub import SourceError, source_file

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


class WeightsError(ConfigError):
    """Weights that are not a GPT-2 checkpoint minitrain can read; the message names the file or key."""


# -- config.json ------------------------------------------------------------------------------------------
def read_config(source: str) -> tuple[dict, Path]:
    """GPT-2's config.json of `source`, checked to describe the function minitrain's GPT computes."""
    path = source_file(source, CONFIG, KEY)
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise WeightsError(f"{path} is unreadable ({error_reason(e)})") from None
    if not isinstance(config, dict) or config.get("model_type") != "gpt2":
        kind = config.get("model_type") if isinstance(config, dict) else type(config).__name__
        raise WeightsError(f"{path}: model_type={kind!r} is not GPT-2 ('gpt2'); {KEY} reads GPT-2 checkpoints only")
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

    shape = {"n_layer": config["n_layer"], "n_head": config["n_head"], "n_embd": config["n_embd"]}
    for key, theirs in shape.items():
        if getattr(cfg, key) not in (None, theirs):
            raise conflict(key, theirs, key)
    rows, positions = config["vocab_size"], config["n_positions"]
    if cfg.block_size is not None and cfg.block_size > positions:
        raise conflict("block_size", positions, "n_positions", " (a lower block_size is allowed)")
    if cfg.vocab_size is not None and cfg.vocab_size < rows:
        raise conflict("vocab_size", rows, "vocab_size", " (a higher vocab_size is padding)")
    if cfg.head_vocab not in (None, rows):
        raise conflict("head_vocab", rows, "vocab_size")
    if not cfg.bias:
        raise ConfigError(f"model.bias=false conflicts with {where}): every GPT-2 layer has biases; leave model.bias "
                          "out")
    return replace(cfg, **shape, block_size=cfg.block_size or positions, head_vocab=rows,
                   vocab_size=cfg.vocab_size or padded_vocab(rows))


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
            load_hf_state(model.state_dict(), model.cfg, _SafetensorsFile(handle), str(path))
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
    transformers' GPT-2: config.json, model.safetensors, generation_config.json and the tokenizer
    (tokenizer.json and the files AutoTokenizer reads, `<|endoftext|>` as bos and eos, the context as its
    model_max_length). A directory holding anything but an earlier export is refused."""
    from safetensors.torch import save_file

    from .data import EOT

    files = {name: out_dir / name for name in (CONFIG, WEIGHTS, GENERATION, TOKENIZER, TOKENIZER_CONFIG,
                                                SPECIAL_TOKENS)}
    if not _may_export_into(out_dir, files):
        raise SourceError(f"{out_dir} is neither empty nor an earlier export (its files would mix with this "
                          "model's); export into a new or empty directory")
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg, eot = weights.cfg, weights.tokenizer.token_to_id(EOT)
    tensors = hf_state(weights.state, cfg)
    save_file(tensors, files[WEIGHTS], metadata=EXPORT_METADATA)
    dtype = next(iter(tensors.values())).dtype
    files[CONFIG].write_text(json.dumps(hf_config(cfg, eot, dtype), indent=2) + "\n")
    files[GENERATION].write_text(json.dumps(hf_generation_config(cfg, eot), indent=2) + "\n")
    weights.tokenizer.save(str(files[TOKENIZER]))
    special = {"bos_token": EOT, "eos_token": EOT, "unk_token": EOT}
    files[TOKENIZER_CONFIG].write_text(json.dumps(
        {"tokenizer_class": "GPT2Tokenizer", **special, "add_prefix_space": False, "add_bos_token": False,
         "model_max_length": cfg.block_size, "clean_up_tokenization_spaces": False}, indent=2) + "\n")
    files[SPECIAL_TOKENS].write_text(json.dumps(special, indent=2) + "\n")
    return list(files.values())
