"""Install blockdiff: the top-level folders become one namespace, ``blockdiff.<name>``.

    pip install -e .[dev]      # CPU: tests, notebooks, parity tests (torch's CPU build first: README "Set up and run")
    pip install -e .[cute]     # GPU: FlashAttention-4 + CuTe DSL backend

``.[vllm,cute]`` does not resolve (vLLM 0.26.0 pins nvidia-cutlass-dsl 4.6.0 and apache-tvm-ffi 0.1.10; 0.33.0 pins
torch 2.14.0, whose triton 3.8 is outside ``triton<3.7``): integration/README.md ("vLLM") installs the two.
"""
import os

from setuptools import setup

TOP = ["attention", "sampler", "model", "integration", "bench"]
# every folder with an __init__.py below a top-level folder is a subpackage (blockdiff.attention.triton, ...)
PACKAGES = [os.path.join(root).replace(os.sep, ".") for top in TOP for root, _, files in os.walk(top)
            if "__init__.py" in files]

setup(
    name="blockdiff",
    version="0.1.0",
    description="Kernels, sampler and vLLM integration for block-diffusion language models (DiffusionGemma)",
    python_requires=">=3.10",
    packages=[f"blockdiff.{p}" for p in PACKAGES],  # "blockdiff" itself is a PEP 420 namespace
    package_dir={f"blockdiff.{p}": p.replace(".", "/") for p in PACKAGES},
    # trained checkpoints ship inside the package: model/checkpoints/<name>/{model.safetensors, config.json,
    # tokenizer.json, loss.png, train_log.json} (blockdiff.model.pretrained; <= 10 MB each, tests/model check)
    package_data={"blockdiff.model": ["checkpoints/*/*"]},
    install_requires=["torch>=2.11", "triton>=3.6,<3.7", "numpy", "matplotlib", "tqdm", "safetensors"],
    extras_require={
        "dev": [
            "pytest", "pytest-xdist>=3.8", "hypothesis", "pytest-benchmark", "matplotlib",  # xdist: README's `-n 2`
            "nbclient", "nbformat", "ipykernel", "transformers>=5.12",
            "import-linter>=2.17,<3",  # the layering contracts (.importlinter, tests/test_layering.py); brings grimp
        ],
        "cute": ["flash-attn-4==4.0.0b36", "nvidia-cutlass-dsl[cu13]==4.8.1"],
        # integration/vllm_compat.py accepts 0.26.x and >= 0.33 (checked: 0.26.0, 0.33.0) and refuses the rest
        "vllm": ["vllm>=0.26,!=0.27.*,!=0.28.*,!=0.29.*,!=0.30.*,!=0.31.*,!=0.32.*"],
    },
    entry_points={
        "console_scripts": ["blockdiff = blockdiff.integration.cli:main"],
        "vllm.general_plugins": ["blockdiff = blockdiff.integration.vllm_plugin:register",
                                  # the serving benchmark's load format dummy_live (bench/dummy_weights.py)
                                  "blockdiff_bench = blockdiff.bench.dummy_weights:register"],
    },
)
