"""A Byzantine learner for networked tests: the real `p2pdiloco join`, with its outgoing
contributions corrupted, round after round, in the ways a malicious volunteer would.

    python tests/net/byzantine.py --modes scale,flip,tokens,replay -- JOIN ARGS...

Each contribution it ships to a fragment uses that fragment's next mode, in turn: `scale` multiplies the delta by
1000, `flip` sends it negated and ×10, `tokens` claims 1000× the tokens it processed,
`replay` sends its first contribution again (signed anew, so only its content is stale).
It signs everything with its own key, as any admitted learner can: what stops it must be
the synchronizer's screening, not the signature checks. It logs `byzantine mode=...` on
stderr for each contribution, so a test can match rounds to modes.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Iterator
from itertools import cycle

from p2pdiloco import compress
from p2pdiloco.cli.main import main as cli_main
from p2pdiloco.protocol.deltas import InFlight
from p2pdiloco.roles.shipping import Shipper

log = logging.getLogger("byzantine")


def corrupting(modes: list[str]):
    """A replacement for `Shipper._send` that corrupts each item by the next mode."""
    original = Shipper._send
    turns: dict[int, Iterator[str]] = {}
    first: dict[int, dict] = {}

    def send(self: Shipper, fragment: int, item: InFlight) -> None:
        first.setdefault(fragment, item.tensors)
        mode = next(turns.setdefault(fragment, cycle(modes)))  # each fragment sees every mode
        if mode in ("scale", "flip"):
            factor = 1000.0 if mode == "scale" else -10.0
            delta = compress.decode_tensors(item.tensors)
            item.tensors = compress.encode_tensors(
                self.codec, {n: t * factor for n, t in delta.items()}
            )
        elif mode == "tokens":
            item.tokens *= 1000
        elif mode == "replay":
            item.tensors = first[fragment]
        log.warning("byzantine mode=%s fragment=%d round=%d", mode, fragment, item.target_round)
        original(self, fragment, item)

    return send


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default="scale,flip,tokens,replay")
    parser.add_argument("join", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    Shipper._send = corrupting(args.modes.split(","))
    join = args.join[1:] if args.join[:1] == ["--"] else args.join
    return cli_main(["join", *join])


if __name__ == "__main__":
    sys.exit(main())
