"""The swarm in one process, for studies and benchmarks: lockstep DiLoCo against
synchronous data parallelism (`simulate`) and Decoupled DiLoCo on a simulated clock
(`decoupled`), both merging through the swarm's own `protocol.merge.merge_round`
(`common.CanonicalChain`) and training with the real inner loop."""
