"""Prepare a corpus's token shards ahead of training: `python scripts/prepare_data.py [data=... data.key=value ...]`.

The same preparation scripts/train.py runs when its data cache is missing, with the same overrides (its
model.block_size too: each split must hold one window of it): a stopped preparation (Ctrl-C, a kill, a full
disk) is continued by running the same command again, and a prepared one is reused.
"""

import sys
import time

from minitrain.cli import resolve_data_and_block_size
from minitrain.data import DataError, prepare_data
from minitrain.errors import ConfigError

USAGE_EXIT_CODE, ABORTED_EXIT_CODE = 2, 130


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__.strip())
        return 0
    started = time.monotonic()
    try:
        data = prepare_data(*resolve_data_and_block_size(argv))
    except (ConfigError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return USAGE_EXIT_CODE
    except KeyboardInterrupt:
        print("minitrain: preparation stopped; run the same command again to continue it", file=sys.stderr)
        return ABORTED_EXIT_CODE
    shards = sum(len(stream.shards) for stream in (data.train, data.val))
    done = f"prepared in {time.monotonic() - started:.0f} s" if data.prepared else "already prepared: reused"
    print(f"{data.path}: {len(data.train):,} training and {len(data.val):,} validation tokens in {shards} shards "
          f"({data.train.dtype}, vocabulary {data.vocab_size:,}), {done}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
