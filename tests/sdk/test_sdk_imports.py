"""Every sdk module imports without torch, transformers, the server package or (at import) sagemaker."""

from __future__ import annotations

import subprocess
import sys


def test_sdk_modules_import_light() -> None:
    code = (
        "import sys, sdk, sdk.iterators, sdk.client, sdk.parsing, sdk.results, sdk.eventstream, sdk.gateway, "
        "sdk.sizing, sdk.deploy, sdk.local\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'serving', 'kernels', 'sagemaker', 'moto') "
        "if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
