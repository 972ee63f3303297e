"""quantdispatch: pick the fastest correct kernel for each quantized layer, and say why."""

__version__ = "0.1.0"
