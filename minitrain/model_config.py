"""The model group's settings (model.*): the shape, the block's options, where the weights come from, and what
the package derives from them (the padded vocab, GPT-2's block, the MLP's width).

Apart from the run's schema (minitrain/config.py, whose Config holds a ModelConfig), so that the model and the
readers of its weights import its settings alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Optional

from .errors import require


class KernelImpl(str, Enum):
    """A part with a Triton kernel and a PyTorch reference: the MLP's GELU (model.gelu), q's and k's norm and rotation
    (model.qk_kernel), the loss (loss.impl)."""

    auto = "auto"  # fused on CUDA, torch on CPU
    fused = "fused"
    torch = "torch"

    def fused_on(self, device_type: str) -> bool:
        """Whether the Triton kernel runs: asked for, or `auto` on CUDA (on a CPU the interpreter is a test tool)."""
        return self == KernelImpl.fused or (self == KernelImpl.auto and device_type == "cuda")


class PositionEncoding(str, Enum):
    """How a token's position reaches attention (model.position)."""

    learned = "learned"  # GPT-2: a learned vector per position (wpe), added to the token's embedding
    rope = "rope"  # rotary (RoFormer): each head's q and k turned by angles of their position, in transformers'
    # Llama layout (feature i paired with i + head size / 2)


class NormKind(str, Enum):
    """The blocks' and the final norm (model.norm)."""

    layernorm = "layernorm"  # GPT-2: (x - mean) / std * weight + bias (bias with model.bias)
    rmsnorm = "rmsnorm"  # x / rms(x) * weight: no mean, no bias (F.rms_norm)


class MlpActivation(str, Enum):
    """The MLP's nonlinearity and with it its hidden width (ModelConfig.mlp_hidden)."""

    gelu = "gelu"  # GPT-2: tanh-GELU over 4 * n_embd (model.gelu picks its kernel)
    relu2 = "relu2"  # relu(x)^2 over 4 * n_embd (Primer, arXiv:2109.08668)
    swiglu = "swiglu"  # silu(gate) * up (Shazeer, arXiv:2002.05202; Llama), gate and up one matmul (mlp.c_fc)


SCRATCH = "scratch"  # model.init_from's value for random weights


