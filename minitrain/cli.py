"""The command line of scripts/train.py (and of the scripts that take its command line), checked and completed
before Hydra reads it and before anything heavy is imported: a typo is refused in the time it takes to read the
schema, not after torch, transformers and the trainer have loaded (scripts/bench_refusal.py measures it).

    check_overrides          each `key=value` against the typed config (minitrain/config.py), refused in one line
                             naming the key
    with_init_from_defaults  weights to start from bring their shape (model=pretrained) and their tokenizer
    command_line             both, then the run dir's completion and checks, before Hydra makes the run dir

Importing this module imports the schema, OmegaConf and Hydra's override parser, never torch
(tests/test_cli.py holds it to that).
"""

from __future__ import annotations

import difflib
import errno
import os
import re
from dataclasses import is_dataclass
from enum import Enum
from pathlib import Path
from typing import Optional, get_args, get_type_hints

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError

from .config import CONFIG_DIR, Config, DataConfig, register_configs, schema_keys
from .errors import ConfigError, unusable_run_dir
from .model_config import SCRATCH


def _closest(word: str, candidates: list[str], cutoff: float) -> list[str]:
    """The candidates nearest `word` (difflib's ratio), ties included; none below `cutoff`."""
    scores = {c: difflib.SequenceMatcher(None, word, c).ratio() for c in candidates}
    best = max(scores.values(), default=0.0)
    return [c for c, r in scores.items() if r >= max(cutoff, best - 0.02)]


def _did_you_mean(key: str, siblings: list[str]) -> str:
    """What the unknown `key` probably meant: its last part as a setting of another group (trainer.n_layer:
    model.n_layer), else the nearest names among its siblings, else any setting whose last part is near;
    with none near, the siblings' list."""
    parent, _, leaf = key.rpartition(".")
    by_leaf: dict[str, list[str]] = {}
    for k in schema_keys():
        by_leaf.setdefault(k.rpartition(".")[2], []).append(k)
    near = (by_leaf.get(leaf) or [f"{parent}.{n}" if parent else n for n in _closest(leaf, siblings, 0.6)]
            or [k for n in _closest(leaf, list(by_leaf), 0.8) for k in by_leaf[n]])
    if near:
        return f"did you mean {' or '.join(near)}?"
    return f"{'its settings' if parent else 'the settings are grouped under'}: {', '.join(siblings)}"


def _key_and_value(override: str) -> Optional[tuple[str, str]]:
    """(key without its `+`/`++`, value) of a `key=value` override; None for flags (-m) and deletions (~key)."""
    if override.startswith(("-", "~")) or "=" not in override:
        return None
    key, value = override.split("=", 1)
    return key.lstrip("+"), value


def _hydras_own(key: str) -> bool:
    """A key the schema does not type: Hydra's own (hydra.*), a group path (hydra/launcher), a package (@)."""
    return not key or "/" in key or "@" in key or key.split(".")[0] == "hydra"


_KEY_ONLY = "${_}"  # an interpolation: OmegaConf takes it for any setting, so only the key is checked


def _values(parser, override: str, value: str) -> list:
    """The values an override gives its key, parsed as Hydra will (each of a sweep's); where Hydra resolves or
    expands them later (interpolations, ranges, intervals) or cannot parse them (it says so itself), the key only."""
    from hydra.core.override_parser.types import ChoiceSweep
    from hydra.errors import HydraException

    if "${" in value:
        return [_KEY_ONLY]
    try:
        parsed = parser.parse_override(override)
    except HydraException:
        return [_KEY_ONLY]
    if isinstance(parsed.value(), ChoiceSweep):
        return parsed.value().list
    return [_KEY_ONLY] if parsed.is_sweep_override() else [parsed.value()]


def _choices(key: str) -> Optional[tuple[str, ...]]:
    """The names of a setting's fixed choices (its Enum), None for any other setting."""
    hint = Config
    for part in key.split("."):
        hint = get_type_hints(hint).get(part) if is_dataclass(hint) else None
    enum = next((t for t in (hint, *get_args(hint)) if isinstance(t, type) and issubclass(t, Enum)), None)
    return tuple(enum.__members__) if enum is not None else None


def _one_line(key: str, value, e: Exception) -> str:
    """OmegaConf's error for `key=value` as the one line the user reads."""
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

    where = (getattr(e, "full_key", None) or key).split("[")[0]
    if isinstance(e, (ConfigAttributeError, ConfigKeyError)):  # no such setting
        parent = where.rpartition(".")[0]
        siblings = [k.rpartition(".")[2] for k in schema_keys() if k.rpartition(".")[0] == parent]
        what = f"a setting of {parent}" if parent else "a setting or config group"
        return f"{where} is not {what}; {_did_you_mean(where, siblings)}"
    if isinstance(e, ValidationError) and key.startswith(where + "."):  # trainer.max_steps.x=1
        return f"{key} is not a setting: {where} takes a value, not settings under it"
    if isinstance(e, ValidationError) and (choices := _choices(key)) is not None:
        return f"{key}: one of {choices}, got {value!r}"
    return f"{key}: {str(e).strip().splitlines()[0]}"


