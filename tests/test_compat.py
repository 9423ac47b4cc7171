"""minitrain/compat.py, the one home of the libraries' private hooks: each hook against a reference computation (so
that an upgrade that removes or changes one fails here, not silently in a run), and a scan of minitrain/ and
scripts/ that finds a private name of a library used anywhere else."""

from __future__ import annotations

import ast
import importlib
import inspect
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from minitrain import compat
from minitrain.loss_scale import LossScaling, update_rule

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "minitrain"


# -- torch._foreach_* ------------------------------------------------------------------------------------------------

def tensors(seed, shapes=((3,), (2, 5), (4, 1, 3))):
    g = torch.Generator().manual_seed(seed)
    return [torch.rand(s, generator=g) + 0.5 for s in shapes]  # > 0: sqrt and div stay finite


FOREACH_CASES = {  # name: (the foreach call on lists xs, ys, zs; the same per tensor); in place ones return xs
    "foreach_add_": (lambda xs, ys, zs: (compat.foreach_add_(xs, ys, alpha=0.5), xs)[1],
                     lambda x, y, z: x + 0.5 * y),
    "foreach_addcmul_": (lambda xs, ys, zs: (compat.foreach_addcmul_(xs, ys, zs, value=0.3), xs)[1],
                         lambda x, y, z: x + 0.3 * y * z),
    "foreach_copy_": (lambda xs, ys, zs: (compat.foreach_copy_(xs, ys), xs)[1], lambda x, y, z: y),
    "foreach_div": (lambda xs, ys, zs: compat.foreach_div(xs, ys), lambda x, y, z: x / y),
    "foreach_lerp": (lambda xs, ys, zs: compat.foreach_lerp(xs, ys, 0.25), lambda x, y, z: x + 0.25 * (y - x)),
    "foreach_lerp_": (lambda xs, ys, zs: (compat.foreach_lerp_(xs, ys, 0.75), xs)[1],
                      lambda x, y, z: x + 0.75 * (y - x)),
    "foreach_mul_": (lambda xs, ys, zs: (compat.foreach_mul_(xs, torch.tensor(0.9)), xs)[1],  # a 0-d tensor, as
                     lambda x, y, z: x * 0.9),                                                # the optimizers pass
    "foreach_norm": (lambda xs, ys, zs: compat.foreach_norm(xs), lambda x, y, z: torch.linalg.vector_norm(x)),
    "foreach_sqrt": (lambda xs, ys, zs: compat.foreach_sqrt(xs), lambda x, y, z: x.sqrt()),
    "foreach_sub_": (lambda xs, ys, zs: (compat.foreach_sub_(xs, ys), xs)[1], lambda x, y, z: x - y),
    "foreach_zero_": (lambda xs, ys, zs: (compat.foreach_zero_(xs), xs)[1], lambda x, y, z: torch.zeros_like(x)),
}


@pytest.mark.parametrize("name", sorted(FOREACH_CASES))
def test_each_foreach_op_is_torchs_own_and_computes_what_the_per_tensor_op_does(name):
    """The alias is torch's function itself (no wrapper in the step's hot loop), and its result over a list of
    tensors of different shapes is the per-tensor op's."""
    assert getattr(compat, name) is getattr(torch, "_" + name)
    foreach, per_tensor = FOREACH_CASES[name]
    xs, ys, zs = tensors(0), tensors(1), tensors(2)
    want = [per_tensor(x, y, z) for x, y, z in zip(xs, ys, zs)]
    got = foreach(xs, ys, zs)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=0)


def test_foreach_addcmul_takes_a_list_of_0d_tensors_as_muon_passes_its_step():
    xs, os_ = tensors(3), tensors(4)
    step = torch.tensor(-0.01)
    want = [x + step * o for x, o in zip(xs, os_)]
    compat.foreach_addcmul_(xs, os_, [step] * len(xs))
    for x, w in zip(xs, want):
        torch.testing.assert_close(x, w, rtol=1e-6, atol=0)


# -- torch._scaled_mm ------------------------------------------------------------------------------------------------

