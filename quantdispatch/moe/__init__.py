"""Mixture-of-experts maths that is not a layer: routing (:mod:`.routing`), the activation
contract every MoE backend follows (:mod:`.activations`) and the canonical expert stacks
(:mod:`.stacking`). The layer itself is :class:`quantdispatch.layers.QuantMoE`.

Importing this package loads the routing only; it never imports layers, backends or the api.
"""

from quantdispatch.moe.routing import RoutingConfig, Scoring, route, to_local_ids

__all__ = ["RoutingConfig", "Scoring", "route", "to_local_ids"]
