"""Pretrained tokenizers: `data.tokenizer=gpt2` (a Hugging Face model's) or a local directory's tokenizer.json."""

from __future__ import annotations

from pathlib import Path

from .config import error_reason
from .data import DataError


def pretrained_tokenizer(name_or_dir: str):
    """The `tokenizers.Tokenizer` of a local directory holding tokenizer.json, else of the Hugging Face model of
    that name (its tokenizer.json, downloaded once into the hub's cache; later starts need no network)."""
    from tokenizers import Tokenizer

    local = Path(name_or_dir).expanduser()
    if local.is_dir():
        path = local / "tokenizer.json"
        if not path.is_file():
            raise DataError(f"data.tokenizer={name_or_dir!r}: the directory holds no tokenizer.json")
    elif local.exists() or name_or_dir.startswith((".", "/", "~")):
        raise DataError(f"data.tokenizer={name_or_dir!r}: not a directory holding tokenizer.json")
    else:
        path = _download(name_or_dir)
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers reports a malformed file as a bare Exception
        raise DataError(f"data.tokenizer={name_or_dir!r}: {path} is not a tokenizer ({error_reason(e)})") from None


def _download(name: str) -> Path:
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return Path(hf_hub_download(repo_id=name, filename="tokenizer.json"))
    except LocalEntryNotFoundError:  # offline (no network, or HF_HUB_OFFLINE=1) and not in the hub's cache
        raise DataError(f"data.tokenizer={name!r}: its tokenizer.json is not in the Hugging Face cache and the hub "
                        "cannot be reached; downloading it once needs network, or point data.tokenizer at a "
                        "directory holding a copy of tokenizer.json") from None
    except RepositoryNotFoundError:
        raise DataError(f"data.tokenizer={name!r}: no such model on the Hugging Face hub (or it is private: "
                        "`huggingface-cli login`); give train, a model's name (gpt2) or a local directory") from None
    except EntryNotFoundError:
        raise DataError(f"data.tokenizer={name!r}: the model has no tokenizer.json (a slow tokenizer only); "
                        "convert it with transformers and point data.tokenizer at the directory") from None
    except (OSError, ValueError) as e:
        raise DataError(f"data.tokenizer={name!r}: could not be downloaded ({error_reason(e)})") from None
