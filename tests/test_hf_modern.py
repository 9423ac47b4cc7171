"""Hugging Face's Llama and Qwen3 layouts in and out: a run of the modern block (rope + rmsnorm + swiglu + an untied
head, no biases; and qk_norm) exported, loaded by transformers with our logits and greedy text, and imported back
tensor for tensor; a transformers Llama/Qwen3 imported with its logits; every block option without a transformers
counterpart refused by scripts/export_hf.py, and every config.json field the block cannot compute refused on import."""

import json
import shutil

import pytest
import torch

from minitrain import hf
from minitrain.checkpoint import JOB_INFO
from minitrain.cli import compose_config
from minitrain.data.tokenizer import pretrained_tokenizer
from minitrain.errors import ConfigError
from minitrain.generate import Sampling, generate
from minitrain.model import GPT
from minitrain.model_config import ModelConfig
from minitrain.trainer import Trainer
from minitrain.weights import open_weights

from conftest import GPT2_VOCAB
from test_hf import export_hf_py

transformers = pytest.importorskip("transformers")

LLAMA_RUN = ("model.position=rope", "model.rope_base=500", "model.norm=rmsnorm", "model.mlp=swiglu",
             "model.tie_head=false", "model.bias=false")
CLASSES = {"llama": transformers.LlamaForCausalLM, "qwen3": transformers.Qwen3ForCausalLM}


