"""What a peer does in the swarm, each role on the event loop (the learner on its own
thread): the replica of the global state (`state`) kept on the canonical chain
(`replica`, with `serving`, `download`, `audits`); the synchronizer (`synchronizer`,
`window`, `commit`); the learner (`learner`, `shipping`, `learner_link`); heartbeats
(`members`); and an outside observer (`observer`)."""
