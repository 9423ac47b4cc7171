"""minitrain/cli.py: scripts/train.py's command line, refused before anything heavy loads, and completed for weights
to start from (their shape and their tokenizer)."""

import os
import subprocess
import sys

import pytest
from conftest import REPO

from minitrain.cli import OWN_TOKENIZER, with_init_from_defaults
from minitrain.cli import compose_config
from minitrain.errors import ConfigError

HEAVY = ("torch", "transformers", "minitrain.trainer", "minitrain.data")


@pytest.mark.parametrize("override, error", [
    ("trainer.no_such_key=1", "error: trainer.no_such_key is not a setting of trainer; its settings: max_steps, "),
    ("trainer.max_steps=many", "error: trainer.max_steps: Value 'many' of type 'str' could not be converted to "),
    ("precision=fp64", "error: precision: one of ("),
])
def test_a_wrong_key_or_value_is_refused_before_torch_is_imported(tmp_path, override, error):
    """A typo costs the schema's check, not torch's import (seconds; the refusal's time beside it:
    scripts/bench_refusal.py). `-X importtime` lists every module the refused run imported."""
    out = subprocess.run([sys.executable, "-X", "importtime", str(REPO / "scripts" / "train.py"), override],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    imported = {line.rpartition("|")[2].strip() for line in out.stderr.splitlines() if line.startswith("import time:")}
    said = [line for line in out.stderr.splitlines() if not line.startswith("import time:")]
    assert out.returncode == 2 and len(said) == 1 and said[0].startswith(error), out.stderr[-2000:]
    assert "minitrain.cli" in imported and "omegaconf" in imported
    assert not [m for m in imported if m.startswith(HEAVY)]
    assert list(tmp_path.iterdir()) == []  # no run dir


@pytest.mark.parametrize("given, added", [
    (["model.init_from=gpt2"], ["model=pretrained", OWN_TOKENIZER]),
    (["model.init_from=gpt2", "data.tokenizer=train"], ["model=pretrained"]),  # the user's tokenizer wins
    (["model=gpt2-124m", "model.init_from=gpt2"], [OWN_TOKENIZER]),  # the user's preset stays
    (["model=pretrained"], [OWN_TOKENIZER]),  # its init_from: gpt2
    (["-m", "model.init_from=gpt2,gpt2-medium"], ["model=pretrained", OWN_TOKENIZER]),  # each cell its own
    (["model.init_from=scratch"], []),
    (["model=gpt2-124m", "data.tokenizer=gpt2"], []),
])
def test_weights_to_start_from_bring_their_shape_and_tokenizer_unless_given(given, added):
    assert with_init_from_defaults(given) == [*given, *added]


def test_the_tokenizer_that_follows_the_weights_is_theirs_in_the_composed_config(hf_gpt2, tmp_path):
    """data.tokenizer resolves to model.init_from's value; weights whose directory holds no tokenizer are refused
    unless data.tokenizer names one (prepare_data.py and eval.py compose the same way)."""
    composed = compose_config(["trainer.out_dir=.", f"model.init_from={hf_gpt2}"])
    assert composed.data.tokenizer == str(hf_gpt2) and composed.model.name == str(hf_gpt2)
    assert compose_config(["trainer.out_dir=."]).data.tokenizer == "train"
    (tmp_path / "weights-only").mkdir()
    (tmp_path / "slow").mkdir()  # GPT-2's older pair of files is a tokenizer too
    for name in ("vocab.json", "merges.txt"):
        (tmp_path / "slow" / name).write_text("")
    assert compose_config([f"model.init_from={tmp_path / 'slow'}"]).data.tokenizer == str(tmp_path / "slow")
    (tmp_path / "slow" / "merges.txt").unlink()
    for folder in ("weights-only", "slow"):
        with pytest.raises(ConfigError, match=rf"^model.init_from={tmp_path / folder} holds no tokenizer "):
            compose_config([f"model.init_from={tmp_path / folder}"])
        given = compose_config([f"model.init_from={tmp_path / folder}", f"data.tokenizer={hf_gpt2}"])
        assert given.data.tokenizer == str(hf_gpt2)
