"""What a learner computes between rounds: the model (`model`), the data (`data`), the
inner loop (`train`), accelerators (`devices`), a learner over several processes
(`ranks`), and the trained model out of the swarm (`export`)."""
