"""The API layer, the CLI's parsing, the engine's params, outputs, errors, client protocol and settings, and the
models registry import without PyTorch (a front that holds no weights never loads it)."""

import subprocess
import sys


def test_api_and_engine_interfaces_import_without_torch():
    code = (
        "import sys, waferscale.cli, waferscale.api.server, waferscale.api.models_registry, "
        "waferscale.api.models_file, waferscale.engine.client, waferscale.engine.settings; "
        "from waferscale.engine import SamplingParams, GenerationEvent, RequestError, EngineSettings; "
        "waferscale.cli.build_parser().parse_args(['serve']); print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
