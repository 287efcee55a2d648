"""A synchronizer that lies and refuses audits, for networked tests (issue 28, item 7): the
real `p2pdiloco join`, whose merges from round `--from-round` on are scaled by `--factor`
(an outsized update that its record commits to, result hash and all, so only an audit can
tell), and whose `get_contributions` refuses every caller.

    python tests/net/refusing_sync.py --factor 30 --from-round 4 -- JOIN ARGS...

It signs everything with its own key (certified, in a certified run): what stops it must
be the honest replicas holding an out-of-line update they cannot verify. It logs `lying
synchronizer round=... fragment=... hash=...` on stderr for each lie it commits to.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys

from p2pdiloco import compress
from p2pdiloco.cli.main import main as cli_main
from p2pdiloco.roles import commit

log = logging.getLogger("refusing_sync")


def lying_merge(factor: float, from_round: int):
    """A replacement for `Committer._merge` that scales the merged outer gradient of every
    round from `from_round` on by `factor` (re-encoded, so the frame, the applied tensor
    and the record's result hash all agree with each other)."""
    original_merge, original_merge_round = commit.Committer._merge, commit.merge_round

    def merge(self, window, grace_s):
        if window.round < from_round:
            return original_merge(self, window, grace_s)

        def scaled(*args, **kwargs):
            result = original_merge_round(*args, **kwargs)
            if result.decoded is None:
                return result
            codec = kwargs["outer_codec"]
            encoded = {n: codec.encode(t * factor) for n, t in result.decoded.items()}
            decoded = {
                n: compress.decode_tensor(e, expected_shape=tuple(result.decoded[n].shape))
                for n, e in encoded.items()
            }
            return dataclasses.replace(result, encoded=encoded, decoded=decoded)

        commit.merge_round = scaled  # the one worker thread merges: no other caller meanwhile
        try:
            merged = original_merge(self, window, grace_s)
        finally:
            commit.merge_round = original_merge_round
        if merged.update is not None:
            log.warning(
                "lying synchronizer round=%d fragment=%d hash=%s factor=%g",
                window.round, window.fragment, merged.update.hash, factor,
            )  # fmt: skip
        return merged

    return merge


async def refuse_audits(self, caller: str, request: bytes) -> bytes:
    """`get_contributions`, refused to everyone: the round cannot be recomputed."""
    raise PermissionError("audits refused")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--factor", type=float, default=30.0)
    parser.add_argument("--from-round", type=int, default=4)
    parser.add_argument("join", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    commit.Committer._merge = lying_merge(args.factor, args.from_round)
    commit.Committer.rpc_get_contributions = refuse_audits
    join = args.join[1:] if args.join[:1] == ["--"] else args.join
    return cli_main(["join", *join])


if __name__ == "__main__":
    sys.exit(main())
