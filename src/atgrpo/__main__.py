"""``python -m atgrpo``: the command line (:mod:`atgrpo.cli`)."""

from atgrpo.cli import main

raise SystemExit(main())
