from pathlib import Path

import pytest
import torch
from conftest import REPO
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from minitrain.cli import check_overrides, command_line
from minitrain.config import resolve, schema_keys
from minitrain.cli import compose_config
from minitrain.errors import ConfigError


def test_defaults_resolve():
    cfg = resolve(compose_config(["trainer.out_dir=."]))
    assert cfg.model.name == "tiny" and cfg.optimizer.impl.value == "auto"
    # the defaults a user meets are settled per device by the plan
    assert (cfg.precision.name, cfg.checkpointing.policy.value, cfg.trainer.compile, cfg.trainer.micro_batch) == \
        ("auto", "auto", "auto", "auto") and cfg.trainer.warmup_steps is None


def test_each_data_option_reads_the_source_of_its_own_name():
    """data=<option> sets data.source to the source of that name, one source per option: a source whose value
    repeated another's would be an alias of it (Enum), and its option would silently read the other corpus."""
    from minitrain.config import DataSource

    options = sorted(p.stem for p in (REPO / "configs" / "data").glob("*.yaml"))
    sources = {o: compose_config(["trainer.out_dir=.", f"data={o}"]).data.source for o in options}
    assert {o: (s.name, s.value) for o, s in sources.items()} == {o: (o, o) for o in options}
    assert sorted(source.name for source in DataSource) == options


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
    (["trainer.target_loss=0"], "trainer.target_loss: must be a validation loss > 0 or null, got 0.0"),
    (["trainer.target_loss=-2.5"], "trainer.target_loss: must be a validation loss > 0 or null, got -2.5"),
    (["trainer.target_loss=nan"], "trainer.target_loss: must be a validation loss > 0 or null, got nan"),
    (["trainer.target_loss=inf"], "trainer.target_loss: must be a finite number, got inf"),
    (["trainer.save_every=-1"], "trainer.save_every: must be >= 0"),
    (["trainer.warmup_steps=11"], "trainer.warmup_steps"),
    (["trainer.max_steps=0"], "trainer.max_steps"),
    (["trainer.min_lr=1"], "trainer.min_lr"),
    (["trainer.lr=0"], "trainer.lr:"),
    (["trainer.lr=-1e-3", "trainer.min_lr=-1e-3"], "trainer.lr:"),
    (["trainer.seed=-1"], "trainer.seed"),
    (["trainer.out_dir=${oc.env:MINITRAIN_UNSET_VARIABLE}"],
     "trainer.out_dir: KeyError raised while resolving interpolation: \"Environment variable 'MINITRAIN_UNSET_VARIABLE' not found\""),
    (["trainer.lr=${trainer.nope}"], "trainer.lr: Interpolation key 'trainer.nope' not found"),
    (["optimizer.eps=inf"], "optimizer.eps: must be a finite number, got inf"),  # passes `> 0`: zero updates
    (["trainer.lr=inf"], "trainer.lr: must be a finite number, got inf"),
    (["trainer.out_dir="], "trainer.out_dir: must name the run's directory, got ''"),
    (["trainer.out_dir=' '"], "trainer.out_dir: must name"),
    (["trainer.resume="], "trainer.resume: none, auto or a checkpoint's path, got ''"),
    (["checkpointing.policy=every_k", "checkpointing.every_k=9"], "checkpointing.every_k"),
    (["checkpointing.policy=every_k", "checkpointing.every_k=0"], "checkpointing.every_k"),
    (["precision=bf16", "optimizer.impl=torch"], "optimizer.impl"),
    (["optimizer=muon", "precision=fp32", "optimizer.impl=torch"], "optimizer.impl: torch is the plain-PyTorch AdamW"),
    (["optimizer.muon.lr=0"], "optimizer.muon.lr: must be > 0"),
    (["optimizer.muon.momentum=1.0"], "optimizer.muon.momentum: must be in"),
    (["optimizer.muon.ns_steps=0"], "optimizer.muon.ns_steps: must be in"),
    (["optimizer.muon.ns_coefficients=[3.4,-4.7]"], "optimizer.muon.ns_coefficients: needs the quintic's three"),
    (["optimizer.muon.ns_eps=0"], "optimizer.muon.ns_eps: must be > 0"),
    (["optimizer.muon.weight_decay=-0.1"], "optimizer.muon.weight_decay: must be >= 0"),
    (["optimizer=muon", "optimizer.muon.ns_eps=inf"], "optimizer.muon.ns_eps: must be a finite number, got inf"),
    # a Muon setting without optimizer=muon would train AdamW as if it were not there
    (["optimizer.muon.lr=0.05"], "optimizer.muon.lr: is set, but optimizer=adamw does not use it: add optimizer=muon"),
    (["optimizer.muon.ns_kernel=triton"], "optimizer.muon.ns_kernel: is set, but optimizer=adamw does not use it"),
    (["optimizer=muon", "optimizer.muon.weight_decay=0", "optimizer=adamw"], "optimizer.muon.weight_decay: is set"),
    (["optimizer.muon.ns_kernel=triton", "optimizer.muon.lr=0.05"], "optimizer.muon.lr: is set"),  # the first of two
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


