"""Symphony: a programmable LLM serving system (serve programs, not prompts).

The C++/CUDA operators in csrc/ are compiled on first use by
torch.utils.cpp_extension (symphony/engine/ops/__init__.py), so installing needs no
compiler-time torch and no build isolation:  pip install --no-build-isolation -e .
"""
from setuptools import find_packages, setup

setup(
    name="symphony",
    version="0.1.0",
    description="LLM serving system that runs LLM Inference Programs (LIPs)",
    packages=find_packages(include=["symphony", "symphony.*"]),
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
    ],
    extras_require={"test": ["pytest", "pytest-benchmark", "hypothesis", "jsonschema"]},
    entry_points={"console_scripts": [
        "symphony=symphony.cli:main",
        "symphony-kernel=symphony.cli:kernel_main",
    ]},
)