def ids(n=2, length=40, rows=GPT2_VOCAB, seed=0):
    return torch.randint(0, rows, (n, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def modern_run(request, tmp_path_factory, data_cache, gpt2_corpus, hf_gpt2):
    """A run of the Llama block (with qk_norm: Qwen3's) trained 3 steps from scratch, on GPT-2's tokenizer of 320
    ids padded to 384 rows (head_vocab 320, 64 of padding the export leaves out), at head size 16: its dir and
    trainer."""
    run = tmp_path_factory.mktemp(f"run-{request.param}")
    cfg = compose_config([f"data.cache_dir={data_cache}", f"trainer.out_dir={run}", "logger.mode=disabled",
                          "trainer.batch_size=4", "model.block_size=64", "trainer.max_steps=3",
                          "trainer.warmup_steps=1", "trainer.eval_every=3", "trainer.save_every=3",
                          "trainer.eval_batches=1", "trainer.sample_tokens=0", "data=files",
                          f"data.paths={gpt2_corpus}/*.txt", "data.val_fraction=0.05", f"data.tokenizer={hf_gpt2}",
                          "model.vocab_size=384", "model.head_vocab=320",
                          "model.n_layer=2", "model.n_head=4", "model.n_embd=64", "trainer.lr=3e-2", *LLAMA_RUN,
                          f"model.qk_norm={request.param == 'qwen3'}"])
    trainer = Trainer(cfg, progress=False)
    trainer.fit()
    return request.param, run, trainer


def test_a_modern_run_exports_as_transformers_model_with_our_logits_and_greedy_text(modern_run, tmp_path,
                                                                                     monkeypatch, capsys):
    """scripts/export_hf.py: config.json names the class and every field that decides the function (rope_theta,
    rms_norm_eps, key/value heads, the MLP's width, the untied head); transformers' from_pretrained (AutoModel, by
    model_type) computes our logits within 1e-5 in fp32, and its greedy continuation is ours (our KV cache, its
    own). Imported back, every tensor and the block's options are the run's."""
    kind, run, trainer = modern_run
    code, out, err = export_hf_py(monkeypatch, capsys, run, tmp_path / "out")
    assert (code, err) == (0, "") and out.startswith("exported ")
    config = json.loads((tmp_path / "out" / hf.CONFIG).read_text())
    expected = {"architectures": [CLASSES[kind].__name__], "model_type": kind, "hidden_act": "silu",
                "rope_theta": 500.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "num_key_value_heads": 4,
                "num_attention_heads": 4, "head_dim": 16, "max_position_embeddings": 64, "vocab_size": GPT2_VOCAB,
                "intermediate_size": 192, "hidden_size": 64, "num_hidden_layers": 2, "attention_bias": False}
    assert {k: config[k] for k in expected} == expected
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(theirs) is CLASSES[kind] and theirs.config.rope_parameters["rope_theta"] == 500.0
    model = trainer.model.eval()
    idx = ids(length=64)
    with torch.no_grad():
        torch.testing.assert_close(theirs(idx).logits, model(idx), rtol=0, atol=1e-5)
        greedy = theirs.generate(idx[:, :8], do_sample=False, max_new_tokens=24, min_new_tokens=24,
                                 attention_mask=torch.ones_like(idx[:, :8]))
    assert torch.equal(generate(model, idx[:, :8], 24, Sampling(temperature=0)).tokens, greedy)
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "out").model_max_length == 64

    again = open_weights(str(tmp_path / "out"))
    block = ("position", "rope_base", "norm", "qk_norm", "mlp", "tie_head", "bias", "logit_softcap", "n_layer",
             "n_head", "n_embd", "block_size", "head_vocab")
    assert [getattr(again.cfg, k) for k in block] == [getattr(model.cfg, k) for k in block]
    assert again.cfg.vocab_size == 320  # the export's 320 rows, padded to a multiple of 64 again
    state = model.state_dict()
    assert again.state.keys() == state.keys()
    for name, tensor in again.state.items():
        assert torch.equal(tensor, state[name][:320] if name in ("wte.weight", "lm_head.weight") else state[name]), name
    assert again.tokenizer.to_str() == trainer.data.tokenizer.to_str()


def transformers_checkpoint(folder, kind, hf_gpt2, **config):
    """A random transformers Llama or Qwen3 (wide draws, norms included) of 300 tokens (padded to 320 on import),
    rope base 700 (`config`: other fields), saved as Hugging Face saves it, with GPT-2's tokenizer beside it."""
    fields = {**dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=4, vocab_size=300, max_position_embeddings=48, rope_theta=700.0,
                     tie_word_embeddings=False, **({"head_dim": 16} if kind == "qwen3" else {})), **config}
    torch.manual_seed(0)
    model = CLASSES[kind](getattr(transformers, f"{CLASSES[kind].__name__[:-len('ForCausalLM')]}Config")(**fields))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    model.save_pretrained(folder)
    shutil.copy(hf_gpt2 / "tokenizer.json", folder / "tokenizer.json")
    return model.eval()


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_model_init_from_a_llama_or_qwen3_builds_our_block_with_their_logits(kind, hf_gpt2, tmp_path):
    """model.init_from=DIR with no block option set (GPT-2's defaults) takes the weights' block: rope at their base,
    rmsnorm, swiglu, an untied head, no biases, qk_norm for Qwen3; the embedding's and head's rows past the 300 tokens
    are zero padding outside the head; logits within 1e-5 of transformers'; the weights' own tokenizer."""
    theirs = transformers_checkpoint(tmp_path / kind, kind, hf_gpt2)
    cfg = hf.settle_shape(ModelConfig(init_from=str(tmp_path / kind), block_size=40))
    assert cfg.describe_block() == ("rope positions (base 700), rmsnorm, " + "qk_norm, " * (kind == "qwen3") +
                                    "swiglu MLP, untied head")
    assert (cfg.bias, cfg.vocab_size, cfg.head_vocab, cfg.block_size) == (False, 320, 300, 40)
    torch.manual_seed(1)  # random weights first: what the import leaves unwritten would show
    model = GPT(cfg)
    hf.load_weights(model)
    assert model.wte.weight[300:].abs().sum() == 0 and model.lm_head.weight[300:].abs().sum() == 0
    idx = ids(length=40, rows=300)
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(idx), theirs(idx).logits, rtol=0, atol=1e-5)
    opened = open_weights(str(tmp_path / kind))
    assert opened.tokenizer.to_str() == pretrained_tokenizer(str(hf_gpt2)).to_str()
    assert torch.equal(opened.state["blocks.1.attn.c_attn.weight"], model.state_dict()["blocks.1.attn.c_attn.weight"])


