"""ERPO inside other trainers. `erpo.integrations.trl`: ERPOConfig / ERPOTrainer for TRL's GRPOTrainer
(extra `erpo[trl]`); verl: the recipe in docs/integrations.md."""