@pytest.mark.parametrize("override, message", [
    ("trainer.max_step=10", "trainer.max_step is not a setting of trainer; did you mean trainer.max_steps?"),
    ("model.n_layers=4", "model.n_layers is not a setting of model; did you mean model.n_layer?"),
    ("+trainer.foo=1", "trainer.foo is not a setting of trainer; its settings: max_steps, batch_size, micro_batch,"),
    ("optimizer.betas1=0.9", "optimizer.betas1 is not a setting of optimizer; did you mean optimizer.betas?"),
    ("optimizer.muon.ns_step=3", "optimizer.muon.ns_step is not a setting of optimizer.muon; did you mean "
                                 "optimizer.muon.ns_steps?"),
    ("model.biass=false", "model.biass is not a setting of model; did you mean model.bias?"),
    ("data.path=x", "data.path is not a setting of data; did you mean data.paths?"),
    ("distributed.fsdp_unit_block=2",
     "distributed.fsdp_unit_block is not a setting of distributed; did you mean distributed.fsdp_unit_blocks?"),
    ("++loss.chunk_byte=1", "loss.chunk_byte is not a setting of loss; did you mean loss.chunk_bytes?"),
    ("trainer.n_layer=2", "trainer.n_layer is not a setting of trainer; did you mean model.n_layer?"),
    ("trainer.vocab_size=5",
     "trainer.vocab_size is not a setting of trainer; did you mean model.vocab_size or data.vocab_size?"),
    ("max_steps=10", "max_steps is not a setting or config group; did you mean trainer.max_steps?"),
    ("modle=tiny", "modle is not a setting or config group; did you mean model?"),
    ("trainer.max_steps.x=1", "trainer.max_steps.x is not a setting: trainer.max_steps takes a value"),
])
def test_unknown_key_on_the_command_line_names_the_closest_settings(override, message):
    with pytest.raises(ConfigError) as err:
        check_overrides(["-m", "trainer.lr=1e-3,2e-3", override])
    assert str(err.value).startswith(message), str(err.value)


def command_line_value(value) -> str:
    """A value as the command line gives it (Hydra's override grammar)."""
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(map(command_line_value, value)) + "]"
    if isinstance(value, str):
        return "'" + value + "'"
    return "null" if value is None else str(getattr(value, "value", value)).lower() if isinstance(value, bool) \
        else str(getattr(value, "value", value))


def test_every_setting_and_every_option_s_key_passes_the_command_line_check():
    """The keys come from the dataclasses (a group's options share its schema), each with its default or an
    option's own value; what is not a key is Hydra's."""
    import dataclasses

    from minitrain.config import Config

    def settings_of(node, prefix):  # every leaf setting with its default, nested groups (optimizer.muon) included
        for f in dataclasses.fields(node):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            if dataclasses.is_dataclass(default):
                yield from settings_of(default, f"{prefix}{f.name}.")
            elif default != "???":
                yield f"{prefix}{f.name}={command_line_value(default)}"

    settings = [s for group in dataclasses.fields(Config)
                for s in settings_of(group.default_factory(), f"{group.name}.")]
    keys = schema_keys()
    leaves = [k for k in keys if "." in k and not any(other.startswith(k + ".") for other in keys)]
    assert "model.bias=true" in settings and "distributed.fsdp_unit_blocks=4" in settings and \
        "loss.chunk_bytes=null" in settings and "optimizer.muon.adjust_lr='original'" in settings and \
        len(settings) == len(leaves) - 1
    options = [f"{yaml.parent.name}.{key}={command_line_value(value)}" for yaml in (REPO / "configs").glob("*/*.yaml")
               for key, value in (OmegaConf.to_container(OmegaConf.load(yaml)) or {}).items()
               if yaml.parent.name != "hydra" and value != "???"]
    assert "checkpointing.policy='every_k'" in options and "precision.param_dtype='bf16'" in options
    check_overrides(settings + options + [
        "model=gpt2-124m", "precision=amp_bf16", "+model=tiny", "precision=fp32,bf16", "model=choice(tiny,gpt2-124m)", "-m", "--cfg", "job", "hydra.run.dir=x",
        "hydra/job_logging=default", "trainer.lr=1e-3,2e-3", "trainer.seed=choice(1,2)", "trainer.max_steps=range(1,3)",
        "data.paths='a=b,c'", "~trainer.seed", "optimizer.betas=[0.9,0.99]", "optimizer.betas.0=0.8",
        "logger.tags=[a,b]", "trainer.out_dir=${hydra:runtime.output_dir}"])


