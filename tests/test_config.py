import pytest
from hydra.errors import ConfigCompositionException
from omegaconf.errors import OmegaConfBaseException

from minitrain.config import ConfigError, compose_config, resolve


def test_defaults_resolve():
    cfg = resolve(compose_config(["trainer.out_dir=."]))
    assert cfg.model.name == "tiny" and cfg.optimizer.impl.value == "auto"
    # the defaults a user meets are settled per device by the plan
    assert (cfg.precision.name, cfg.checkpointing.policy.value, cfg.trainer.compile, cfg.trainer.micro_batch) == \
        ("auto", "auto", "auto", "auto") and cfg.trainer.warmup_steps is None


@pytest.mark.parametrize("group", ["model=gpt2-124m", "model=gpt2-1.5b", "precision=bf16", "precision=fp16",
                                   "precision=bf16_no_master", "precision=amp_bf16", "precision=fp32", "checkpointing=full",
                                   "checkpointing=auto", "checkpointing=selective", "checkpointing=every_k",
                                   "loss=fused", "data=files data.paths=x"])
def test_every_option_composes(make_cfg, group):
    resolve(make_cfg(*group.split()))


@pytest.mark.parametrize("override, names", [
    ("trainer.bogus=1", "bogus"),
    ("+model.colour=red", "colour"),
])
def test_unknown_key_fails_naming_it(make_cfg, override, names):
    with pytest.raises((ConfigCompositionException, OmegaConfBaseException), match=names):
        resolve(make_cfg(override))


@pytest.mark.parametrize("override, names", [
    ("trainer.max_steps=lots", "max_steps"),
    ("precision.param_dtype=fp8", "param_dtype"),
    ("optimizer.impl=magic", "impl"),
])
def test_bad_type_fails_naming_key(make_cfg, override, names):
    with pytest.raises((ConfigCompositionException, OmegaConfBaseException)) as err:
        resolve(make_cfg(override))
    assert names in str(err.value) + str(err.value.__cause__)


@pytest.mark.parametrize("overrides, names", [
    (["model.n_head=5"], "model.n_embd"),
    (["trainer.batch_size=10", "trainer.micro_batch=3"], "trainer.micro_batch: 3 does not divide"),
    (["trainer.batch_size=8", "trainer.micro_batch=16"], "trainer.micro_batch: 16 is larger than"),
    (["trainer.micro_batch=many"], "trainer.micro_batch"),
    (["trainer.compile=sometimes"], "trainer.compile"),
    (["trainer.memory_budget=1.5"], "trainer.memory_budget"),
    (["trainer.max_skipped_steps=0"], "trainer.max_skipped_steps"),
    (["trainer.warmup_steps=11"], "trainer.warmup_steps"),
    (["trainer.max_steps=0"], "trainer.max_steps"),
    (["trainer.min_lr=1"], "trainer.min_lr"),
    (["trainer.lr=0"], "trainer.lr:"),
    (["trainer.lr=-1e-3", "trainer.min_lr=-1e-3"], "trainer.lr:"),
    (["trainer.seed=-1"], "trainer.seed"),
    (["checkpointing.policy=every_k", "checkpointing.every_k=9"], "checkpointing.every_k"),
    (["checkpointing.policy=every_k", "checkpointing.every_k=0"], "checkpointing.every_k"),
    (["precision=bf16", "optimizer.impl=torch"], "optimizer.impl"),
    (["precision=fp32", "precision.master_weights=true"], "precision.master_weights"),
    (["data.vocab_size=100"], "data.vocab_size"),
    (["data=files"], "data.paths"),
    (["loss.chunk_bytes=0"], "loss.chunk_bytes"),
    (["trainer.compile_mode=fastest"], "trainer.compile_mode"),
    (["trainer.compile=true", "trainer.compile_mode=reduce-overhead", "distributed=ddp"], "trainer.compile_mode"),
])
def test_bad_value_fails_naming_key(make_cfg, overrides, names):
    with pytest.raises(ConfigError, match=names.replace(".", r"\.")):
        resolve(make_cfg(*overrides))
