"""Peak memory, predicted before step 0: persistent state + activations + the largest transient.

    peak = weights + fp32 masters + Adam m, v          with grads, the 16-18 B/param floor (Muon's matrices:
                                                       one momentum buffer in place of m and v, 12-14 B/param)
         + max(activations saved for backward by the policy   the term checkpointing controls
               + max(loss workspace, block-backward transient)
               + FSDP's gathered units                    (fsdp: the state above is 1/N)
               grads + optimizer transient)          (Muon: + a batch's Newton–Schulz buffers)

Gradients exist whole only at the optimizer step: backward makes them as it frees the activations
(with grad_accum > 1 or fp32 main grads they are there from the start, and join the first term).

It is a model of eager PyTorch as this repo runs it, op by op; every byte count below names the op that
holds it. Assumptions, checked by tests/test_memory.py on CPU and by the GPU sweep on the H200:
  - the optimizer is minitrain.optim.AdamW or Muon: grads are autograd's tensors from backward to
    zero_grad; the fused step reads them in place, loop and foreach gather them into a flat buffer
    (every tensor padded to ALIGN elements, one bucket per dtype and side); fp32 main grads live in that
    buffer from the first backward;
  - no torch.compile: Inductor's partitioner chooses its own saved set (for bf16 blocks the same bytes, rope's cos
    and sin aside: an H100 read the modern preset's block, torch's q/k modules, keeping none), except with torchao's
    float8 linears (precision.float8_kernels=torchao, `compiled`): there the partitioner keeps float8 copies, or
    nothing, where eager torchao keeps bf16 inputs (_float8_saved_delta), and fuses the casts that eager runs through
    fp32 temporaries (_float8_casts); minitrain's float8 op is opaque and saves the same float8 copies either way
    (_minitrain_float8_block_delta);
  - SDPA runs a fused kernel (CUDA flash/efficient, CPU flash) that saves q, k, v, the output and an
    fp32 logsumexp; only CPU with attention dropout takes the math path, which saves T x T matrices;
  - torch's RMSNorm (model.norm=rmsnorm; model.qk_norm with model.qk_kernel=torch) is one fused kernel on CUDA when its
    input and weight share a dtype, and its composite ops, which keep fp32 copies, on a CPU or under autocast's mixed
    dtypes (_rms_norm_saved); the fused q/k op keeps c_attn's output and the rope tables alone (_qk_bytes);
  - the allocator is not modelled: reserved exceeds allocated by what it caches, little with expandable segments
    (trainer.expandable_segments, the default), more with fixed blocks; `compare` shows by how much;
  - CUDA context, cuBLAS workspaces and Triton's own buffers are outside torch's counters, and ignored.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, astuple, dataclass, field
from typing import NamedTuple

import torch

from .recompute import recomputed_blocks
from .config import BLOCK_LINEARS, CheckpointingConfig, CheckpointPolicy, DistributedConfig, Float8Kernels
from .model import GPT
from .model_config import KernelImpl, MlpActivation, ModelConfig, NormKind, PositionEncoding
from .optimizer_config import OptimizerName
from .ops.cross_entropy import DEFAULT_CHUNK_BYTES, fitting
from .optim import newton_schulz
from .optim.layout import padded as _padded
from .precision import Precision

GB = 1e9


@dataclass
class MemoryEstimate:
    """Predicted bytes by term; `peak` is what the allocator's peak-allocated counter should read."""

    n_params: int
    weights: int
    grads: int
    masters: int
    adam_m: int
    adam_v: int
    activations_per_layer: list[int]
    activations_other: int  # embedding indices/masks and the final LayerNorm
    activations_total: int
    loss_workspace: int  # what the loss holds or allocates beyond the model's activations, at its peak
    backward_transient: int  # inside the last block's backward: gradients in flight (+ recompute)
    optimizer_transient: int
    peak: int
    gathered: int = 0  # FSDP: compute copies of the units gathered at the peak
    muon_momentum: int = 0  # optimizer=muon: the hidden matrices' one buffer (adam_m and adam_v: the rest's)
    notes: list[str] = field(default_factory=list)

    @property
    def state(self) -> int:
        return self.weights + self.grads + self.masters + self.adam_m + self.adam_v + self.muon_momentum

    @property
    def transient(self) -> int:
        """What the peak holds beyond state + activations: the loss workspace or a backward/optimizer
        transient, net of the gradients not yet made at that moment (so it can be negative)."""
        return self.peak - self.state - self.activations_total - self.gathered

    def rows(self) -> list[tuple[str, int]]:
        blocks = self.activations_per_layer
        kinds = sorted(set(blocks), reverse=True)
        per_kind = [(f"  {blocks.count(b)} block(s) x {b / GB:.3f} GB", blocks.count(b) * b) for b in kinds]
        return [("weights (compute copy)", self.weights), ("gradients", self.grads),
                ("fp32 master weights", self.masters), ("Adam m", self.adam_m), ("Adam v", self.adam_v),
                *([("Muon momentum", self.muon_momentum)] if self.muon_momentum else []),
                ("= persistent state", self.state), *([("FSDP gathered params", self.gathered)] if self.gathered else []),
                *per_kind,
                ("  embedding + final norm", self.activations_other), ("= activations", self.activations_total),
                ("loss workspace", self.loss_workspace), ("backward transient", self.backward_transient),
                ("optimizer transient", self.optimizer_transient), ("= predicted peak", self.peak)]

    def table(self) -> str:
        """Aligned text: GB and bytes/param per term."""
        rows = self.rows()
        width = max(len(name) for name, _ in rows)
        lines = [f"{'memory (predicted)':<{width}}  {'GB':>9}  {'B/param':>8}"]
        lines += [f"{name:<{width}}  {b / GB:>9.3f}  {b / self.n_params:>8.2f}" for name, b in rows]
        return "\n".join(lines + [f"({note})" for note in self.notes])

    def as_dict(self) -> dict[str, float]:
        """Flat `mem_pred/<term>_gb` keys for logging."""
        d = {k: v for k, v in asdict(self).items() if isinstance(v, int) and k != "n_params"}
        d.update(state=self.state, transient=self.transient,
                 activations_per_layer_max=max(self.activations_per_layer, default=0))
        return {f"mem_pred/{k}_gb": v / GB for k, v in d.items()}


