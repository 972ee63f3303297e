"""``python -m quantdispatch`` runs the CLI."""

from quantdispatch.cli import main

raise SystemExit(main())
