"""Adapters to model libraries. Nothing in quantdispatch imports this package: each adapter is
imported by its user (``quantdispatch.integrations.transformers`` needs the ``transformers``
package, an optional extra)."""
