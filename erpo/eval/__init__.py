"""Evaluation over temperatures (the paper's section 5): problem sets (`problem_sets`), which models and prompts
(`model_specs`), sampling and its cache (`sampling`, `sample_cache`), Pass@k / Avg@k (`metrics`), tables
(`tables`) and the whole run (`evaluate`). Evaluation never imports the trainer."""
