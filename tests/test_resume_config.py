"""Which config changes a resume accepts: each key of each config group, and what a refusal says.

A resumed run must compute what the unbroken run would have. A key may change on resume only when the steps compute
the same thing with it changed (how long the run goes, what is reported, where files go, how the same arithmetic is
scheduled); every other difference is refused, naming each key with its saved and current value."""

import json

import pytest
from omegaconf import OmegaConf

from minitrain import checkpoint
from minitrain.config import resolve
from minitrain.trainer import Trainer

# The keys a resume may change, group by group, and nothing else: every other key of the config is refused.
MAY_CHANGE = {
    "model": set(),
    "data": {"shard_tokens", "cache_dir"},  # how the same token streams are cut into files and where they are kept
    "precision": set(),
    "checkpointing": {"policy", "every_k"},  # what backward recomputes: the same values
    "optimizer": set(),
    "loss": {"chunk_bytes"},  # the fused loss's workspace tile: the same loss
    "logger": {"mode", "project", "group", "name", "tags"},
    "distributed": {"timeout_s", "mode", "fsdp_unit_blocks", "reshard_after_forward"},  # the same global batch
    "trainer": {"max_steps", "log_every", "eval_every", "eval_batches", "save_every", "sample_tokens", "out_dir",
                "device", "compile", "compile_mode", "compile_check", "deterministic", "peak_flops", "memory_budget",
                "expandable_segments", "micro_batch", "max_skipped_steps", "eval_hellaswag", "eval_hellaswag_examples",
                "target_loss"},
    # what the plan resolved from `auto` on this device: precision, world size, mode, vocabulary, the params' dtype,
    # the float8 linears
    "plan": {"world_size", "distributed"},
}
NOT_COMPARED = {"trainer.resume"}  # every resume changes how it finds its checkpoint
PLAN = {"precision": "fp32", "world_size": 1, "distributed": "none", "vocab_size": 4096, "param_dtype": "float32",
        "float8_linears": []}


def config_dict(make_cfg, *overrides) -> dict:
    """As the trainer stores it in a checkpoint."""
    return OmegaConf.to_container(OmegaConf.structured(resolve(make_cfg(*overrides))), resolve=True,
                                  enum_to_str=True)


def identity(make_cfg, *overrides) -> dict:
    """A checkpoint's config: the run's config and what its plan resolved (Trainer._identity's shape)."""
    return {**config_dict(make_cfg, *overrides), "plan": PLAN}


def test_every_group_of_the_config_is_classified():
    """The table above names real keys: a renamed key cannot leave a stale entry that tests nothing."""
    import minitrain.config as config

    keys = {k for k in config.schema_keys() if "." in k}
    assert set(MAY_CHANGE) - {"plan"} == {k for k in config.schema_keys() if "." not in k}
    for group, names in MAY_CHANGE.items():
        assert {f"{group}.{n}" for n in names} <= (keys if group != "plan" else {f"plan.{k}" for k in PLAN}), group


@pytest.mark.parametrize("group", list(MAY_CHANGE))
def test_each_key_of_each_group_may_change_or_is_refused(make_cfg, group):
    """Every key of the group changed alone: allowed exactly when the table says so, refused otherwise, and no other
    key reported. A pattern in ALLOWED_CHANGES wider than the table (`data.*`) or narrower (`logger.mode`) fails."""
    saved = identity(make_cfg)
    assert saved[group], group

    def leaves(node, path=()):  # each setting's path in the group, a nested group's (optimizer.muon) each of its own
        for k, v in node.items():
            yield from leaves(v, (*path, k)) if isinstance(v, dict) and v else [((*path, k), v)]

    def changed(node, path):
        return {**node, path[0]: changed(node[path[0]], path[1:]) if len(path) > 1 else "changed on resume"}

    for path, value in leaves(saved[group]):
        key = ".".join(path)
        dotted = f"{group}.{key}"
        changes = checkpoint.config_changes(saved, {**saved, group: changed(saved[group], path)})
        if dotted in NOT_COMPARED:
            assert (changes.allowed, changes.breaking) == ({}, {}), dotted
        elif key in MAY_CHANGE[group]:
            assert (changes.allowed, changes.breaking) == ({dotted: (value, "changed on resume")}, {}), \
                f"{dotted} should be allowed to change"
        else:
            assert (changes.allowed, changes.breaking) == ({}, {dotted: (value, "changed on resume")}), \
                f"{dotted} should be refused"


