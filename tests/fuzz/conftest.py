"""Property-based fuzzing of everything quantdispatch reads from outside (configs, safetensors
headers, index files, policy files, the self-check cache, environment values): whatever the
input, only our exception types come out, in bounded time.

The profile is deterministic (derandomized: the same examples on every run, so CI failures
reproduce) and small enough for a 2-core CI machine; ``QD_FUZZ_EXAMPLES=N`` runs N examples per
test and ``QD_FUZZ_RANDOM=1`` new random ones, for a longer local session. An example slower
than 5 s fails. No example database is written.
"""

from __future__ import annotations

import os
from datetime import timedelta

from hypothesis import HealthCheck, settings

settings.register_profile(
    "quantdispatch-fuzz",
    max_examples=int(os.environ.get("QD_FUZZ_EXAMPLES", "150")),
    derandomize=os.environ.get("QD_FUZZ_RANDOM") is None,
    database=None,
    deadline=timedelta(seconds=5),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.load_profile("quantdispatch-fuzz")