@pytest.mark.parametrize("override, message", [
    ("trainer.device=CPU", "trainer.device: one of ('auto', 'cpu', 'cuda'), got 'CPU'"),
    ("logger.mode=bogus", "logger.mode: one of ('offline', 'online', 'disabled'), got 'bogus'"),
    ("+optimizer.impl=Fused", "optimizer.impl: one of ('auto', 'fused', 'foreach', 'loop', 'torch'), got 'Fused'"),
    ("precision.param_dtype=fp64", "precision.param_dtype: one of ('fp32', 'bf16', 'fp16'), got 'fp64'"),
    ("precision=fp64", "precision: one of ('amp_bf16', 'auto', 'bf16', 'bf16_no_master', 'fp16', 'fp32', 'fp8', "
                       "'fp8_rowwise') (configs/precision/), got 'fp64'"),
    ("model=gpt2-125m", "model: one of ('gpt2-1.5b', 'gpt2-124m', 'gpt2-124m-modern', 'gpt2-350m', 'gpt2-774m', "
                        "'pretrained', 'tiny') (configs/model/), got 'gpt2-125m'"),
    ("optimizer=lion", "optimizer: one of ('adamw', 'muon') (configs/optimizer/), got 'lion'"),
    ("optimizer.muon.adjust_lr=rms", "optimizer.muon.adjust_lr: one of ('original', 'match_rms_adamw'), got 'rms'"),
    ("optimizer.muon.ns_kernel=cutlass", "optimizer.muon.ns_kernel: one of ('cublas', 'triton'), got 'cutlass'"),
])
def test_a_word_that_is_not_one_of_a_setting_s_choices_names_them(override, message):
    """Hydra's own message for it is six lines and exit 1; every other bad value is one line and exit 2."""
    with pytest.raises(ConfigError) as err:
        check_overrides(["trainer.device=cuda", "checkpointing.policy=every_k", override])
    assert str(err.value) == message


@pytest.mark.parametrize("override, message", [
    ("trainer.max_steps=lots", "trainer.max_steps: Value 'lots' of type 'str' could not be converted to Integer"),
    ("trainer.max_steps=1.5", "trainer.max_steps: Value '1.5' of type 'float' could not be converted to Integer"),
    ("model.bias=maybe", "model.bias: Value 'maybe' is not a valid bool (type str)"),
    ("+trainer.lr=fast", "trainer.lr: Value 'fast' of type 'str' could not be converted to Float"),
    ("optimizer.betas=[0.9,x]", "optimizer.betas: Value 'x' of type 'str' could not be converted to Float"),
    ("trainer.lr=1e-3,big", "trainer.lr: Value 'big' of type 'str' could not be converted to Float"),  # each cell's
    ("trainer.seed=choice(1,x)", "trainer.seed: Value 'x' of type 'str' could not be converted to Integer"),
])
def test_a_value_of_the_wrong_type_names_its_key_in_one_line(override, message):
    with pytest.raises(ConfigError) as err:
        check_overrides(["-m", "model=tiny", "trainer.max_steps=3", override])
    assert str(err.value) == message


def test_values_of_the_right_type_and_what_hydra_resolves_later_pass_the_value_check():
    check_overrides([
        "-m", "model=gpt2-124m", "precision=fp32,bf16", "trainer.max_steps=10", "+trainer.lr=1e-3,2e-3",
        "optimizer.betas=[0.9,0.99]", "optimizer.betas.0=0.8", "logger.tags=[a,b]", "trainer.micro_batch=auto",
        "trainer.warmup_steps=null", "trainer.out_dir='my run'", "data.paths='a=b,c'", "trainer.max_steps=range(1,3)",
        "trainer.max_steps=${trainer.seed}", "hydra.run.dir=x", "hydra/job_logging=default", "~trainer.seed",
        "trainer.max_steps=[", "model.dropout=0.1", "trainer.peak_flops=1e15", "model.bias=false"])


@pytest.mark.parametrize("argv, run_dir", [
    (["trainer.max_steps=1", "trainer.out_dir=myrun"], "myrun"),  # Hydra's run dir follows: no empty runs/<date>/<time>
    (["trainer.out_dir='my run'"], "'my run'"),
    (["trainer.out_dir='~/runs/a'"], f"'{Path.home()}/runs/a'"),  # trainer.out_dir is expanded, Hydra's is not
    (["trainer.out_dir=a", "hydra.run.dir=b"], "b"),  # the user named both
    (["-m", "trainer.out_dir=runs/a/${hydra.job.num}"], None),  # a sweep's cells have their own dirs
    (["-m", "trainer.out_dir=a,b"], None),
    (["trainer.out_dir=a,b"], None),  # Hydra says a sweep needs -m
    (["trainer.out_dir=${hydra:runtime.output_dir}"], None),
    (["trainer.max_steps=1"], None),
])
def test_a_single_run_s_hydra_run_dir_follows_trainer_out_dir(argv, run_dir):
    out = command_line(argv)
    dirs = [a.split("=", 1)[1] for a in out if a.startswith("hydra.run.dir=")]
    assert out[:len(argv)] == argv and dirs == ([run_dir] if run_dir else [])