def test_scaled_mm_is_a_float8_gemm_of_a_row_major_and_a_column_major_operand():
    """y = (a * scale_a) @ (b * scale_b).T + bias, a (M, K) row-major and b (N, K) passed as b.t(): the float8 values
    multiplied exactly and summed in fp32 (CUDA where there is one, else the CPU kernel of torch 2.13)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator().manual_seed(5)
    a = (torch.randn(32, 48, generator=g) * 4).to(torch.float8_e4m3fn).to(device)
    b = (torch.randn(16, 48, generator=g) * 4).to(torch.float8_e4m3fn).to(device)
    scale_a, scale_b = torch.tensor(0.5, device=device), torch.tensor(0.25, device=device)
    bias = torch.randn(16, generator=g).to(device, torch.bfloat16)
    y = compat.scaled_mm(a, b.t(), scale_a, scale_b, bias=bias, out_dtype=torch.bfloat16)
    want = (a.float() * 0.5) @ (b.float() * 0.25).t() + bias.float()
    assert y.dtype == torch.bfloat16 and y.shape == (32, 16)
    torch.testing.assert_close(y.float(), want.to(torch.bfloat16).float(), rtol=1e-2, atol=1e-2)
    no_bias = compat.scaled_mm(a, b.t(), scale_a, scale_b, out_dtype=torch.float32)
    torch.testing.assert_close(no_bias, (a.float() * 0.5) @ (b.float() * 0.25).t(), rtol=1e-5, atol=1e-5)


# -- torch._amp_update_scale_ ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("tracker,found_inf", [(0, False), (1, False), (0, True), (1, True)])
def test_amp_update_scale_runs_the_loss_scale_rule_in_place(tracker, found_inf):
    """Growth 4 and backoff 1/4 (so their order in the call matters), interval 2: a count, a growth, a backoff."""
    rule = LossScaling(growth_factor=4.0, backoff_factor=0.25, growth_interval=2)
    scale, growth_tracker = torch.tensor(2.0**10), torch.tensor(tracker, dtype=torch.int32)
    compat.amp_update_scale_(scale, growth_tracker, torch.tensor(float(found_inf)), rule.growth_factor,
                             rule.backoff_factor, rule.growth_interval)
    assert (scale.item(), growth_tracker.item()) == update_rule(rule, 2.0**10, tracker, found_inf)


# -- torch._C._accelerator_setAllocatorSettings ----------------------------------------------------------------------

def test_set_allocator_settings_reaches_the_allocators_config():
    read = torch._C._accelerator_getAllocatorSettings
    before = read()
    try:
        for on in (True, False):
            compat.set_allocator_settings(f"expandable_segments:{on}")
            assert f"expandable_segments:{on}" in read()
    finally:
        compat.set_allocator_settings(before or "expandable_segments:False")


# -- torch.amp.GradScaler._found_inf_per_device ----------------------------------------------------------------------

@pytest.mark.parametrize("bad", [None, float("inf"), float("nan")])
def test_grad_scaler_found_infs_are_what_unscale_found(bad):
    p = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    scaler.scale(torch.tensor(1.0))  # GradScaler makes its state here
    p.grad = torch.full((4,), 8.0)
    if bad is not None:
        p.grad[2] = bad
    scaler.unscale_(opt)
    flags = compat.grad_scaler_found_infs(scaler, opt)
    assert [f.item() for f in flags] == [0.0 if bad is None else 1.0]
    if bad is None:
        torch.testing.assert_close(p.grad, torch.ones(4))  # unscaled in place: the flags are this unscale's


# -- DTensor._local_tensor -------------------------------------------------------------------------------------------

@pytest.fixture
def one_rank_mesh(tmp_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{tmp_path / 'store'}")
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def test_dtensor_local_tensor_is_the_shard_itself_with_grad_enabled(one_rank_mesh):
    """The shard, the same tensor on every call, written in place through it, and no autograd view of a parameter
    even with grad enabled (DTensor.to_local() would be one)."""
    from torch.distributed.tensor import DTensor, Shard

    shard = torch.arange(6.0)
    p = torch.nn.Parameter(DTensor.from_local(shard, one_rank_mesh, [Shard(0)], run_check=False))
    with torch.enable_grad():
        local = compat.dtensor_local_tensor(p)
        assert local is compat.dtensor_local_tensor(p)
        assert local.grad_fn is None and local.data_ptr() == shard.data_ptr()
        assert p.to_local().grad_fn is not None  # why not the public to_local(): here an autograd view
    with torch.no_grad():
        local.mul_(2.0)
    assert torch.equal(p.full_tensor(), 2.0 * torch.arange(6.0))


# -- torchao: _auto_filter_for_recipe, WeightWithDynamicFloat8CastTensor._tensor -------------------------------------

@pytest.mark.parametrize("recipe, wide, narrow", [
    ("tensorwise", (1024, 4160), (1024, 4096)),  # (N, K): converted only past K 4096 or N 1024
    ("rowwise", (4112, 2048), (4096, 2048)),  # N > 2048 and K > 1024, and past N 4096 or K 2048
])
def test_auto_filter_for_recipe_converts_the_linears_wide_enough_to_gain(recipe, wide, narrow):
    """torchao's filter at its H100 thresholds (float8_linears() turns it into the block's linears): a linear just
    past them is converted, one at them is not, nor one with a dim not divisible by 16, nor one named in
    filter_fqns, nor a module that is no linear."""
    pytest.importorskip("torchao")
    gains = compat.auto_filter_for_recipe(recipe, filter_fqns=["skipped"])
    with torch.device("meta"):
        def linear(n, k):
            return torch.nn.Linear(k, n)

        assert gains(linear(*wide), "mlp.c_fc")
        assert not gains(linear(*narrow), "mlp.c_fc")
        assert not gains(linear(wide[0] + 8, wide[1]), "mlp.c_fc")
        assert not gains(linear(*wide), "blocks.0.skipped")
        assert not gains(torch.nn.LayerNorm(wide[1]), "ln")


def test_float8_weight_tensor_is_what_the_all_gather_weight_wraps():
    pytest.importorskip("torchao")
    from torchao.float8.float8_training_tensor import LinearMMConfig
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    plain = torch.randn(4, 8)
    weight = WeightWithDynamicFloat8CastTensor(plain, LinearMMConfig(), torch.float8_e4m3fn)
    assert compat.float8_weight_tensor(weight) is plain
    assert weight.__tensor_flatten__()[0] == ["_tensor"]  # the one tensor inside: the attribute is the wrapper's data


# -- torch.utils._python_dispatch, torch.utils._pytree ---------------------------------------------------------------

def test_a_dispatch_mode_sees_each_op_and_tree_leaves_finds_its_tensors():
    seen = []

    class Record(compat.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            leaves = compat.tree_leaves((args, kwargs, out))
            seen.append((func, len([t for t in leaves if isinstance(t, torch.Tensor)])))
            return out

    x = torch.ones(3)
    with Record():
        torch.mul(x, 2.0).add_(x)
    assert seen == [(torch.ops.aten.mul.Tensor, 2), (torch.ops.aten.add_.Tensor, 3)]  # 2.0 is wrapped as a tensor
    doubled = x * 2
    leaves = compat.tree_leaves([x, (1, {"k": doubled, "s": "text"}), None])
    assert [id(leaf) for leaf in leaves if isinstance(leaf, torch.Tensor)] == [id(x), id(doubled)]
    assert {1, "text"} <= {leaf for leaf in leaves if not isinstance(leaf, torch.Tensor)}


def test_is_traceable_wrapper_subclass_tells_a_wrapper_from_a_plain_tensor(one_rank_mesh):
    from torch.distributed.tensor import DTensor, Replicate

    assert not compat.is_traceable_wrapper_subclass(torch.ones(2))
    assert compat.is_traceable_wrapper_subclass(DTensor.from_local(torch.ones(2), one_rank_mesh, [Replicate()]))


# -- the fused attention ops -----------------------------------------------------------------------------------------

def test_scaled_dot_product_attention_dispatches_to_one_of_the_fused_attention_ops():
    """What compiled `selective` checkpointing saves is what SDPA runs here (on a CPU: flash_for_cpu), in training."""
    ops = []

    class Record(compat.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(func)
            return func(*args, **(kwargs or {}))

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q, k, v = (torch.randn(2, 4, 64, 32, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    with Record():
        F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert [op for op in ops if op in compat.FUSED_ATTENTION_OPS], ops
    assert all(isinstance(op, torch._ops.OpOverload) for op in compat.FUSED_ATTENTION_OPS)


# -- torch._dynamo ---------------------------------------------------------------------------------------------------

def test_mark_static_address_marks_the_tensor_for_dynamo():
    buffer = torch.zeros(4)
    compat.mark_static_address(buffer)
    assert getattr(buffer, "_dynamo_static_input_type", None) is not None  # where dynamo 2.11-2.13 records it


def test_inductor_counter_reads_inductors_counters():
    from torch._dynamo.utils import counters

    name = "minitrain_test_counter"
    assert compat.inductor_counter(name) == 0
    counters["inductor"][name] += 2
    try:
        assert compat.inductor_counter(name) == 2
    finally:
        del counters["inductor"][name]


def test_every_hook_in_compat_has_its_test():
    """Each name compat.py defines (not the modules it imports) is exercised in this file."""
    source = Path(__file__).read_text()
    names = [name for name, value in vars(compat).items()
             if not name.startswith("_") and not inspect.ismodule(value) and name != "annotations"]
    assert len(names) >= 20
    assert [name for name in names if f"compat.{name}" not in source] == []


# -- the scan: private names of a library only in compat.py ----------------------------------------------------------

def is_private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def library_imports(tree: ast.AST) -> dict[str, str]:
    """What each name a module imports from a library stands for, as a dotted path (alias -> torch.nn.functional)."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                top = alias.name.split(".")[0]
                if top != PACKAGE:  # `import a.b` binds a; `import a.b as c` binds c to a.b
                    names[alias.asname or top] = alias.name if alias.asname else top
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module.split(".")[0] != PACKAGE:
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def defined_names(trees) -> set[str]:
    """Every name the package and its scripts define: functions, classes, arguments, variables, attributes."""
    names = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
    return names


