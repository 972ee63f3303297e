"""transformers is imported by quantdispatch.integrations.transformers only, and only by the parts
that need it: the package, describe_model and the rest of quantdispatch work without it."""

from __future__ import annotations

import subprocess
import sys


def test_quantdispatch_and_describe_do_not_import_transformers():
    code = (
        "import sys\n"
        "import quantdispatch\n"
        "from quantdispatch import QuantLinear, QuantMoE, select\n"
        "import quantdispatch.checkpoints, quantdispatch.formats\n"
        "import quantdispatch.integrations.transformers as hf\n"
        "hf.describe_model, hf.render_description\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] == 'transformers')\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