def compare(estimate: MemoryEstimate, measured_peak_allocated_bytes: int, measured_peak_reserved_bytes: int,
            cuda_graphs: bool = False) -> str:
    """One line: predicted peak beside the allocator's measured peaks, and their ratios. Under CUDA graphs
    the graphs' tensors live in a pool the allocated counter does not see: the reserved peak is the measure."""
    p, a, r = estimate.peak, measured_peak_allocated_bytes, measured_peak_reserved_bytes
    if cuda_graphs:
        return (f"memory: predicted peak {p / GB:.3f} GB | measured peak reserved {r / GB:.3f} GB "
                f"(predicted/reserved {p / max(r, 1):.3f}) | allocated {a / GB:.3f} GB, "
                "without the CUDA graphs' pool")
    return (f"memory: predicted peak {p / GB:.3f} GB | measured peak allocated {a / GB:.3f} GB "
            f"(predicted/measured {p / max(a, 1):.3f}) | reserved {r / GB:.3f} GB "
            f"(reserved/allocated {r / max(a, 1):.3f})")


def param_numels(model_cfg: ModelConfig) -> list[tuple[list[int], bool]]:
    """(numel of each parameter in one param group..., is the group decayed): the exact tensors the
    optimizer sees, from the model itself built on the meta device (no memory, no duplicated shape math)."""
    return _model_numels(astuple(model_cfg)).param_groups


def _block_params(model_cfg: ModelConfig) -> dict[str, int]:
    """The numel of each parameter of one block, by name (attn.c_attn.weight, ...)."""
    return _model_numels(astuple(model_cfg)).block


def hidden_shapes(model_cfg: ModelConfig) -> list[tuple[int, int]]:
    """The shape of each matrix Muon orthogonalizes (GPT.hidden_matrices), in the model's order."""
    return _model_numels(astuple(model_cfg)).hidden


def _muon_adamw_numels(model_cfg: ModelConfig) -> list[tuple[list[int], bool]]:
    """param_numels of the groups AdamW keeps under optimizer=muon (GPT.muon_param_groups): the untied head among
    them."""
    return _model_numels(astuple(model_cfg)).muon_adamw_groups


class _ModelNumels(NamedTuple):
    param_groups: list[tuple[list[int], bool]]  # param_numels
    block: dict[str, int]  # _block_params
    hidden: list[tuple[int, int]]  # hidden_shapes
    muon_adamw_groups: list[tuple[list[int], bool]]  # _muon_adamw_numels


@functools.lru_cache(maxsize=8)
def _model_numels(key: tuple) -> _ModelNumels:
    """Built once per shape: the plan predicts many (micro-batch, policy) candidates of one model."""
    with torch.device("meta"):
        model = GPT(ModelConfig(*key))

    def numels(groups):
        return [([p.numel() for p in g["params"]], g.get("weight_decay", 0) > 0) for g in groups]

    return _ModelNumels(numels(model.param_groups(1.0)),
                        {name: p.numel() for name, p in model.blocks[0].named_parameters()},
                        [tuple(p.shape) for p in model.hidden_matrices()],
                        numels(g for g in model.muon_param_groups(1.0) if not g.get("use_muon")))


