"""``python -m tensorwire``: the command line (see :mod:`tensorwire.cli`)."""

from .cli import main

raise SystemExit(main())