def check_overrides(overrides: list[str]) -> None:
    """The command line against the typed config, before Hydra reads it: each `key=value` goes through OmegaConf's
    own validation (what Hydra runs when it composes) and what it refuses is raised as a ConfigError in one line:
    an unknown key with the settings it is closest to (Hydra's message, written for untyped configs, advises a `+`
    the schema refuses as well), a value of the wrong type, a word outside a setting's choices (Hydra's messages
    take five lines or more and exit 1). A sweep's values are checked one by one, so a bad one stops the sweep
    before its first cell. A group's option (`precision=fp64`) must be one of its files in configs/. Left to Hydra:
    `hydra.*`, group paths (`hydra/launcher=...`), packages (`@`), deletions (`~key`), what it cannot parse."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf.errors import OmegaConfBaseException

    schema, parser = OmegaConf.structured(Config), OverridesParser.create()
    for override in overrides:
        key, value = _key_and_value(override) or ("", "")
        if _hydras_own(key):
            continue
        if key in schema and "." not in key:  # a group's option: model=gpt2-124m
            options = tuple(sorted(yaml.stem for yaml in (CONFIG_DIR / key).glob("*.yaml")))
            if re.fullmatch(r"[\w.-]+", value) and value not in options:
                raise ConfigError(f"{key}: one of {options} (configs/{key}/), got {value!r}")
            continue
        for one in _values(parser, override, value):
            try:
                OmegaConf.update(schema, key, one, merge=True)
            except (OmegaConfBaseException, ValueError) as e:  # ValueError: a list index that is not a number
                raise ConfigError(_one_line(key, one, e)) from None


def _cannot_make(path: Path) -> Optional[OSError]:
    """What making directory `path` (parents included) would fail with, found without making anything: its
    nearest existing ancestor must be a directory this process may write into."""
    ancestor = path.absolute()
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        return NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(ancestor))
    if os.access(ancestor, os.W_OK | os.X_OK):
        return None
    code = errno.EROFS if os.statvfs(ancestor).f_flag & os.ST_RDONLY else errno.EACCES
    return OSError(code, os.strerror(code), str(ancestor))


def _require_makeable_hydra_dir(argv: list[str], given: dict[str, str], multirun: bool) -> None:
    """Hydra makes its run dir (a sweep's dir under -m) before any code of ours runs, and where it cannot, fails
    with a traceback: the dir is checked here instead, by its part before any interpolation (runs/ of
    runs/${now:...}), and refused in one line naming the setting that chose it. `argv`: as completed by
    _with_run_dir; `given`: the user's own overrides by key."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    override = next((a for a in reversed(argv) if (_key_and_value(a) or ("",))[0] == key), None)
    if override is None:  # configs/config.yaml's, as written: runs/${now:...}
        hydra = OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / "config.yaml").hydra, resolve=False)
        value = hydra[key.split(".")[1]]["dir"]
    else:
        try:
            value = OverridesParser.create().parse_override(override).value()
        except HydraException:  # malformed: Hydra says so itself
            return
    if not isinstance(value, str):  # a sweep over run dirs: Hydra's to check
        return
    fixed = value.split("${", 1)[0]
    if "${" in value and not fixed.endswith("/"):  # runs/x-${...}: the last name is not known yet
        fixed = os.path.dirname(fixed)
    if (problem := _cannot_make(Path(os.path.expanduser(fixed)))) is not None:
        derived = override is not None and key not in given  # hydra.run.dir following trainer.out_dir
        raise ConfigError(unusable_run_dir("trainer.out_dir" if derived else key, value, problem))


OWN_TOKENIZER = "data.tokenizer=${model.init_from}"  # an interpolation: each cell's own in a sweep over weights


def with_init_from_defaults(overrides: list[str]) -> list[str]:
    """Weights to start from (`model.init_from=<weights>`, or the `model=pretrained` preset) bring what they were
    made with unless the command line names another: their shape, through `model=pretrained`, whose shape keys are
    left to the weights (the default preset's, tiny's, would be refused as conflicting with them), and their
    tokenizer: data.tokenizer follows model.init_from, as one trained on the corpus would feed the weights ids that
    meant other tokens to them. A preset or a data.tokenizer given stays: the preset's shape must then agree with
    the weights', the tokenizer's ids fit their vocabulary (minitrain/plan.py). A directory of weights without a
    tokenizer, where data.tokenizer is not given, raises ConfigError naming it."""
    keys = {kv[0]: kv[1] for a in overrides if (kv := _key_and_value(a))}
    init_from = keys.get("model.init_from")
    if init_from == SCRATCH or (init_from is None and keys.get("model") != "pretrained"):
        return list(overrides)
    added = [] if "model" in keys else ["model=pretrained"]
    if "data.tokenizer" not in keys:
        _require_own_tokenizer(init_from)
        added.append(OWN_TOKENIZER)
    return [*overrides, *added]