def _float8_saved_delta(cfg: ModelConfig, float8_linears: tuple[str, ...], tokens: int, a: int) -> int:
    """What a kept block saves compiled with float8 linears, less what its bf16 twin saves (tests/test_fp8.py reads
    both off the compiled block). A converted linear's weight gradient needs its input in float8: for a norm's
    output (c_attn's, c_fc's input) the partitioner recomputes it from the block's input and the norm's statistics
    instead of keeping it; the activation's output (mlp.c_proj's input, mlp_hidden wide) it recomputes from torch's
    ops, or keeps in float8 from our GELU kernel's, which it cannot rerun. Attention's output (attn.c_proj's input)
    SDPA keeps anyway."""
    C, hidden = cfg.n_embd, cfg.mlp_hidden
    norm_fed = sum(name in float8_linears for name in ("attn.c_attn", "mlp.c_fc"))
    activation_out = 0
    if "mlp.c_proj" in float8_linears:
        kernel = cfg.mlp == MlpActivation.gelu and cfg.gelu == KernelImpl.fused
        activation_out = hidden * (1 if kernel else 0) - hidden * a
    return tokens * (activation_out - norm_fed * C * a)


def _rms_norm_saved(width: int, rows: int, x: int, weight: int, device: str) -> tuple[bool, int]:
    """What torch's RMSNorm (F.rms_norm) over a token's `rows` rows of `width` features in all keeps for backward:
    whether it keeps its input (x bytes an element), and the bytes of the tensors it makes. On CUDA, with input and
    weight of one dtype, one fused kernel keeps its input and an fp32 rstd a row (FusedRmsNormBackward0; read on an
    H100, torch 2.11); otherwise (a CPU; autocast's bf16 q and k beside fp32 weights) its composite ops keep the fp32
    upcast (the input itself when fp32), the fp32 rstd and the fp32 normalised input."""
    if device == "cuda" and x == weight:
        return True, 4 * rows
    return x == 4, (0 if x == 4 else 4 * width) + 4 * rows + 4 * width


def _norm_bytes(cfg: ModelConfig, r: int, stats: int, device: str) -> int:
    """Per token, what one norm over the residual stream (r bytes an element, its weight's too) keeps for backward,
    its input included: model.norm's LayerNorm its input, mean and rstd (stats bytes each), or RMSNorm
    (_rms_norm_saved)."""
    C = cfg.n_embd
    if cfg.norm == NormKind.layernorm:
        return C * r + 2 * stats
    keeps_input, made = _rms_norm_saved(C, 1, r, r, device)
    return keeps_input * C * r + made


# By model.mlp, per token in units of the MLP's hidden width (ModelConfig.mlp_hidden), a element bytes each:
#   kept       what the MLP saves between its linears: GELU its input (c_fc's output) and output (c_proj's input);
#              ReLU^2 relu's output (relu and the square keep it; c_fc's output is freed) and the square's; SwiGLU
#              c_fc's gate and up (2 wide: SiLU keeps the gate, the product the up), SiLU's output, the product;
#   selective  what `selective` keeps there: c_fc's output (recompute.py reruns the activation from it);
#   rerun      what `selective` makes rerunning the activation in backward: its output(s) (ReLU^2 and SwiGLU two);
#   grads      the activation's backward at its widest, the incoming gradient included: GELU the incoming and the
#              outgoing; ReLU^2 the square's (pow's backward: grad * (2 * x.pow(1)), whose temporaries live to the end
#              of the expression); SwiGLU the gate's and the up's gradients beside their concatenation.
MLP_WIDTHS = {MlpActivation.gelu: dict(kept=2, selective=1, rerun=1, grads=2),
              MlpActivation.relu2: dict(kept=2, selective=1, rerun=2, grads=4),
              MlpActivation.swiglu: dict(kept=4, selective=2, rerun=2, grads=4)}


