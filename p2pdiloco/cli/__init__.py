"""The `p2pdiloco` command line (`main`), its commands by what they do (`peer_commands`,
`watch_commands`, `model_commands`, `runs`, `doctor`, `demo`), the arguments they share
(`options`, `argv`), and the dashboard (`dashboard`, `snapshot`, `panels`)."""