def _require_own_tokenizer(init_from: Optional[str]) -> None:
    """model.init_from's directory holds the tokenizer data.tokenizer is to follow it to (a hub name's is fetched
    like its weights, and a sweep's or an interpolation's values are each cell's own to check)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    if init_from is None or "${" in init_from:
        return
    try:
        value = OverridesParser.create().parse_override(f"model.init_from={init_from}").value()
    except HydraException:  # Hydra reports a malformed override itself
        return
    if not isinstance(value, str) or not Path(value).expanduser().is_dir():
        return
    from .data.tokenizer import holds_tokenizer

    if not holds_tokenizer(Path(value).expanduser()):
        raise ConfigError(f"model.init_from={value} holds no tokenizer (tokenizer.json, or vocab.json + merges.txt) "
                          "for data.tokenizer to follow; name the one its weights were trained with: data.tokenizer="
                          "gpt2, or a directory holding it")


def command_line(argv: list[str]) -> list[str]:
    """scripts/train.py's arguments, checked and completed before Hydra reads them: an unknown key or a value
    of the wrong type raises ConfigError (check_overrides), as does a run dir that cannot be made
    (_require_makeable_hydra_dir); model.init_from gets model=pretrained and its own tokenizer unless given
    (with_init_from_defaults). A single run given trainer.out_dir=X (and no hydra.run.dir) gets hydra.run.dir=X
    too: Hydra makes its run dir before any code of ours runs, so the default runs/<date>/<time>/ would be left
    behind empty, and the wandb run's name, which reads Hydra's run dir, would name it. A -m sweep given one fixed
    trainer.out_dir raises: every cell would write to that one directory, and each after the first would refuse
    to overwrite the first's checkpoints."""
    check_overrides(argv)
    argv = with_init_from_defaults(argv)
    keys = {kv[0]: a for a in argv if (kv := _key_and_value(a))}
    multirun = any(a in ("-m", "--multirun") or a.startswith("hydra.mode=") for a in argv)
    completed = _with_run_dir(argv, keys, multirun)
    _require_makeable_hydra_dir(completed, keys, multirun)
    return completed


def _with_run_dir(argv: list[str], keys: dict[str, str], multirun: bool) -> list[str]:
    """`argv` with hydra.run.dir following a fixed trainer.out_dir (command_line)."""
    out_dir = keys.get("trainer.out_dir")
    if out_dir is None:
        return list(argv)
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_override(out_dir)
    except HydraException:  # Hydra reports a malformed override itself
        return list(argv)
    value, path = out_dir.split("=", 1)[1], parsed.value()
    fixed = not parsed.is_sweep_override() and path is not None and "${" not in value
    if multirun:
        if fixed:
            raise ConfigError(f"{out_dir} would put every cell of this -m sweep in one directory; leave it out "
                              "(each cell gets its own under hydra.sweep.dir=...) or make it differ per cell "
                              "(trainer.out_dir=runs/mine/${hydra.job.num})")
        return list(argv)
    if not fixed or "hydra.run.dir" in keys:
        return list(argv)
    if isinstance(path, str) and path.startswith("~"):  # trainer.out_dir is expanded; Hydra's run dir is not
        home = path.split("/", 1)[0]
        value = value.replace(home, os.path.expanduser(home), 1)
    return [*argv, f"hydra.run.dir={value}"]


def compose_config(overrides: list[str]) -> DictConfig:
    """`configs/config.yaml` with `overrides`, composed as `scripts/train.py` would (for tests and
    benchmarks that build a Trainer in-process)."""
    from hydra import compose, initialize_config_dir

    register_configs()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose("config", overrides=with_init_from_defaults(list(overrides)))


def resolve_data(overrides: list[str]) -> DataConfig:
    """The data group of `configs/` with `overrides`, checked as scripts/train.py checks them: for the scripts that
    need the data only (prepare_data.py, eval.py), which thus take train.py's command line as it is."""
    return resolve_data_and_block_size(overrides)[0]


def resolve_data_and_block_size(overrides: list[str]) -> tuple[DataConfig, Optional[int]]:
    """`resolve_data`, and the model.block_size of the same command line: the window each split must hold (None
    for a pretrained model's, which its weights say)."""
    from hydra.errors import OverrideParseException

    check_overrides(overrides)
    try:
        composed = compose_config(overrides)
    except OverrideParseException as e:  # e.g. an unquoted ~, which Hydra's grammar does not allow in a value
        override = str(e).splitlines()[0].split(": ", 1)[-1]
        raise ConfigError(f"{override}: Hydra cannot parse this override; quote the value for Hydra inside the "
                          f"shell's quotes, e.g. data.paths=\"'~/corpus/**/*.txt'\"") from None
    try:
        plain = OmegaConf.to_container(composed.data, resolve=True)
        block_size = OmegaConf.select(composed, "model.block_size", throw_on_resolution_failure=True)
    except InterpolationResolutionError as e:
        raise ConfigError(f"{e.full_key}: {str(e).splitlines()[0]}") from None
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(DataConfig), plain)), block_size
