from setuptools import find_packages, setup

# The base install is the loss (erpo_kernels) alone: torch, numpy and, on Linux, Triton (elsewhere the torch
# reference runs; backend="triton" says what is missing). torch >= 2.5: the kernels are torch.library custom ops
# whose signatures are read from `from __future__ import annotations` strings (pytorch PR 128809, after 2.4).
LOSS_REQUIRES = ["torch>=2.5", "numpy", 'triton>=3.2; platform_system == "Linux"']
# The versions the test suite runs the trainer with, in one place. The `train` extra asks for them, so that the
# README's two commands (`.[train]`, `.[test]`) in one environment, in either order, leave the trainer on the versions
# CI tested (tests/test_packaging.py checks that no requirement of the `test` extra bounds them otherwise):
# transformers < 5.11 and numpy >= 2.0: verl 0.9.1 (tested in CI) needs them; numpy < 2.4: Triton 3.6's interpreter
# (the kernel tests) needs it; antlr4 4.9.3: math-verify's parser (latex2sympy2_extended 1.11.0 accepts 4.9.3-4.13.2),
# 4.9.* because verl's hydra-core / omegaconf 2.3 need it; packaging < 26: verl's tensordict (pyvers) needs it.
# Triton is not among them: the trainer runs it only on CUDA, where it is the version torch's CUDA build pins (torch
# 2.13.0: triton 3.7.1), which no extra may contradict; the `test` extra pins the GPU image's (3.6.0) for the
# interpreter and the ahead-of-time sm_90 compile, on the CPU build of torch (which pins no Triton).
TESTED_VERSIONS = ["transformers>=4.46,<5.11", "numpy>=2.0,<2.4", "antlr4-python3-runtime==4.9.3", "packaging<26"]
# The trainer (`erpo train`, `erpo eval`, ...): the `train` extra; the `erpo` command names it when one is missing.
TRAIN_REQUIRES = [
    *TESTED_VERSIONS,
    "tokenizers",
    "safetensors",
    "pyyaml",
    "tqdm",
    "matplotlib",
    "tensorboard",
    "math-verify==0.9.0",   # the math reward's and `erpo eval`'s answer check (pure Python)
]

setup(
    name="erpo",
    version="0.1.0",
    description=("ERPO (Environment-Regularized Policy Optimization): a fused Triton loss and a lean RL trainer "
                 "for LLMs"),
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    # bench/ is a repository tool (`python -m bench` from a checkout), not an installed package
    packages=find_packages(include=["erpo", "erpo.*", "erpo_kernels", "erpo_kernels.*"]),
    package_data={"erpo": ["configs/*.yaml"]},
    install_requires=LOSS_REQUIRES,
    extras_require={
        # triton 3.6.0 is what the GPU image has (torch 2.11); the trainer's versions are TESTED_VERSIONS, above.
        # trl: the version erpo.integrations.trl is tested against (its loss must match GRPOTrainer's exactly);
        # verl likewise for erpo.integrations.verl (verl needs numpy >= 2.0 and transformers < 5.11), with what its
        # engine workers (uvicorn) and v1 trainer (TransferQueue, cachetools, fastapi) import. jmespath: TRL's tool
        # calls (its environment_factory tests) parse responses with it on transformers < 5.13.
        # ruff and import-linter: tests/repo/test_lint.py (style and the import contract), pinned so CI's verdict is
        # stable. pytest >= 8.2: the tests' `importorskip(..., exc_type=ModuleNotFoundError)` (a peer that is
        # installed but fails to import errors instead of skipping). pytest-xdist >= 3.8: the suite runs on every core,
        # its slowest files first (tests/conftest.py; 3.8 keeps the collection's order of files with --dist loadfile).
        "train": TRAIN_REQUIRES,
        "test": [*TRAIN_REQUIRES, "pytest>=8.2", "pytest-xdist>=3.8", "triton==3.6.0", "deepspeed", "accelerate",
                 "pandas", "pyarrow", "trl==1.16.0", "peft==0.21.2", "verl==0.9.1", "uvicorn", "TransferQueue==0.1.11",
                 "cachetools", "fastapi", "jmespath", "ruff==0.17.6", "import-linter==2.16"],
        # The extras below serve the trainer, so each brings the train extra along.
        "bench": [*TRAIN_REQUIRES, "pytest-benchmark", "liger-kernel==0.8.5", "cut-cross-entropy==25.1.1"],
        "deepspeed": [*TRAIN_REQUIRES, "deepspeed", "accelerate"],
        # the API erpo.rollout.vllm uses, checked against 0.10.2 and 0.33.0
        "vllm": [*TRAIN_REQUIRES, "vllm>=0.10.2,<0.34"],
        "trl": [*TRAIN_REQUIRES, "trl==1.16.0"],
        # erpo.integrations.verl (and its trainer mode `erpo`) is tested against it
        "verl": [*TRAIN_REQUIRES, "verl==0.9.1"],
        "lora": [*TRAIN_REQUIRES, "peft==0.21.2"],  # LoRA adapters (model.lora); the version the tests run with
        "data": [*TRAIN_REQUIRES, "datasets", "pyarrow"],
    },
    entry_points={"console_scripts": ["erpo=erpo.cli:run"],
                  # verl imports these on `import verl`: registers the trainer mode `trainer.v1.trainer_mode=erpo`
                  "verl.plugins": ["erpo=erpo.integrations.verl_trainer"]},
)
