"""A pretrained byte-level BPE tokenizer instead of one trained on the corpus (`data.tokenizer`).

`pretrained_tokenizer("gpt2")` reads GPT-2's own tokenizer through the Hugging Face hub (its cache when
offline); a directory gives its tokenizer.json, or the vocab.json + merges.txt pair of older checkpoints. Either
way the result must be a byte-level BPE with `<|endoftext|>`, the token the data pipeline puts between
documents, so that its ids mean what the weights they go with learned.
"""

from __future__ import annotations

from pathlib import Path

from ..hub import SourceError, is_local, source_file
from .corpus import DataError, contents_digest

KEY = "data.tokenizer"
EOT = "<|endoftext|>"  # between documents, in every tokenizer the pipeline uses
FILES = ("tokenizer.json", "vocab.json", "merges.txt")  # what a directory's tokenizer is read from


class TokenizerError(DataError):
    """data.tokenizer names nothing usable; the message names the directory, file or name."""


def pretrained_tokenizer(name_or_dir: str):
    """The byte-level BPE `name_or_dir` names (a Hugging Face name or a local directory) as a
    tokenizers.Tokenizer whose `<|endoftext|>` is its end of text; raises TokenizerError in one line."""
    from tokenizers import Tokenizer

    folder = Path(name_or_dir).expanduser()
    if is_local(name_or_dir) and not holds_tokenizer(folder):
        raise TokenizerError(f"{KEY}={folder}: holds neither tokenizer.json nor vocab.json + merges.txt")
    try:
        if is_local(name_or_dir) and not (folder / "tokenizer.json").is_file():
            tokenizer, where = _from_vocab_and_merges(folder)
        else:
            path = source_file(name_or_dir, "tokenizer.json", KEY)
            tokenizer, where = Tokenizer.from_file(str(path)), path
    except SourceError as e:
        raise TokenizerError(str(e)) from None
    except Exception as e:  # tokenizers reports a malformed file as a bare Exception
        raise TokenizerError(f"{KEY}={name_or_dir}: its tokenizer files are unreadable ({e})") from None
    _require_byte_level_bpe(tokenizer, where)
    return tokenizer


def tokenizer_identity(name_or_dir: str) -> list:
    """A pretrained tokenizer as the token cache's key knows it: a Hugging Face name by its name, a directory also by
    the contents of its tokenizer files, so that another tokenizer saved in the same place is another cache."""
    if not is_local(name_or_dir):
        return [name_or_dir, None]
    folder = Path(name_or_dir).expanduser()
    return [name_or_dir, contents_digest([str(f) for f in (folder / name for name in FILES) if f.is_file()])]


def holds_tokenizer(folder: Path) -> bool:
    """Whether a directory holds what pretrained_tokenizer reads: tokenizer.json, or vocab.json + merges.txt."""
    return (folder / "tokenizer.json").is_file() or all((folder / f).is_file() for f in ("vocab.json", "merges.txt"))


def _from_vocab_and_merges(folder: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab, merges = folder / "vocab.json", folder / "merges.txt"
    tokenizer = Tokenizer(models.BPE.from_file(str(vocab), str(merges)))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([EOT])  # the id vocab.json gives it; appended only where it has none
    return tokenizer, vocab


def _require_byte_level_bpe(tokenizer, where) -> None:
    """GPT-2's tokenization: BPE over bytes (every text encodes; nothing maps to an unknown token)."""
    from tokenizers import models, pre_tokenizers

    pre = tokenizer.pre_tokenizer
    parts = getattr(pre, "pretokenizers", None) or [pre]  # a Sequence, or one pre-tokenizer
    if not isinstance(tokenizer.model, models.BPE) or not any(isinstance(p, pre_tokenizers.ByteLevel) for p in parts):
        raise TokenizerError(f"{KEY}: {where} is a {type(tokenizer.model).__name__} tokenizer without byte-level "
                             "pre-tokenization; GPT-2's weights need a byte-level BPE")
    if tokenizer.token_to_id(EOT) is None:
        raise TokenizerError(f"{KEY}: {where} has no {EOT} token, which the data pipeline puts between documents")
