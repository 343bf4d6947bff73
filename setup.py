"""Symphony: a programmable LLM serving system (serve programs, not prompts).

The C++/CUDA operators in csrc/ are compiled on first use by
torch.utils.cpp_extension (symphony/engine/ops/build.py), so installing needs no
compiler-time torch and no build isolation:  pip install --no-build-isolation -e .

csrc/ and userland/ stay at the top of the repository; a wheel or a non-editable
install ships them inside the package as symphony/_csrc (the op sources, built on
first use) and symphony/_userland (the stock programs, run by name:
``symphony run chat "..."``).  An editable install reads them from the checkout.
    pip wheel --no-deps --no-build-isolation .      # dist: dist/symphony-*.whl
"""
import os
import shutil

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
# top-level folder -> (folder inside the installed package, file suffixes shipped)
SHIPPED = {
    "csrc": ("_csrc", (".cpp", ".cu", ".h", ".cuh", ".hpp", ".inc")),
    "userland": ("_userland", (".py",)),
}


class BuildPyShippingSources(build_py):
    """build_py that starts from an empty build/lib/symphony and also copies csrc/ and
    userland/ into the built package (symphony/_csrc, symphony/_userland); an editable
    install copies nothing."""

    def run(self):
        if getattr(self, "editable_mode", False):
            super().run()
            return
        # a clean copy: a module deleted from the tree must not live on in build/lib
        shutil.rmtree(os.path.join(self.build_lib, "symphony"), ignore_errors=True)
        super().run()
        for top, (inside, suffixes) in SHIPPED.items():
            src_root = os.path.join(HERE, top)
            if not os.path.isdir(src_root):
                raise SystemExit(f"setup.py: {src_root} is missing (build from a checkout or an sdist)")
            for dirpath, dirnames, filenames in os.walk(src_root):
                dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
                for name in sorted(filenames):
                    if not name.endswith(suffixes):
                        continue
                    rel = os.path.relpath(os.path.join(dirpath, name), src_root)
                    out = os.path.join(self.build_lib, "symphony", inside, rel)
                    self.mkpath(os.path.dirname(out))
                    self.copy_file(os.path.join(dirpath, name), out)


setup(
    name="symphony",
    version="0.1.0",
    description="LLM serving system that runs LLM Inference Programs (LIPs)",
    packages=find_packages(include=["symphony", "symphony.*"]),
    cmdclass={"build_py": BuildPyShippingSources},
    python_requires=">=3.10",
    install_requires=[
        # torch is installed by scripts/quickstart.sh (exactly 2.13.0 CPU here;
        # whatever CUDA build a GPU machine already has); this range never
        # pulls a new one when a torch is present.
        "torch>=2.4",
        "numpy",
        "gguf>=0.10",           # reads and dequantizes GGUF files
        "tokenizers>=0.19",     # BPE tokenizer built from the model's metadata
        "safetensors",          # Hugging Face weight directories
        "jinja2",               # chat templates (sandboxed)
        "orjson",
        "msgspec>=0.18",        # system-call bodies decoded and validated by type (symphony/ipc/schema.py)
        "posix_ipc",
        "uvloop",
        "tqdm",
        "llguidance",           # grammar engine for constrained decoding (token masks), no torch
        # the HTTP gateway (symphony/gateway/): an ASGI app on a maintained server
        "starlette>=0.40",      # routing, requests, streamed responses
        "uvicorn>=0.30",        # the ASGI server, run with uvloop and httptools
        "httptools",
        "websockets",           # uvicorn's WebSocket protocol: the WebSocket mode of /v1/responses
        "pypdf",                # the text of PDF files sent inline to the gateway
        "prometheus-client",    # GET /metrics
    ],
    extras_require={"test": ["pytest", "pytest-benchmark", "hypothesis", "jsonschema", "openai", "anthropic",
                             "httpx", "matplotlib"],
                    "docs": ["mkdocs>=1.6"]},     # mkdocs build --strict (docs/, mkdocs.yml)
    entry_points={"console_scripts": [
        "symphony=symphony.cli:main",
        "symphony-kernel=symphony.kernel_cli:kernel_main",
        "symphony-gateway=symphony.gateway.server:main",
    ]},
)
