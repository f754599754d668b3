#!/bin/bash
# The kernel tests on another machine's CPU (an AMX Xeon lent as a device machine's host, say), where this project's
# virtual environment cannot go: `prepare` (here) puts what that machine's Python lacks into .devcheck/ (ignored by
# git): the gguf wheel and llguidance's files from .venv; `run` (there, in the repository root, carrying .devcheck)
# installs them and runs test_quant, test_kernels, test_moe and test_gpt_oss, whose tests that need the built-in model
# fail there for want of it (its package is larger than what travels). The log goes to $OUT/pytest.log when $OUT is
# set.
set -euo pipefail
case "${1:-}" in
prepare)
    mkdir -p .devcheck/site
    grep -qx "/.devcheck/" .git/info/exclude 2>/dev/null || echo "/.devcheck/" >>.git/info/exclude
    version=$(.venv/bin/python -c "import gguf, importlib.metadata as m; print(m.version('gguf'))")
    .venv/bin/pip download "gguf==$version" --no-deps -q -d .devcheck
    site=$(.venv/bin/python -c "import llguidance, pathlib; print(pathlib.Path(llguidance.__file__).parent.parent)")
    cp -r "$site"/llguidance "$site"/llguidance-*.dist-info .devcheck/site/
    rm -rf .devcheck/site/llguidance/__pycache__
    cp "$0" .devcheck/
    du -sh .devcheck
    ;;
run)
    grep -o -E "amx_[a-z0-9]+|avx512_vnni|avx512_bf16" /proc/cpuinfo | sort -u | tr '\n' ' '; echo
    gcc --version | head -1
    python3 -m pip install --no-index --no-deps -q .devcheck/*.whl
    export PYTHONPATH=$PWD/src:$PWD/.devcheck/site OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} PYTHONUNBUFFERED=1
    timeout "${TIMEOUT:-400}" python3 -m pytest -q -p no:cacheprovider tests/test_quant.py tests/test_kernels.py \
        tests/test_moe.py tests/test_gpt_oss.py -k "${TESTS:-not other_builds}" 2>&1 | tee "${OUT:-/tmp}/pytest.log" |
        grep -E "^(FAILED|ERROR)|passed|failed" | grep -v "built-in model" | tail -40
    ;;
*)
    echo "usage: $0 prepare|run" >&2
    exit 2
    ;;
esac
