"""`python -m p2pdiloco` is the same as the `p2pdiloco` command."""

from p2pdiloco.cli.main import main

raise SystemExit(main())
