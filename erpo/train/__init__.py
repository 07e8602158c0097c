"""The training loop (`loop.train`) and its stages, in the order one rollout step runs them: `rollout_stage`
(generate, reward, `advantages`), `step_plan` (micro-batches, old log-probs, w(q)), `update_step` (loss and
optimizer step through an `updater`), `metrics` (metrics.jsonl, TensorBoard); around them the checks of a config
before it runs (`preflight`), the run directory (`run_dir`), checkpoints (`checkpoint`, `rng`) and the graceful stop
(`stop`)."""
