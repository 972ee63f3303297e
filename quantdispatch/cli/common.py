"""What the parser and the commands share: exit codes and the choices the parser offers. Imports
nothing, so the commands need not import the parser (and the parser imports them lazily).

Exit codes: 0 success; 1 a decision could not be made (e.g. a forced backend cannot run) or a
verification failed; 2 bad flags, env values or policy files.
"""

__all__ = ["ACT_DTYPE_NAMES", "EXIT_DECISION", "EXIT_OK", "EXIT_USAGE", "OPS", "SCHEMES"]

EXIT_OK, EXIT_DECISION, EXIT_USAGE = 0, 1, 2

# Spelled here so that parsing needs no torch import; a unit test keeps them equal to
# quantdispatch.request's Op, Scheme and ACT_DTYPES.
OPS = ("linear", "moe")
SCHEMES = ("weight_only", "weight_act")
ACT_DTYPE_NAMES = ("bf16", "fp16")
