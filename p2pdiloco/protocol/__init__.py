"""The rules of the round protocol, as pure functions and records: who synchronizes
(`election`), fragments and their schedule (`fragments`), heartbeats (`membership`),
round records and the canonical chain (`rounds`), when a window closes (`windows`), what
enters it (`intake`), one round's merge (`merge`), and where a learner's steps go
(`ledger`, `deltas`). No network, no clock: the roles drive them."""
