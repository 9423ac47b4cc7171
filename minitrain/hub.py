"""Where a Hugging Face source's files are: a local directory, or a hub name whose files come from the hub's
local cache first (no network) and are downloaded when they are not there. Model weights (minitrain/hf.py) and a
pretrained tokenizer (minitrain/data/tokenizer.py) are both found this way."""

from __future__ import annotations

import re
from pathlib import Path

from .errors import ConfigError, error_reason

_HUB_NAME = re.compile(r"[\w.-]+(/[\w.-]+)?")


class SourceError(ConfigError):
    """A name or directory that holds no usable file; the message names it."""


def is_local(source: str) -> bool:
    return Path(source).expanduser().is_dir()


def is_hub_name(source: str) -> bool:
    """Whether `source` could name a Hugging Face model (`name` or `owner/name`)."""
    return _HUB_NAME.fullmatch(source) is not None


def source_file(source: str, filename: str, key: str) -> Path:
    """`filename` in the directory `source`, or of the Hugging Face model `source`: from the hub's local cache
    first (no network), downloaded (with a progress bar) when it is not there."""
    if is_local(source):
        path = Path(source).expanduser() / filename
        if not path.is_file():
            raise SourceError(f"{key}={source}: there is no {filename} in that directory")
        return path
    if not is_hub_name(source):
        raise SourceError(f"{key}={source!r}: no such directory, and not a Hugging Face model name")
    from huggingface_hub import constants, hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError, LocalEntryNotFoundError, \
        RepositoryNotFoundError

    try:
        return Path(hf_hub_download(source, filename, local_files_only=True))
    except LocalEntryNotFoundError:
        pass
    try:
        return Path(hf_hub_download(source, filename))
    except LocalEntryNotFoundError:  # not cached, and the hub did not answer
        raise SourceError(f"{key}={source}: not a local directory, not in the Hugging Face cache "
                          f"({constants.HF_HUB_CACHE}), and the hub cannot be reached; run once online to "
                          "download it, or give a directory holding its files") from None
    except RepositoryNotFoundError:
        raise SourceError(f"{key}={source}: no such directory, and no such model on the Hugging Face hub") from None
    except EntryNotFoundError:
        raise SourceError(f"{key}={source}: the Hugging Face model {source} has no {filename}") from None
    except (HfHubHTTPError, OSError) as e:
        raise SourceError(f"{key}={source}: {filename} could not be downloaded ({error_reason(e)})") from None