def _block_bytes(cfg: ModelConfig, tokens: int, seq_len: int, r: int, a: int, stats: int, device: str,
                 kind: str) -> int:
    """Bytes one block holds for backward. r: residual-stream (param) dtype; a: matmul (compute) dtype;
    stats: LayerNorm mean/rstd dtype. kind: kept | recomputed | selective."""
    C, H = cfg.n_embd, cfg.n_head
    if kind == "recomputed":
        return tokens * C * r  # checkpoint holds the block input only
    dropout = cfg.dropout > 0
    # CPU flash attention has no dropout: the math path runs instead, in fp32 whatever the input dtype.
    math_attention = dropout and device == "cpu"
    # kept: both norms (their inputs x, x1 among what they keep: _norm_bytes) and their outputs (a: autocast casts
    # them for the matmul); qkv (3C, SDPA's q/k/v views); attention output (C, also c_proj's input); the MLP's
    # (MLP_WIDTHS); per head an fp32 logsumexp, or on the math path fp32 q/k/v copies plus softmax, mask and
    # dropped scores (3·H·T); two residual dropout masks.
    mask = (1 if device == "cuda" else a) if dropout else 0  # CUDA: bool; CPU: x * mask in x's dtype
    attention = C * a + (4 * 3 * (C + H * seq_len) if math_attention else 3 * C * a + 4 * H)
    attention += _qk_bytes(cfg, r, a, device, math_attention)
    mlp = MLP_WIDTHS[cfg.mlp]
    rope_tables = _rope_tables(cfg, seq_len)
    if kind == "selective":  # the same, less what it reruns: both norms' own tensors and outputs, the activation's
        return tokens * (2 * C * r + attention + mlp["selective"] * cfg.mlp_hidden * a + 2 * C * mask) + rope_tables
    return (tokens * (2 * _norm_bytes(cfg, r, stats, device) + 2 * C * a + attention
                      + mlp["kept"] * cfg.mlp_hidden * a + 2 * C * mask) + rope_tables)


def _qk_bytes(cfg: ModelConfig, r: int, a: int, device: str, math_attention: bool) -> int:
    """Per token, what model.qk_norm and model.position=rope add to attention's saved tensors: the normalised,
    rotated q and k that fused SDPA keeps in place of views of c_attn's output (the math path keeps fp32 copies of
    whatever it is given), and each q and k norm's own tensors (_rms_norm_saved). A norm that keeps its input keeps
    c_attn's output, which fused SDPA keeps anyway and the math path does not; so does model.qk_kernel's fused op,
    which keeps nothing else (it recomputes the rms)."""
    C, H = cfg.n_embd, cfg.n_head
    extra = 2 * C * a if cfg.remakes_qk and not math_attention else 0
    if cfg.fuses_qk_on(device):
        return extra + (3 * C * a if math_attention else 0)
    if cfg.qk_norm:
        keeps_input, made = _rms_norm_saved(C, H, a, r, device)
        extra += 2 * made + (3 * C * a if keeps_input and math_attention else 0)
    return extra


