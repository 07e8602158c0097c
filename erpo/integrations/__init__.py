"""ERPO inside other trainers. `erpo.integrations.trl`: ERPOConfig / ERPOTrainer for TRL's GRPOTrainer
(extra `erpo[trl]`). `erpo.integrations.verl`: the ERPO actor loss for verl's model-engine workers, and
`erpo.integrations.verl_trainer`: verl's trainer mode `erpo` (extra `erpo[verl]`). docs/integrations.md."""