def test_a_fine_tune_of_a_qwen3_starts_at_transformers_loss_with_its_tokenizer(make_cfg, hf_gpt2, gpt2_corpus,
                                                                            tmp_path):
    """As a run reads it (model.init_from=DIR alone, with the weights' own tokenizer, which data.tokenizer then
    defaults to): the plan's block is Qwen3's, and the first batch's loss is transformers'."""
    theirs = transformers_checkpoint(tmp_path / "qwen3", "qwen3", hf_gpt2, vocab_size=GPT2_VOCAB)
    trainer = Trainer(make_cfg(f"model.init_from={tmp_path / 'qwen3'}", "data=files", f"data.paths={gpt2_corpus}/*.txt",
                               "data.val_fraction=0.05", "model.block_size=48"), progress=False)
    assert trainer.plan.model.describe_block() == "rope positions (base 700), rmsnorm, qk_norm, swiglu MLP, untied head"
    assert trainer.data.tokenizer.to_str() == pretrained_tokenizer(str(hf_gpt2)).to_str()
    x, y = trainer.train_batches.get(0)
    ids = torch.cat([x, y[:, -1:]], 1)
    with torch.no_grad():
        torch.testing.assert_close(trainer.forward_loss(x, y), theirs(ids, labels=ids).loss, rtol=0, atol=1e-5)


def edited_checkpoint(source, folder, **changes):
    """A copy of the transformers checkpoint `source` with config.json's fields changed (None: removed)."""
    shutil.copytree(source, folder)
    config = {**json.loads((folder / hf.CONFIG).read_text()), **changes}
    (folder / hf.CONFIG).write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    return folder


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory, hf_gpt2):
    folder = tmp_path_factory.mktemp("llama") / "llama"
    transformers_checkpoint(folder, "llama", hf_gpt2)
    return folder


def test_a_transformers_4_config_imports_its_top_level_rope_theta(llama_dir, tmp_path):
    """transformers 4 wrote the rope base as a top-level rope_theta (Llama 3's 500000) and no rope_parameters;
    transformers 5 still reads it, and so does the import: the block's base, and transformers' logits within 1e-5."""
    folder = edited_checkpoint(llama_dir, tmp_path / "v4", rope_parameters=None, rope_theta=500000.0)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    assert theirs.config.rope_parameters["rope_theta"] == 500000.0
    weights = open_weights(str(folder))
    assert weights.cfg.rope_base == 500000.0
    idx = ids(length=40, rows=300)
    with torch.no_grad():
        torch.testing.assert_close(weights.build("cpu")(idx), theirs(idx).logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("changes, message", [
    (dict(num_key_value_heads=2), "num_key_value_heads=2, where minitrain's attention has a key and value head per "
                                  "query head (num_attention_heads=4)"),
    (dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 700.0}), "rope_parameters={'rope_type': "
     "'linear', 'factor': 2.0, 'rope_theta': 700.0}, where minitrain's rope is the default one"),
    (dict(rope_scaling={"type": "linear", "factor": 2.0}), "rope_scaling={'type': 'linear', 'factor': 2.0}, where "
                                                            "minitrain's block computes None"),
    (dict(attention_bias=True), "attention_bias=True, where minitrain's block computes False"),
    (dict(mlp_bias=True), "mlp_bias=True, where minitrain's block computes False"),
    (dict(tie_word_embeddings=True), "tie_word_embeddings=True, where minitrain's block computes False"),
    (dict(hidden_act="gelu"), "hidden_act='gelu', where minitrain's block computes 'silu'"),
    (dict(rms_norm_eps=1e-5), "rms_norm_eps=1e-05, where minitrain's block computes 1e-06"),
    (dict(pretraining_tp=2), "pretraining_tp=2, where minitrain's block computes 1"),
    (dict(head_dim=32), "head_dim=32, where minitrain's heads are hidden_size / num_attention_heads = 16 wide"),
    (dict(intermediate_size=256), "intermediate_size=256, where minitrain's SwiGLU MLP at hidden_size=64 is 192 wide"),
    (dict(layer_types=["full_attention", "sliding_attention"]), "layer_types=['full_attention', 'sliding_attention'], "
                                                                "where minitrain's layers all attend"),
    (dict(hidden_size=None), "model_type='llama' is not GPT-2 ('gpt2') and has no hidden_size, which a "
                             "LlamaForCausalLM config.json holds"),
    (dict(model_type="mistral"), "model_type='mistral' is not GPT-2 ('gpt2'), Llama ('llama') or Qwen3 ('qwen3')"),
], ids=lambda value: ",".join(value) if isinstance(value, dict) else "")
def test_a_config_field_the_block_cannot_compute_is_refused_in_one_line_naming_it(llama_dir, tmp_path, changes,
                                                                                  message):
    folder = edited_checkpoint(llama_dir, tmp_path / "edited", **changes)
    with pytest.raises(ConfigError) as refused:
        open_weights(str(folder))
    assert str(refused.value).startswith(f"{folder / hf.CONFIG}: {message}")
    assert "\n" not in str(refused.value)


