"""Shared test setup: Triton through its CPU interpreter, wandb quiet, one tokenised corpus per session."""

import os
import signal

# MINITRAIN_TEST_DEVICE=cuda runs the kernel tests on a GPU with compiled kernels (scripts/gpu_suite.sh);
# by default everything runs on the CPU, Triton through its interpreter.
TEST_DEVICE = os.environ.get("MINITRAIN_TEST_DEVICE", "cpu")
os.environ.setdefault("TRITON_INTERPRET", "0" if TEST_DEVICE == "cuda" else "1")  # before triton is imported
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from minitrain.cli import compose_config  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def ctrl_c_as_in_a_terminal() -> None:
    """A child's `preexec_fn`: Ctrl-C's default action. A job a shell starts with `&` (CI may be one) begins with
    SIGINT ignored, and Python keeps it so: a test's SIGINT would then stop nothing."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)

if TEST_DEVICE == "cuda":
    import torch

    torch.set_default_device("cuda")  # the kernel tests' random inputs are made on the GPU


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory) -> Path:
    """One cache dir for the session: the stdlib corpus is tokenised once, then reused by every test."""
    return tmp_path_factory.mktemp("data-cache")


@pytest.fixture
def make_cfg(data_cache, tmp_path):
    """Compose configs/ as `python scripts/train.py` would, with small, fast defaults for tests."""

    def _make(*overrides: str):
        base = [f"data.cache_dir={data_cache}", f"trainer.out_dir={tmp_path / 'run'}", "logger.mode=disabled",
                "trainer.batch_size=8", "model.block_size=64", "trainer.max_steps=10", "trainer.warmup_steps=2",
                "trainer.log_every=5", "trainer.eval_every=10", "trainer.save_every=10", "trainer.eval_batches=2",
                "trainer.sample_tokens=8"]
        return compose_config(base + list(overrides))

    return _make


def fake_gpu(monkeypatch, bf16: bool, name: str = "a fake GPU", memory: int = 80 * 10**9) -> None:
    """torch.cuda answering as a GPU would, for code that only reads a device's type and asks torch.cuda about it.
    `bf16`: whether it computes in bf16; without, it only emulates it (torch's is_bf16_supported() says yes by
    default, no with including_emulation=False: a V100 or a T4)."""
    import types

    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: bf16 or including_emulation)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: types.SimpleNamespace(total_memory=memory))


def round_trip(state):
    """A state_dict as a checkpoint gives it back: saved and loaded."""
    import io

    import torch

    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)
GPT2_VOCAB = 320
# A few standard-library modules: the text of the GPT-2 fixture's tokenizer and of its fine-tuning corpus.
GPT2_TEXTS = ("textwrap.py", "string.py", "bisect.py", "shlex.py", "fnmatch.py", "colorsys.py")


@pytest.fixture(scope="session")
def hf_gpt2(tmp_path_factory) -> Path:
    """A randomly initialised transformers GPT-2 (2 layers, 64 wide, 4 heads, 128 positions, 320 tokens) saved as
    Hugging Face saves it, and beside it a byte-level BPE of the same 320 ids trained on GPT2_TEXTS: what
    model.init_from=<dir> and data.tokenizer=<dir> read. Drawn wide (std 0.3) so that greedy text varies."""
    import sysconfig

    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GPT2Config, GPT2LMHeadModel

    folder = tmp_path_factory.mktemp("hf-gpt2")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=GPT2_VOCAB, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    tokenizer.train_from_iterator([(stdlib / name).read_text() for name in GPT2_TEXTS], trainer=trainer)
    assert tokenizer.get_vocab_size() == GPT2_VOCAB
    tokenizer.save(str(folder / "tokenizer.json"))
    eot = tokenizer.token_to_id("<|endoftext|>")
    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=128, vocab_size=GPT2_VOCAB,
                        initializer_range=0.3, bos_token_id=eot, eos_token_id=eot)
    torch.manual_seed(0)
    GPT2LMHeadModel(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def gpt2_corpus(tmp_path_factory) -> Path:
    """GPT2_TEXTS as text files, for data=files data.paths=<dir>/*.txt."""
    import sysconfig

    folder = tmp_path_factory.mktemp("gpt2-corpus")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in GPT2_TEXTS:
        (folder / f"{name}.txt").write_text((stdlib / name).read_text())
    return folder


def saved_state(path, rank: int = 0) -> dict:
    """A checkpoint directory read whole in this process: {part: state}, the parts stored per rank as `rank`'s."""
    import re
    import tempfile
    import warnings

    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "no process group": one process reads every shard, as meant
        dcp_to_torch_save(path, f"{tmp}/state.pt")
        state = torch.load(f"{tmp}/state.pt", weights_only=False)
    own = f"_rank{rank}"
    return {k.removesuffix(own): v for k, v in state.items() if not re.search(r"_rank\d+$", k) or k.endswith(own)}


def train_steps(model, opt, loss_fn, B: int, T: int, steps: int = 2, accum: int = 1, autocast=None) -> None:
    """`steps` optimizer steps of `accum` random micro-batches each, the loss over the model's hidden states and its
    head: the whole step whose live bytes the memory tests set beside the model's prediction."""
    import contextlib

    import torch

    for _ in range(steps):
        for _ in range(accum):
            tokens = torch.randint(0, model.cfg.vocab_size, (B, T + 1))
            with autocast or contextlib.nullcontext():
                loss = loss_fn(model.forward_hidden(tokens[:, :-1]).flatten(0, 1), model.lm_head_weight,
                               tokens[:, 1:].flatten())
            loss.backward()
            del loss
        opt.step()
        opt.zero_grad()


def run_script(name: str, argv, monkeypatch, capsys) -> tuple[int, str, str]:
    """`python scripts/NAME.py ARGV` as a user runs it (its own __main__, in this process): exit code, stdout, stderr."""
    import runpy
    import sys

    script = REPO / "scripts" / f"{name}.py"
    capsys.readouterr()  # what came before
    monkeypatch.setattr(sys, "argv", [str(script), *map(str, argv)])
    try:
        runpy.run_path(str(script), run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def assert_bit_identical(a, b) -> None:
    """Two lists of tensors hold the same bits (0-dim tensors compared by value)."""
    import torch

    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x.view(torch.uint8) if x.dim() else x, y.view(torch.uint8) if y.dim() else y)


def llama_state_as_minitrain(theirs, n_layer: int) -> dict:
    """A transformers Llama's (or Qwen3's) parameters under minitrain's names, mapped by hand in the tests (not by
    minitrain/hf.py, which the tests check): q, k, v stacked into c_attn, gate then up into c_fc."""
    import torch

    t = {name: p.detach() for name, p in theirs.named_parameters()}
    mine = {"wte.weight": t["model.embed_tokens.weight"], "ln_f.weight": t["model.norm.weight"],
            "lm_head.weight": t["lm_head.weight"]}
    for i in range(n_layer):
        layer, block = f"model.layers.{i}", f"blocks.{i}"
        mine |= {f"{block}.ln_1.weight": t[f"{layer}.input_layernorm.weight"],
                 f"{block}.attn.c_attn.weight": torch.cat([t[f"{layer}.self_attn.{p}_proj.weight"] for p in "qkv"]),
                 f"{block}.attn.c_proj.weight": t[f"{layer}.self_attn.o_proj.weight"],
                 f"{block}.ln_2.weight": t[f"{layer}.post_attention_layernorm.weight"],
                 f"{block}.mlp.c_fc.weight": torch.cat([t[f"{layer}.mlp.gate_proj.weight"],
                                                        t[f"{layer}.mlp.up_proj.weight"]]),
                 f"{block}.mlp.c_proj.weight": t[f"{layer}.mlp.down_proj.weight"]}
        if f"{layer}.self_attn.q_norm.weight" in t:  # Qwen3's QK-norm
            mine |= {f"{block}.attn.q_norm.weight": t[f"{layer}.self_attn.q_norm.weight"],
                     f"{block}.attn.k_norm.weight": t[f"{layer}.self_attn.k_norm.weight"]}
    return mine