def test_the_refusal_names_each_breaking_key_with_both_values_and_nothing_it_allows(make_cfg):
    saved = identity(make_cfg)
    now = identity(make_cfg, "model.n_layer=2", "data.vocab_size=8192", "trainer.max_steps=40", "logger.project=x",
                   "data.val_fraction=0.01")
    changes = checkpoint.config_changes(saved, now)
    assert changes.refusal("checkpoints/latest.pt") == (
        "checkpoints/latest.pt was saved by a run with a different config; resuming would silently make it another "
        "run:\n"
        "  data.val_fraction: saved 0.02, now 0.01\n"
        "  data.vocab_size: saved 4096, now 8192\n"
        "  model.n_layer: saved 4, now 2\n"
        "Put the saved values back to resume it, or start a new run dir (hydra.run.dir=...) for the new config")
    assert changes.accepted() == ("config changed since the checkpoint (allowed): logger.project minitrain -> x, "
                                  "trainer.max_steps 10 -> 40")


def test_precision_auto_resumed_on_another_kind_of_device_is_refused(make_cfg, tmp_path):
    """The same config (precision=auto) resolves to bf16 on a GPU and fp32 on a CPU: a checkpoint of the GPU run
    resumed on the CPU would go on in another precision, so the plan's resolution is compared too."""
    Trainer(make_cfg("trainer.max_steps=2", "trainer.save_every=2", "trainer.sample_tokens=0"), progress=False).fit()
    job = tmp_path / "run" / "checkpoints" / checkpoint.LATEST / checkpoint.JOB_INFO
    info = json.loads(job.read_text())
    assert info["config"]["plan"]["precision"] == "fp32" and info["config"]["precision"]["name"] == "auto"
    assert info["config"]["plan"] == PLAN  # what a resume compares beyond the config, as the table classifies it
    info["config"]["plan"]["precision"] = "bf16"  # as a run on a GPU with bf16 saved it
    job.write_text(json.dumps(info))
    with pytest.raises(checkpoint.CheckpointError, match=r"\n  plan\.precision: saved bf16, now fp32\nPut the saved"):
        Trainer(make_cfg("trainer.max_steps=3", "trainer.sample_tokens=0", "trainer.resume=auto"), progress=False)


def test_deliberate_changes_are_allowed_and_the_rest_break_the_run(make_cfg):
    saved = config_dict(make_cfg)
    now = config_dict(make_cfg, "trainer.max_steps=50", "trainer.log_every=2", "trainer.micro_batch=4",
                      "logger.project=other", "trainer.lr=0.01", "precision=bf16", "trainer.batch_size=16")
    changes = checkpoint.config_changes(saved, now)
    assert changes.allowed == {"trainer.max_steps": (10, 50), "trainer.log_every": (5, 2),
                               "trainer.micro_batch": ("auto", "4"), "logger.project": ("minitrain", "other")}
    assert changes.breaking["trainer.lr"] == (0.001, 0.01)
    assert changes.breaking["trainer.batch_size"] == (8, 16)
    assert changes.breaking["precision.param_dtype"] == ("fp32", "bf16")
    assert "trainer.max_steps" not in changes.breaking
    message = changes.refusal("checkpoints/latest.pt")
    assert message.startswith("checkpoints/latest.pt was saved by a run with a different config")
    assert "  trainer.lr: saved 0.001, now 0.01\n" in message
    assert "  precision.master_weights: saved False, now True\n" in message
    assert "hydra.run.dir=" in message
    assert changes.accepted() == ("config changed since the checkpoint (allowed): logger.project minitrain -> "
                                      "other, trainer.log_every 5 -> 2, trainer.max_steps 10 -> 50, "
                                      "trainer.micro_batch auto -> 4")


def test_the_same_config_has_no_changes(make_cfg):
    changes = checkpoint.config_changes(config_dict(make_cfg), config_dict(make_cfg))
    assert changes.allowed == {} and changes.breaking == {}
    # the resume itself is no change of config worth a note at every resume
    changes = checkpoint.config_changes(config_dict(make_cfg), config_dict(make_cfg, "trainer.resume=auto"))
    assert changes.allowed == {} and changes.breaking == {}


