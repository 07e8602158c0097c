"""ERPO inside other trainers. `erpo.integrations.trl`: ERPOConfig / ERPOTrainer for TRL's GRPOTrainer
(extra `erpo[trl]`). `erpo.integrations.verl`: the ERPO actor loss for verl's model-engine workers, and
`erpo.integrations.verl_trainer`: verl's trainer mode `erpo` (extra `erpo[verl]`). `erpo.integrations.openrlhf`:
ERPOPolicyLoss and actor_logprobs for OpenRLHF's actor step, and `openrlhf_reference` its cache. What verl's and
OpenRLHF's share: `query_reference` (the cache of ell_theta0(q) by prompt token ids) and `advantages`.
docs/integrations.md."""
