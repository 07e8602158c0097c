"""`erpo eval`'s defaults and named temperature grids. A module of its own without imports, so that the `erpo`
parser shows them without loading torch and the models (erpo.cli.eval)."""

# Named temperature grids for --temperatures. "paper": the grid the paper's range means are formed over (its
# Table 2: every "<= 1.0" mean is a mean of 10 temperatures 0.1..1.0 and most "1.2-1.5" means one of 1.2..1.5;
# docs/evaluation.md). "quick": five points of it, the columns the paper prints.
TEMPERATURE_GRIDS = {
    "paper": (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.2, 1.3, 1.4, 1.5),
    "quick": (0.1, 0.6, 1.0, 1.2, 1.5),
}
DEFAULT_TEMPERATURES = "paper"
DEFAULT_K = 32   # samples per problem
DEFAULT_MAX_NEW_TOKENS = 3000  # one budget for every model of a comparison: Dr.GRPO's evaluation budget