def _rope_tables(cfg: ModelConfig, seq_len: int) -> int:
    """model.position=rope: the fp32 cos and sin (seq_len x head size / 2) that a block's rotations of q and k keep
    for backward, whatever the batch."""
    return 4 * seq_len * (cfg.n_embd // cfg.n_head) if cfg.position == PositionEncoding.rope else 0


def _linear_inputs(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """Per token, the input width of each block linear, and what a kept bf16 block saves as that linear's input and
    frees once the linear keeps its own float8 copy: the norms' outputs and the activation's (attention's output SDPA
    keeps)."""
    C, hidden = cfg.n_embd, cfg.mlp_hidden
    return {"attn.c_attn": (C, C), "attn.c_proj": (C, 0), "mlp.c_fc": (C, C), "mlp.c_proj": (hidden, hidden)}


def _minitrain_float8_block_delta(cfg: ModelConfig, float8_linears: tuple[str, ...], tokens: int, a: int,
                                  compiled: bool, kind: str) -> int:
    """What a block of `kind` saves with minitrain's float8 linears beyond its bf16 twin: each linear's input as a
    transposed float8 copy (1 byte a token and input feature), its weight's (1 byte a weight) and two fp32 scales,
    in place of the bf16 input a kept block saved. `selective` saves the op's outputs whole; eager, it runs on
    torch's save tags, which also keep mlp.c_proj's output, as with torchao's linears."""
    if kind == "recomputed":
        return 0
    C, params, widths = cfg.n_embd, _block_params(cfg), _linear_inputs(cfg)
    inputs = sum(widths[name][0] for name in float8_linears) * tokens
    freed = sum(widths[name][1] for name in float8_linears) * tokens * a if kind == "kept" else 0
    outputs = C * tokens * a if kind == "selective" and not compiled else 0
    return inputs - freed + outputs + sum(params[f"{name}.weight"] + 8 for name in float8_linears)


def _float8_block_delta(cfg: ModelConfig, float8_linears: tuple[str, ...], tokens: int, a: int, compiled: bool,
                        kind: str, kernels: Float8Kernels) -> int:
    """What a block of `kind` saves with float8 linears beyond its bf16 twin. Eager, torchao keeps each linear's
    bf16 input, as a bf16 linear does; `selective` runs on torch's save tags then (recompute.apply_policy),
    which also keep mlp.c_proj's matmul output. Compiled, `selective` saves what bf16 does, a kept block less
    (_float8_saved_delta)."""
    if not float8_linears or kind == "recomputed":
        return 0
    if kernels == Float8Kernels.minitrain:
        return _minitrain_float8_block_delta(cfg, float8_linears, tokens, a, compiled, kind)
    if compiled:
        return _float8_saved_delta(cfg, float8_linears, tokens, a) if kind == "kept" else 0
    return tokens * cfg.n_embd * a if kind == "selective" else 0


def _float8_casts(cfg: ModelConfig, N: int, float8_linears: tuple[str, ...], a: int) -> int:
    """The MLP's backward in the last block with eager float8 linears, beyond the incoming gradient. torchao casts
    an operand of M elements to float8 through two fp32 temporaries (the upcast times the scale, then its clamp)
    beside the float8 result: 9·M bytes at the cast. The widest casts (M = mlp_hidden or c_fc's output width per
    token) and what is alive then:
      mlp.c_proj's input (the activation's output, for the weight gradient): the incoming gradient's two float8
        copies (one per GEMM), the weight's float8 copy, the gradient of the activation's output;
      mlp.c_fc's output gradient (the MLP's saved tensors freed by then): that gradient, its first float8 copy, the
        weight's float8 copy, the gradient of the norm's output.
    Compiled, each cast is one fused kernel with no fp32 temporaries."""
    C, hidden, params = cfg.n_embd, cfg.mlp_hidden, _block_params(cfg)
    fc_out = params["mlp.c_fc.weight"] // C
    casting = 9 * N  # a cast's bytes, per element of a token's operand
    moments = [0]
    if "mlp.c_proj" in float8_linears:
        moments.append(2 * N * C + params["mlp.c_proj.weight"] + N * hidden * a + casting * hidden)
    if "mlp.c_fc" in float8_linears:
        mlp_saved = MLP_WIDTHS[cfg.mlp]["kept"] * N * hidden * a
        moments.append(N * fc_out * a + N * fc_out + params["mlp.c_fc.weight"] + N * C * a + casting * fc_out
                       - mlp_saved)
    return max(moments)


@dataclass(frozen=True)
class _MicroBatch:
    """What the activation and transient terms read: the model, one micro-batch's tokens, the bytes per element
    of each dtype, and what changes a block's saved set (float8 linears, compilation)."""

    cfg: ModelConfig
    tokens: int  # micro_batch x seq_len
    seq_len: int
    p: int  # params and the residual stream
    compute: torch.dtype  # the matmuls'
    stats: int  # LayerNorm mean/rstd
    autocast: bool
    device: str
    float8_linears: tuple[str, ...]
    compiled: bool
    float8_kernels: Float8Kernels

    @property
    def a(self) -> int:
        return self.compute.itemsize

    def block(self, kind: str) -> int:
        """Bytes one block of `kind` (kept | recomputed | selective) holds for backward."""
        return (_block_bytes(self.cfg, self.tokens, self.seq_len, self.p, self.a, self.stats, self.device, kind)
                + _float8_block_delta(self.cfg, self.float8_linears, self.tokens, self.a, self.compiled, kind,
                                      self.float8_kernels))


def _persistent_state(precision: Precision, n_params: int, padded: int, world_size: int,
                      sharded: bool, muon_padded: int = 0) -> tuple[int, int, int, int, int, int]:
    """weights, grads, fp32 masters, Adam m and v, Muon's momentum: the model's params + the optimizer's flat,
    ALIGN-padded buffers (`padded` elements, `muon_padded` of them Muon's matrices, which keep one fp32 buffer in
    place of m and v). FSDP2 divides each by `world_size`; with masters the fp32 shards ARE the params (no separate
    compute copy: _fsdp_gathered's, while gathered) and receive the fp32 reduce-scatter."""
    masters = 4 * padded if precision.master_weights else 0
    weights, grads = n_params * precision.param_dtype.itemsize, padded * precision.grad_dtype.itemsize
    if sharded and precision.master_weights:
        weights, grads = 0, 4 * padded
    shard = world_size if sharded else 1
    adam = 4 * (padded - muon_padded)
    return tuple(x // shard for x in (weights, grads, masters, adam, adam, 4 * muon_padded))


def _fsdp_gathered(cfg: ModelConfig, p: int, n_params: int, unit_blocks: int, reshard_after_forward: bool,
                   float8_gathered: tuple[str, ...]) -> tuple[int, int]:
    """FSDP2's compute copies, which exist only while gathered: the root's (embeddings, final norm, the head)
    through forward and backward, plus two units of blocks (the running one, the prefetched one), or every block
    from forward to backward when reshard_after_forward is false. `float8_gathered`: the linears whose weights
    arrive as 1-byte float8, already cast. Also returns backward's unit gradients: a unit's new grads + the
    previous unit's fp32 reduce-scatter input."""
    block_params = _block_params(cfg)
    per_block = sum(block_params.values())
    blocks = cfg.n_layer if not reshard_after_forward else min(2 * unit_blocks, cfg.n_layer)
    float8 = sum(block_params[f"{name}.weight"] for name in float8_gathered)
    gathered = (n_params - cfg.n_layer * per_block) * p + blocks * (per_block * p - float8 * (p - 1))
    return gathered, unit_blocks * per_block * (p + 4)


def _block_kinds(ckpt_cfg: CheckpointingConfig, n_layer: int) -> list[str]:
    """What each block keeps for backward under the policy: kept, recomputed (its input only) or selective."""
    selective = ckpt_cfg.policy == CheckpointPolicy.selective
    return ["selective" if selective else "recomputed" if rec else "kept"
            for rec in recomputed_blocks(ckpt_cfg, n_layer)]


def _activations(micro: _MicroBatch, kinds: list[str]) -> tuple[list[int], int]:
    """Saved for backward: each block's bytes, and the embedding's and final norm's."""
    cfg, N, p, a = micro.cfg, micro.tokens, micro.p, micro.a
    # Autocast caches each weight's low-precision copy until the forward + loss region ends: with the loss's peak
    # inside that region, every block holds the copies of its linears' weights then, whatever the policy.
    weights = sum(_block_params(cfg)[f"{name}.weight"] for name in BLOCK_LINEARS)
    per_layer = [micro.block(k) + (weights * a if micro.autocast else 0) for k in kinds]
    dropout_mask = (1 if micro.device == "cuda" else p) if cfg.dropout > 0 else 0
    # Embedding saves the token ids (int64) and learned positions; the final norm what _norm_bytes says.
    positions = micro.seq_len * 8 if cfg.position == PositionEncoding.learned else 0
    other = N * 8 + positions + N * cfg.n_embd * dropout_mask + N * _norm_bytes(cfg, p, micro.stats, micro.device)
    return per_layer, other


def _loss_workspace(micro: _MicroBatch, loss_impl: str, chunk_bytes: int | None, low_memory: bool) -> int:
    """The loss, beyond the activations: ln_f's output (hidden, param dtype) and the loss's own tensors."""
    C, V, N, p, a = micro.cfg.n_embd, micro.cfg.vocab_size, micro.tokens, micro.p, micro.a
    hidden = N * C * p + (N * C * a if a != p else 0)  # + its autocast copy
    if loss_impl != "fused":
        # F.cross_entropy on full logits: at log_softmax's backward, its fp32 output (saved), the incoming
        # grad and the outgoing grad coexist (12·N·V), with model.logit_softcap beside tanh's fp32 output (saved:
        # 16·N·V); autocast saves a low-precision copy of the head.
        per_logit = 16 if micro.cfg.logit_softcap is not None else 12
        return hidden + per_logit * N * V + (V * C * a if micro.autocast else 0)
    # Both gradients are made in forward and kept for backward, which scales them in place.
    cast = V * C * a if a != p else 0  # the weight's autocast copy
    if low_memory:  # row chunks in the memory grad_weight and the block take later; blocks of all N rows
        cols = min(V, fitting(chunk_bytes or N * C * a, N, micro.compute))
        saved = N * C * a + V * C * p
        forward = N * cols * a + N * 8 + cast + (cols * C * a if a != p else 0)
    else:  # row chunks beside the fp32 accumulator; grad_weight made after the workspace is gone
        rows = min(N, fitting(chunk_bytes or DEFAULT_CHUNK_BYTES, V, micro.compute))
        saved = N * C * a + V * C * 4
        forward = max(rows * V * a, V * C * p) + N * 8 + cast
    return hidden + saved + forward


def _backward_transient(micro: _MicroBatch, last_kind: str) -> int:
    """The top of backward in the last block: incoming grad, the activation's gradients (MLP_WIDTHS' grads), the
    block's recomputed activations, and the head's gradient produced by the loss (the tied head's before the
    embedding's is added). selective reruns the activation there (then, smaller, each norm). Eager float8 linears
    cast there."""
    cfg, N, p, a = micro.cfg, micro.tokens, micro.p, micro.a
    C, V, widths = cfg.n_embd, cfg.vocab_size, MLP_WIDTHS[cfg.mlp]
    rerun = N * widths["rerun"] * cfg.mlp_hidden * a
    recompute = {"recomputed": micro.block("kept"), "selective": rerun, "kept": 0}[last_kind]
    torchao_eager = not micro.compiled and micro.float8_kernels == Float8Kernels.torchao
    mlp_grads = max(N * widths["grads"] * cfg.mlp_hidden * a,
                    _float8_casts(cfg, N, micro.float8_linears, a) if torchao_eager else 0)
    return N * C * p + mlp_grads + recompute + V * C * p


def _muon_batches(shapes: list[tuple[int, int]], optimizer_impl: str) -> list[tuple[tuple, int]]:
    """(shape, matrices) of each batch Muon orthogonalizes together (newton_schulz.batches): the matrices of one
    shape, or one each under loop."""
    if optimizer_impl == "loop":
        return [(shape, 1) for shape in shapes]
    return [(shape, shapes.count(shape)) for shape in dict.fromkeys(shapes)]


def _muon_transient(batches: list[tuple[tuple, int]], precision: Precision, optimizer_impl: str,
                    world_size: int = 1, sharded: bool = False) -> int:
    """The largest batch's Muon buffers, one batch at a time (newton_schulz.Exchange): its bf16 Newton–Schulz input X
    (the momentum pass's output), what Newton–Schulz works in beside it (newton_schulz.workspace_bytes). Under ddp X is
    padded to a whole share per rank, the rank orthogonalizes its share and the results are all-gathered into a
    second X; under fsdp (approximately) X is the rank's row blocks, the owner's whole matrices are gathered into
    a copy that Newton–Schulz works in, and the results go back through two X-sized buffers. The torch path first
    holds its fp32 Nesterov mix (4 B an element) beside X, and without masters an fp32 copy of the batch's params
    beside the result for the update."""
    peaks = [0]
    for (rows, cols), count in batches:
        share = -(-count // world_size)
        elements = share * world_size * (-(-rows // world_size) if sharded else rows) * cols
        x = 2 * elements
        ns = newton_schulz.workspace_bytes((rows, cols), share)
        if sharded:
            ns += 2 * share * rows * cols + x
        elif world_size > 1:
            ns += x
        torch_path = optimizer_impl != "fused"
        no_master = torch_path and precision.param_dtype.itemsize != 4 and not precision.master_weights
        peaks.append(x + max(ns, 2 * x if torch_path else 0, 2 * x if no_master else 0))
    return max(peaks)


def _optimizer_transient(groups: list[tuple[list[int], bool]], precision: Precision, optimizer_impl: str,
                         padded: int, grads: int, muon: list[tuple[tuple, int]], muon_padded: int = 0,
                         world_size: int = 1, sharded: bool = False) -> int:
    """Optimizer step temporaries. The fused step reads the grads in place: none (but Muon's buffers). loop and
    foreach first gather autograd's grads into the flat buffer, a side's bucket at a time (both exist for that copy,
    the side's autograd grads freed after it; not with fp32 main grads, which hooks add into the buffer as they
    come), then make fp32 grad copies, and for AdamW sqrt(v) and the update per group (groups: AdamW's), for Muon its
    batches' buffers (`muon`: _muon_batches; `muon_padded` of the padded elements are Muon's), AdamW's side first."""
    muon_transient = _muon_transient(muon, precision, optimizer_impl, world_size, sharded)
    if optimizer_impl == "fused":
        return muon_transient
    p, g = precision.param_dtype.itemsize, precision.grad_dtype.itemsize
    gathered = grads * max(padded - muon_padded, muon_padded) // padded if optimizer_impl != "torch" and g == p else 0
    largest = max([sum(_padded(n) for n in numels) if optimizer_impl == "foreach" else max(numels)
                   for numels, _ in groups if numels] or [0])
    upcast = 4 * padded if g != 4 else 0
    low_no_master = 4 * (padded - muon_padded) if p != 4 and not precision.master_weights else 0
    return max(gathered, upcast + max(low_no_master + 8 * largest, muon_transient))


@dataclass(frozen=True)
class Candidate:
    """One way to run the step, all the memory model reads of it: the model and its precision, the micro-batch and the
    recompute policy (the plan tries one candidate per pair), the kernels, and how the job is spread. A micro-batch
    is `micro_batch` sequences of model.block_size tokens."""

    model: ModelConfig
    precision: Precision
    micro_batch: int
    policy: CheckpointingConfig
    grad_accum: int = 1  # > 1: the grads are there through the forward and backward of the later micro-batches
    loss_impl: str = "fused"  # fused | torch, as resolved for the device
    chunk_bytes: int | None = None  # loss.chunk_bytes
    loss_low_memory: bool = False  # loss.low_memory
    optimizer: OptimizerName = OptimizerName.adamw  # muon: one momentum buffer for the hidden matrices
    optimizer_impl: str = "fused"  # fused | foreach | loop | torch, as resolved for the device
    device: str = "cuda"
    compiled: bool = False  # under torch.compile (it changes only what float8 blocks save)
    float8_linears: tuple[str, ...] = ()  # each block's linears that multiply in float8 (the plan's)
    # How the job is spread: `sharded` is FSDP, the persistent state divided by `world_size` plus the gathered units
    # (`fsdp_unit_blocks`, `reshard_after_forward`: distributed's config), their float8 linears' weights gathered in
    # float8 with `float8_all_gather`.
    world_size: int = 1
    sharded: bool = False
    fsdp_unit_blocks: int = DistributedConfig.fsdp_unit_blocks
    reshard_after_forward: bool = DistributedConfig.reshard_after_forward
    float8_all_gather: bool = False


def predict(c: Candidate) -> MemoryEstimate:
    """Predicted memory of one training step of candidate `c`. Muon keeps one momentum buffer for the hidden
    matrices in place of Adam's two, and orthogonalizes them a batch of one shape at a time (under ddp and fsdp each
    rank a share of it)."""
    model_cfg, precision, optimizer_impl, world_size, sharded = (c.model, c.precision, c.optimizer_impl, c.world_size,
                                                                 c.sharded)
    p, g = precision.param_dtype.itemsize, precision.grad_dtype.itemsize
    autocast = precision.autocast_dtype is not None
    T = model_cfg.block_size
    micro = _MicroBatch(model_cfg, c.micro_batch * T, T, p, precision.compute_dtype,
                        4 if c.device == "cuda" or autocast else p,  # autocast runs LayerNorm in fp32
                        autocast, c.device, c.float8_linears, c.compiled, precision.float8_kernels)
    groups = param_numels(model_cfg)
    n_params = sum(sum(numels) for numels, _ in groups)
    padded = sum(_padded(n) for numels, _ in groups for n in numels)
    muon_shapes = hidden_shapes(model_cfg) if c.optimizer == OptimizerName.muon else []
    muon_padded = sum(_padded(rows * cols) for rows, cols in muon_shapes)
    adamw_groups = _muon_adamw_numels(model_cfg) if muon_shapes else groups
    weights, grads, masters, adam_m, adam_v, muon_momentum = _persistent_state(precision, n_params, padded,
                                                                              world_size, sharded, muon_padded)
    fsdp_gathered = unit_grads = 0
    notes = []
    if sharded:
        fsdp_gathered, unit_grads = _fsdp_gathered(model_cfg, p, n_params, c.fsdp_unit_blocks, c.reshard_after_forward,
                                                   c.float8_linears if c.float8_all_gather else ())
        notes.append(f"FSDP: persistent state / {world_size}; {c.fsdp_unit_blocks} block(s) per unit, "
                     f"reshard_after_forward={c.reshard_after_forward}")
    kinds = _block_kinds(c.policy, model_cfg.n_layer)
    per_layer, other = _activations(micro, kinds)
    activations = sum(per_layer) + other
    loss_workspace = _loss_workspace(micro, c.loss_impl, c.chunk_bytes, c.loss_low_memory)
    backward_transient = _backward_transient(micro, kinds[-1]) + unit_grads
    optimizer_transient = _optimizer_transient(adamw_groups, precision, optimizer_impl, padded, grads,
                                               _muon_batches(muon_shapes, optimizer_impl), muon_padded, world_size,
                                               sharded)

    # Gradients appear as backward reaches each parameter and all exist only once the activations are
    # gone, except when they were there before: later micro-batches (through the whole step), or fp32 main
    # grads (allocated whole at the first gradient: after the loss's peak, before the blocks' backward).
    accumulated = grads if c.grad_accum > 1 else 0
    main_grads = grads if optimizer_impl != "torch" and g != p else 0
    peak = weights + masters + adam_m + adam_v + muon_momentum + max(
        fsdp_gathered + activations + max(loss_workspace + accumulated,
                                          backward_transient + max(accumulated, main_grads)),
        grads + optimizer_transient)
    return MemoryEstimate(n_params, weights, grads, masters, adam_m, adam_v, per_layer, other, activations,
                          loss_workspace, backward_transient, optimizer_transient, peak, fsdp_gathered, muon_momentum,
                          notes)