def padded_vocab(ids: int) -> int:
    """The embedding's rows for `ids` token ids when model.vocab_size is null: rounded up to a multiple of 64 (tensor
    cores' tiles), the padding rows zero with weights to start from, and never a token."""
    return -(-ids // 64) * 64


SHAPE_KEYS = ("n_layer", "n_head", "n_embd", "block_size")
# The block options' values of GPT-2's block: those of GPT-2 weights from model.init_from (hf.settle_shape).
GPT2_BLOCK = {"position": PositionEncoding.learned, "norm": NormKind.layernorm, "qk_norm": False,
              "mlp": MlpActivation.gelu, "tie_head": True, "logit_softcap": None}


def as_setting(value) -> str:
    """A setting's value as the command line writes it."""
    return "null" if value is None else str(getattr(value, "value", value)).lower()


@dataclass
class ModelConfig:
    name: str = "custom"  # a preset (configs/model/) names itself
    # scratch (random weights), a Hugging Face GPT-2 name (gpt2, gpt2-medium, gpt2-large, gpt2-xl) or a local
    # directory in its layout (config.json + model.safetensors), or in Llama's or Qwen3's: then the shape and the
    # block options come from the weights (minitrain/hf.py) and a key set here must agree with them.
    init_from: str = SCRATCH
    # The shape keys: a preset's (configs/model/, model=tiny by default), or with init_from the weights'.
    n_layer: Optional[int] = None
    n_head: Optional[int] = None
    n_embd: Optional[int] = None
    block_size: Optional[int] = None  # with init_from: at most the weights' n_positions
    # None: the tokenizer's vocab rounded up to a multiple of 64 (padded_vocab); with init_from the weights' vocab
    # rounded up.
    vocab_size: Optional[int] = None
    # The first rows of vocab_size that are tokens: the LM head scores these only (in the loss and in
    # sampling); the rest is padding. None: every row. init_from sets it to the weights' vocab, so the
    # loss is the one the checkpoint was trained with.
    head_vocab: Optional[int] = None
    bias: bool = True
    dropout: float = 0.0
    gelu: KernelImpl = KernelImpl.auto  # fused: one Triton pass each way instead of inductor's tanh
    # The block, one key per choice so that a sweep can set each alone. The defaults are GPT-2's block (the same
    # weights, init and losses as a model without these keys); configs/model/gpt2-124m-modern.yaml sets the speedrun's.
    position: PositionEncoding = PositionEncoding.learned
    rope_base: float = 10000.0  # position=rope: angle pos * rope_base^(-2i / head size) for feature pair i
    norm: NormKind = NormKind.layernorm
    qk_norm: bool = False  # an RMSNorm over each head's q and over its k (weights of head size), before rope
    # qk_norm and rope's kernel: fused, one Triton pass each way over q and k (minitrain/ops/qk_norm_rope.py); torch:
    # nn.RMSNorm and model.rotate, which inductor compiles
    qk_kernel: KernelImpl = KernelImpl.auto
    mlp: MlpActivation = MlpActivation.gelu
    tie_head: bool = True  # the LM head is the token embedding (GPT-2); false: a (vocab_size, n_embd) head of its own
    # attn.c_proj and mlp.c_proj (and the head, untied) start at zero instead of GPT-2's small normal draws: each
    # block starts as the identity on the residual stream
    zero_init_proj: bool = False
    # c * tanh(logits / c): the logits bent smoothly into (-c, c), inside the loss (minitrain/ops/); null: as they are
    logit_softcap: Optional[float] = None

    @property
    def mlp_hidden(self) -> int:
        """The MLP's hidden width: 4 * n_embd; with mlp=swiglu, whose c_fc makes a gate and an up projection, the
        width that keeps the MLP's 8 * n_embd^2 weights in its three matrices, 8/3 * n_embd, rounded up to a
        multiple of 64 (tensor cores' tiles; 2048 at n_embd=768, exactly the GELU MLP's count)."""
        if self.mlp == MlpActivation.swiglu:
            return -(-8 * self.n_embd // (3 * 64)) * 64
        return 4 * self.n_embd

    @property
    def remakes_qk(self) -> bool:
        """Whether q and k are normalised or rotated (qk_norm, rope) after c_attn: model.qk_kernel's part."""
        return self.qk_norm or self.position == PositionEncoding.rope

    def fuses_qk_on(self, device_type: str) -> bool:
        """Whether q's and k's norm and rotation run as the fused Triton op on this kind of device."""
        return self.remakes_qk and self.qk_kernel.fused_on(device_type)

    def describe_block(self) -> str:
        """The block's choices in a few words, for the plan's printout."""
        rope = f" (base {self.rope_base:g})" if self.position == PositionEncoding.rope else ""
        parts = [f"{self.position.value} positions{rope}", self.norm.value] + ["qk_norm"] * self.qk_norm + \
            [f"{self.mlp.value} MLP", "tied head" if self.tie_head else "untied head"] + \
            ["zero-init projections"] * self.zero_init_proj + \
            ([f"logit soft-cap {self.logit_softcap:g}"] if self.logit_softcap is not None else [])
        return ", ".join(parts)

    def __post_init__(self):
        for key in SHAPE_KEYS:  # None: not set yet (Config's check), or the weights' (init_from)
            value = getattr(self, key)
            require(value is None or value >= 1, f"model.{key}", f"must be >= 1, got {value}")
        if self.n_embd is not None and self.n_head is not None:
            require(self.n_embd % self.n_head == 0, "model.n_embd",
                    f"{self.n_embd} is not divisible by model.n_head={self.n_head}")
        require(self.vocab_size is None or self.vocab_size >= 2, "model.vocab_size",
                f"must be >= 2, got {self.vocab_size}")
        require(self.head_vocab is None or self.head_vocab >= 2, "model.head_vocab",
                f"must be >= 2, got {self.head_vocab}")
        require(None in (self.head_vocab, self.vocab_size) or self.head_vocab <= self.vocab_size,
                "model.head_vocab", f"{self.head_vocab} rows are more than model.vocab_size={self.vocab_size}")
        require(0.0 <= self.dropout < 1.0, "model.dropout", f"must be in [0, 1), got {self.dropout}")
        require(self.init_from.strip() != "", "model.init_from",
                "scratch, a Hugging Face GPT-2 name (gpt2) or a directory, got ''")
        require(self.rope_base > 1.0, "model.rope_base", f"must be > 1, got {self.rope_base}")
        # (with init_from the weights' config sets the position, and hf.py checks a rope_base given against it)
        require(self.init_from != SCRATCH or self.position == PositionEncoding.rope or
                self.rope_base == ModelConfig.rope_base, "model.rope_base",
                f"is set, but model.position={self.position.value} does not use it: add model.position=rope")
        require(self.logit_softcap is None or self.logit_softcap > 0, "model.logit_softcap",
                f"must be > 0 or null, got {self.logit_softcap}")
        if self.position == PositionEncoding.rope and None not in (self.n_embd, self.n_head):
            head = self.n_embd // self.n_head
            require(head % 2 == 0, "model.position",
                    f"rope turns pairs of a head's features: model.n_embd={self.n_embd} / model.n_head={self.n_head} "
                    f"= {head} is odd")
