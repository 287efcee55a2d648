"""One peer process: the daemon around it (`daemon`), the joined peer and its roles
(`joined`, built from `build`), and what a process adds: checkpoints and remembered
addresses, the clock check and preflight, metrics, memory diagnostics, fault injection."""
