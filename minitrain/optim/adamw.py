"""AdamW with fp32 master weights, dynamic loss scaling and no host synchronisation.

The optimizer is pure bandwidth (~1 FLOP per byte), so its only levers are bytes moved and
kernels launched. Three implementations of one update make each lever visible:

  loop     torch ops one tensor at a time: ~15 launches per parameter tensor
  foreach  torch._foreach_* over tensor lists: launches per op, but every op is a pass over memory
  fused    Triton (adamw_triton.py): norm pass + finalize + one update pass, 3 launches in all

Per parameter dtype, a Bucket (bucket.py) holds fp32 masters (low-precision params only), m and v in
flat buffers owned by the optimizer (layout.py), and says where the step finds the gradients (grads.py).
The model's parameters stay where the model put them.

Each step decides on the device, from the scaled gradients' sum of squares, whether it is skipped,
the norm, the clip coefficient, the bias corrections and the loss-scale update (decision.py). The loop
and foreach steps run in torch (adamw_torch.py), the fused one in Triton: each a callable built once.
What surrounds the step (groups, lr upload, scaler, state_dict) is optimizer.py's, shared with Muon.

Under FSDP2 the parameters are DTensors sharded across ranks: every buffer above is built over
their local shards (the ZeRO-3 layout: each rank updates 1/N of the model), the step reads
p.grad's local shard, and `reduce_sumsq` all-reduces the local sum of squares so the norm and the
skip decision are global.
"""

from minitrain.loss_scale import LossScaling
from minitrain.triton_runtime import check_runnable

from .adamw_torch import AdamWUpdate, TorchStep
from .adamw_triton import AdamWKernel, FusedStep
from .bucket import buckets_by_dtype
from .optimizer import IMPLS, DeviceOptimizer, Numerics, as_groups, dtype_of


class AdamW(DeviceOptimizer):
    """AdamW (decoupled weight decay, bias correction, fp32 math) with optional fp32 masters,
    global-norm clipping and dynamic loss scaling, all decided on the device (optimizer.DeviceOptimizer).
    Per-group lr and weight_decay; betas, eps and max_grad_norm are global.

    numerics: masters, the gradients' dtype, loss scaling and the sum of squares' reduction over ranks
    (optimizer.Numerics).
    """

    def __init__(self, params, lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                 max_grad_norm=1.0, impl="fused", numerics: Numerics = Numerics()):
        if impl not in IMPLS:
            raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
        defaults = {"lr": lr, "weight_decay": weight_decay}
        super().__init__(as_groups(params, defaults), defaults, numerics.loss_scaling)
        self.betas, self.eps, self.max_grad_norm, self.impl = tuple(betas), eps, max_grad_norm, impl
        reduce_sumsq = numerics.reduce_sumsq
        if impl == "fused":
            check_runnable(self._params[0], "AdamW(impl='fused')", "impl='foreach' (optimizer.impl=foreach)")
        self.buckets = buckets_by_dtype(self.param_groups, impl, numerics.master_weights, dtype_of(numerics.grad_dtype))
        self._impl_step = FusedStep([AdamWKernel(self.buckets, self.betas, eps)], self.betas, max_grad_norm,
                                    reduce_sumsq) if impl == "fused" else \
            TorchStep([AdamWUpdate(self.buckets, impl, self.betas, eps)], impl, self.betas, max_grad_norm, reduce_sumsq)
