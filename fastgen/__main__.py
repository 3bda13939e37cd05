"""`python -m fastgen ...` runs the `fastgen` command line."""

from fastgen.cli.main import main

raise SystemExit(main())
