"""erpo: a lean ERPO (Environment-Regularized Policy Optimization) trainer built on erpo_kernels.

Layers, each importing only those below it (enforced by import-linter, setup.cfg; map: docs/INTERFACES.md):
    cli            the `erpo` command
    integrations   ERPO inside other trainers (TRL)        train   the training loop and its stages
    eval           evaluation over temperatures            reference   the cached ell_theta0(q)
    rollout        rollout engines (HF, vLLM)
    models         loading, LoRA, export, the tiny model
    tasks          prompt data and rewards
    config, errors, distributed, atomic, records, sequences, plotting   shared ground
"""
__version__ = "0.1.0"