@pytest.mark.parametrize("argv", [["-m", "precision=fp32,bf16", "trainer.out_dir=mine"],
                                  ["hydra.mode=MULTIRUN", "trainer.out_dir=mine"]])
def test_a_sweep_with_one_fixed_out_dir_is_refused_before_any_cell(argv):
    """Every cell would write to it, and each after the first would refuse to overwrite the first's checkpoints."""
    with pytest.raises(ConfigError, match=r"trainer.out_dir=mine would put every cell of this -m sweep in one"):
        command_line(argv)


# Keys that make an option what it is: an option's file may set them to the dataclass's default.
DEFINING = {"name", "source", "policy", "mode", "impl", "param_dtype"}


def dataclass_defaults(schema) -> dict:
    """A group's defaults as the composed config holds them: enums as their values, a nested group as a dict."""
    import dataclasses

    def plain(value):
        if dataclasses.is_dataclass(value):
            return dataclass_defaults(type(value))
        return getattr(value, "value", value)

    return {f.name: plain(f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default)
            for f in dataclasses.fields(schema)}


def test_each_default_is_written_once_in_the_dataclasses():
    """configs/ picks and defines options; a value an option's file repeats from the dataclass would be a second
    home for that default, free to drift from it (checkpointing's was `none` in the dataclass, `auto` here)."""
    from typing import get_type_hints

    from minitrain.config import Config

    groups = get_type_hints(Config)
    repeated = [f"{yaml.parent.name}/{yaml.name}: {key}" for yaml in (REPO / "configs").glob("*/*.yaml")
                if yaml.parent.name in groups
                for key, value in (OmegaConf.to_container(OmegaConf.load(yaml)) or {}).items()
                if key not in DEFINING and value == dataclass_defaults(groups[yaml.parent.name])[key]]
    assert repeated == []
    root = OmegaConf.to_container(OmegaConf.load(REPO / "configs" / "config.yaml"))
    assert {k: v for k, v in root.items() if k not in ("defaults", "hydra")} == \
        {"trainer": {"out_dir": "${hydra:runtime.output_dir}"}}  # the one default only Hydra knows


def test_the_default_options_are_the_dataclass_defaults():
    """What a run without overrides gets is what the dataclasses say, but for the model's shape (tiny's) and the
    share of the stdlib corpus held out (configs/data/stdlib.yaml: of ~1,800 documents, 0.5% would be a handful)."""
    from typing import get_type_hints

    from minitrain.config import Config

    groups = get_type_hints(Config)
    composed = OmegaConf.to_container(compose_config(["trainer.out_dir=."]), resolve=True)
    for group, schema in groups.items():
        expected = dataclass_defaults(schema)
        differ = {k: v for k, v in composed[group].items() if v != expected[k] and k != "out_dir"}
        option = {"model": {"name": "tiny", "n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 256},
                  "data": {"val_fraction": 0.02}}
        assert differ == option.get(group, {}), group


def test_muon_defaults_are_torch_optim_muons():
    """optimizer.muon's Newton–Schulz settings, momentum and lr adjustment are torch.optim.Muon's defaults (and
    minitrain.optim.Muon's, the library's own): a default changed in one place only would make the run another
    optimizer than its comment says."""
    import inspect

    from minitrain.optimizer_config import MuonConfig
    from minitrain.optim import MuonHyper

    muon, ours = MuonConfig(), MuonHyper()
    torch_defaults = inspect.signature(torch.optim.Muon).parameters
    assert tuple(muon.ns_coefficients) == torch_defaults["ns_coefficients"].default == ours.ns_coefficients
    assert muon.ns_steps == torch_defaults["ns_steps"].default == ours.ns_steps
    assert muon.ns_eps == torch_defaults["eps"].default == ours.ns_eps
    assert muon.momentum == torch_defaults["momentum"].default == ours.momentum
    assert muon.nesterov is torch_defaults["nesterov"].default is ours.nesterov
    assert muon.adjust_lr.value == ours.adjust_lr and torch_defaults["adjust_lr_fn"].default is None
    assert (muon.lr, muon.weight_decay) == (ours.lr, ours.weight_decay)
    assert muon.ns_kernel.value == ours.ns_kernel == "cublas"  # torch's GEMMs, as torch.optim.Muon's