def dotted(node: ast.Attribute) -> tuple[str | None, list[str]]:
    """(the name an attribute chain starts from, the attributes after it): torch._C.x -> ('torch', ['_C', 'x'])."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return (node.id if isinstance(node, ast.Name) else None), parts[::-1]


def resolve(path: str):
    """The object a dotted path names (a module's attribute, an attribute of a class...), or None."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for part in parts[i:]:
                obj = getattr(obj, part)
        except AttributeError:
            return None
        return obj
    return None


def private_uses(tree: ast.AST, ours: set[str]) -> list[tuple[int, str]]:
    """Where `tree` uses a library's private name: an import from a private module or of a private name; a dotted
    path from an imported library through a private part; a private attribute (or getattr/attrgetter string) that
    the package defines nowhere, i.e. a library object's; an assignment over a library's function (a patch)."""
    libraries = library_imports(tree)
    outer = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    found = []  # (line, column, what)

    def add(node, what):
        found.append((node.lineno, node.col_offset, what))

    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and not node.level and node.module.split(".")[0] != PACKAGE:
            if any(map(is_private, node.module.split("."))) or any(is_private(a.name) for a in node.names):
                add(node, f"from {node.module} import {', '.join(a.name for a in node.names)}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if any(map(is_private, alias.name.split("."))):
                    add(node, f"import {alias.name}")
        elif isinstance(node, ast.Attribute) and id(node) not in outer:  # a whole chain, once
            root, parts = dotted(node)
            path = ".".join([libraries.get(root, ""), *parts])
            if root in libraries and any(map(is_private, parts)):
                add(node, path)
            elif root in libraries and isinstance(node.ctx, ast.Store) and callable(resolve(path)):
                add(node, f"{path} = ... (a patch of the library)")
            elif root not in libraries:
                for part in parts:
                    if is_private(part) and part not in ours:
                        add(node, f".{part} (no name of minitrain's)")
        elif isinstance(node, ast.Call) and isinstance(node.func, (ast.Name, ast.Attribute)):
            func = node.func.id if isinstance(node.func, ast.Name) else node.func.attr
            if func in ("getattr", "hasattr", "setattr", "attrgetter"):
                for arg in node.args:
                    if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and is_private(arg.value) \
                            and arg.value not in ours:
                        add(node, f"{func}(..., {arg.value!r})")
    return [(line, what) for line, _, what in sorted(found)]


def test_the_scan_finds_each_kind_of_private_use():
    source = textwrap.dedent("""
        import torch
        import torch._dynamo
        import torch.nn.functional as F
        from operator import attrgetter
        from torch.utils._pytree import tree_leaves
        from torchao.float8 import _auto_filter_for_recipe
        from submitit.local import local

        def f(t, scaler, opt, ours):
            torch._foreach_add_([t], [t])
            torch._C._accelerator_setAllocatorSettings("x")
            F._canonical_mask
            torch.ops.aten._scaled_dot_product_flash_attention.default
            t._local_tensor
            getattr(t, "_tensor")
            attrgetter("_local_tensor")
            local.start_controller = f
            ours._mine, ours.__dict__, torch.ops.aten.mm.default, torch.backends.cuda.matmul.allow_tf32
            torch.backends.cuda.matmul.allow_tf32 = True
            getattr(ours, "_mine")
        """)
    found = [what for _, what in private_uses(ast.parse(source), ours={"_mine"})]
    assert found == [
        "import torch._dynamo", "from torch.utils._pytree import tree_leaves",
        "from torchao.float8 import _auto_filter_for_recipe", "torch._foreach_add_",
        "torch._C._accelerator_setAllocatorSettings", "torch.nn.functional._canonical_mask",
        "torch.ops.aten._scaled_dot_product_flash_attention.default", "._local_tensor (no name of minitrain's)",
        "getattr(..., '_tensor')", "attrgetter(..., '_local_tensor')",
        "submitit.local.local.start_controller = ... (a patch of the library)"], found


def test_private_names_of_libraries_appear_only_in_compat():
    """The rule of minitrain/compat.py: anywhere else in minitrain/ and scripts/, a library's private name (or a
    patch of one of its functions) is a hook nobody listed, that an upgrade can break silently."""
    paths = sorted(p for folder in ("minitrain", "scripts") for p in (REPO / folder).rglob("*.py"))
    trees = {path: ast.parse(path.read_text()) for path in paths}
    ours = defined_names(trees.values())
    found = [f"{path.relative_to(REPO)}:{line}: {what}" for path, tree in trees.items()
             if path != REPO / "minitrain" / "compat.py" for line, what in private_uses(tree, ours)]
    assert found == [], "\n".join(found)
    in_compat = [what for _, what in private_uses(trees[REPO / "minitrain" / "compat.py"], ours)]
    assert "torch._foreach_copy_" in in_compat and "torch._amp_update_scale_" in in_compat  # the scan reads it
