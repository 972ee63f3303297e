"""``quantdispatch`` command line: ``doctor`` (what runs here and why), ``presets``, ``verify``.

``main`` parses without importing torch; each command imports what it needs when it runs.
"""

from quantdispatch.cli.main import main

__all__ = ["main"]