def test_a_qwen3_with_sliding_windows_or_the_default_head_dim_is_refused(llama_dir, tmp_path):
    """Qwen3's own fields: use_sliding_window, and head_dim absent meaning transformers' default of 128."""
    sliding = edited_checkpoint(llama_dir, tmp_path / "sliding", model_type="qwen3", use_sliding_window=True)
    with pytest.raises(ConfigError, match=r"config.json: use_sliding_window=True, where minitrain's block computes"):
        open_weights(str(sliding))
    no_head_dim = edited_checkpoint(llama_dir, tmp_path / "no-head-dim", model_type="qwen3", head_dim=None)
    with pytest.raises(ConfigError, match=r"config.json: head_dim=128, where minitrain's heads are"):
        open_weights(str(no_head_dim))


def test_a_llama_checkpoint_missing_or_with_extra_tensors_is_refused(llama_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    for name, edit in [("missing", lambda t: t.pop("model.layers.1.self_attn.k_proj.weight")),
                       ("extra", lambda t: t.update({"model.layers.1.self_attn.q_proj.bias": torch.zeros(64)}))]:
        folder = edited_checkpoint(llama_dir, tmp_path / name)
        tensors = load_file(folder / hf.WEIGHTS)
        edit(tensors)
        save_file(tensors, folder / hf.WEIGHTS, metadata={"format": "pt"})
        with pytest.raises(ConfigError) as refused:
            open_weights(str(folder))
        assert str(refused.value) == (
            f"{folder / hf.WEIGHTS} has no model.layers.1.self_attn.k_proj.weight: it is not the checkpoint its "
            "config.json describes" if name == "missing" else
            f"{folder / hf.WEIGHTS} holds model.layers.1.self_attn.q_proj.bias, which the LlamaForCausalLM of its "
            "config.json has not (1 such tensors)")


def test_a_rope_base_with_gpt2_weights_is_refused(hf_gpt2):
    """GPT-2's positions are learned: a rope base given with its weights would be silently unused."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig),
                                              {"init_from": str(hf_gpt2), "rope_base": 500.0}))
    with pytest.raises(ConfigError) as refused:
        hf.settle_shape(cfg)
    assert str(refused.value) == (f"model.rope_base=500 conflicts with {hf_gpt2}'s weights ({hf_gpt2 / hf.CONFIG}): "
                                  "GPT-2 has learned positions, no rotary; leave model.rope_base out")


@pytest.mark.parametrize("weights, override, message", [
    ("llama", "mlp=relu2", "model.mlp=relu2 conflicts with {}'s weights ({}), whose block has model.mlp=swiglu"),
    ("llama", "logit_softcap=30.0", "model.logit_softcap=30.0 conflicts with {}'s weights ({}), whose block has "
                                    "model.logit_softcap=null"),
    ("llama", "qk_norm=True", "model.qk_norm=true conflicts with {}'s weights ({}), whose block has "
                              "model.qk_norm=false"),
    ("llama", "rope_base=999.0", "model.rope_base=999.0 conflicts with {}'s weights ({}), whose block has "
                                 "model.rope_base=700.0"),
    ("gpt2", "norm=rmsnorm", "model.norm=rmsnorm conflicts with {}'s weights ({}), whose block has "
                             "model.norm=layernorm"),
    ("gpt2", "position=rope", "model.position=rope conflicts with {}'s weights ({}), whose block has "
                              "model.position=learned"),
    ("gpt2", "tie_head=False", "model.tie_head=false conflicts with {}'s weights ({}), whose block has "
                               "model.tie_head=true"),
])
def test_a_block_option_set_against_the_weights_is_refused_naming_it(llama_dir, hf_gpt2, weights, override,
                                                                     message):
    """With model.init_from the block comes from the weights: an option left at GPT-2's default takes the weights'
    value (above), one set to a third value is refused."""
    from omegaconf import OmegaConf

    folder = llama_dir if weights == "llama" else hf_gpt2
    key, value = override.split("=")
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig),
                                              {"init_from": str(folder), key: value}))
    with pytest.raises(ConfigError) as refused:
        hf.settle_shape(cfg)
    assert str(refused.value) == message.format(folder, folder / hf.CONFIG) + (
        f"; with model.init_from the block comes from the weights, so leave model.{key} out")


LEARNED = dict(position="learned", rope_base=10000.0)  # a run with learned positions has the default rope base
UNSUPPORTED = [  # (the run's options changed from the Llama block, the option named)
    (dict(mlp="relu2"), "model.mlp=relu2 has no transformers counterpart with model.position=rope (Llama and Qwen3 "
                        "use model.mlp=swiglu)"),
    (dict(mlp="gelu"), "model.mlp=gelu has no transformers counterpart with model.position=rope"),
    (dict(logit_softcap=30.0), "model.logit_softcap=30.0 has no transformers counterpart with model.position=rope "
                               "(Llama and Qwen3 use model.logit_softcap=null)"),
    (dict(norm="layernorm"), "model.norm=layernorm has no transformers counterpart with model.position=rope"),
    (dict(bias=True), "model.bias=true has no transformers counterpart with model.position=rope (Llama and Qwen3 "
                      "use model.bias=false)"),
    (dict(tie_head=True), "model.tie_head=true has no transformers counterpart with model.position=rope"),
    (LEARNED, "model.norm=rmsnorm has no transformers counterpart with model.position=learned "
                               "(GPT-2 uses model.norm=layernorm)"),
    (dict(LEARNED, norm="layernorm", mlp="gelu"), "model.tie_head=false has no transformers counterpart "
                                                             "with model.position=learned"),
    (dict(LEARNED, norm="layernorm", mlp="gelu", tie_head=True, qk_norm=True),
     "model.qk_norm=true has no transformers counterpart with model.position=learned"),
    (dict(LEARNED, norm="layernorm", tie_head=True), "model.mlp=swiglu has no transformers counterpart "
                                                                "with model.position=learned"),
]


@pytest.mark.parametrize("modern_run", ["llama"], indirect=True)
@pytest.mark.parametrize("changes, message", UNSUPPORTED,
                         ids=[",".join(f"{k}={v}" for k, v in changes.items()) for changes, _ in UNSUPPORTED])
def test_export_hf_py_refuses_a_block_without_a_transformers_counterpart_in_one_line(modern_run, tmp_path,
                                                                                    monkeypatch, capsys, changes,
                                                                                    message):
    """The run's checkpoint with its config's block options changed (what a run trained with them saves): exit 2,
    one line naming the option, nothing written."""
    _, run, _ = modern_run
    checkpoint = tmp_path / "checkpoint"
    shutil.copytree(run / "checkpoints" / "latest", checkpoint)
    info = json.loads((checkpoint / JOB_INFO).read_text())
    info["config"]["model"].update(changes)
    (checkpoint / JOB_INFO).write_text(json.dumps(info))
    code, out, err = export_hf_py(monkeypatch, capsys, checkpoint, tmp_path / "out", "--tokenizer", run)
    assert (code, out) == (2, "")
    assert err.startswith(f"error: {message}") and err.endswith(
        "; export supports GPT-2's block and rope + rmsnorm + swiglu + an untied head without biases (Llama; with "
        "qk_norm, Qwen3)\n") and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_zero_initialised_projections_are_only_an_init_and_export(modern_run, tmp_path, monkeypatch, capsys):
    kind, run, _ = modern_run
    checkpoint = tmp_path / "checkpoint"
    shutil.copytree(run / "checkpoints" / "latest", checkpoint)
    info = json.loads((checkpoint / JOB_INFO).read_text())
    info["config"]["model"]["zero_init_proj"] = True
    (checkpoint / JOB_INFO).write_text(json.dumps(info))
    code, _, err = export_hf_py(monkeypatch, capsys, checkpoint, tmp_path / "out", "--tokenizer", run)
    assert (code, err) == (0, "")
    assert json.loads((tmp_path / "out" / hf.CONFIG).read_text())["model_type"] == kind