def test_a_key_on_one_side_only_is_a_change(make_cfg):
    saved = config_dict(make_cfg)
    del saved["optimizer"]["eps"]  # a checkpoint older than the key
    del saved["logger"]["tags"]
    now = {**config_dict(make_cfg), "plan": {"vocab_size": 4096, "param_dtype": "fp32"}}
    changes = checkpoint.config_changes(saved, now)
    assert changes.breaking["optimizer.eps"] == (checkpoint._ABSENT, 1e-8)
    assert changes.breaking["plan.vocab_size"] == (checkpoint._ABSENT, 4096)
    assert changes.allowed == {"logger.tags": (checkpoint._ABSENT, [])}
    assert "  plan.vocab_size: saved (not set), now 4096\n" in changes.refusal("latest.pt")
    gone = checkpoint.config_changes(now, saved)  # and the converse: a key this run no longer has
    assert gone.breaking["plan.param_dtype"] == ("fp32", checkpoint._ABSENT)


def test_a_key_an_older_checkpoint_lacks_is_no_change_at_its_default(make_cfg):
    """A setting enters the schema with a default that computes what minitrain computed before it."""
    from minitrain.config import schema_defaults

    saved = config_dict(make_cfg)
    del saved["optimizer"]["eps"], saved["model"]["qk_norm"], saved["model"]["position"]
    changes = checkpoint.config_changes(saved, config_dict(make_cfg, "model.position=rope"), schema_defaults())
    assert changes.added == {"model.qk_norm": False, "optimizer.eps": 1e-8}
    assert changes.breaking == {"model.position": (checkpoint._ABSENT, "rope")} and changes.allowed == {}
    assert changes.newer().endswith(": model.qk_norm=False, optimizer.eps=1e-08")
    eps = checkpoint.config_changes(saved, config_dict(make_cfg, "optimizer.eps=1e-6"), schema_defaults())
    assert eps.breaking["optimizer.eps"] == (checkpoint._ABSENT, 1e-6)


def test_a_checkpoint_saved_before_the_block_options_and_muon_resumes_at_their_defaults(make_cfg, tmp_path, capsys):
    """The run's own resume, on a checkpoint whose record predates model.position ... model.logit_softcap and
    optimizer.muon: it resumes, saying so; a run that sets one of them away from its default is refused."""
    Trainer(make_cfg("trainer.max_steps=2", "trainer.save_every=2", "trainer.sample_tokens=0"), progress=False).fit()
    job = tmp_path / "run" / "checkpoints" / checkpoint.LATEST / checkpoint.JOB_INFO
    info = json.loads(job.read_text())
    newer = ("position", "rope_base", "norm", "qk_norm", "mlp", "tie_head", "zero_init_proj", "logit_softcap")
    for key in newer:
        del info["config"]["model"][key]
    del info["config"]["optimizer"]["muon"]
    job.write_text(json.dumps(info))
    capsys.readouterr()
    Trainer(make_cfg("trainer.max_steps=3", "trainer.sample_tokens=0", "trainer.resume=auto"), progress=False)
    out = capsys.readouterr().out
    assert "settings newer than the checkpoint, at their defaults (what it was trained with): " in out
    assert all(f"model.{key}=" in out for key in newer) and "optimizer.muon.lr=0.02" in out
    with pytest.raises(checkpoint.CheckpointError, match=r"\n  model\.mlp: saved \(not set\), now relu2\n"):
        Trainer(make_cfg("trainer.max_steps=3", "trainer.resume=auto", "model.mlp=relu2"), progress=False)


def test_nested_values_compare_whole(make_cfg):
    changes = checkpoint.config_changes(config_dict(make_cfg), config_dict(make_cfg, "optimizer.betas=[0.9,0.99]"))
    assert changes.breaking == {"optimizer.betas": ([0.9, 0.95], [0.9, 0.99])}
    deep = checkpoint.config_changes({"plan": {"memory": {"budget_gb": 20, "fits": True}}},
                                 {"plan": {"memory": {"budget_gb": 40, "fits": True}}})
    assert deep.breaking == {"plan.memory.budget_gb": (20, 40)}
