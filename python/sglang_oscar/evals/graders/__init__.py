"""Answer extraction and scoring, one module per task (see docs/evals.md for the rules)."""
