"""Evaluation harness: recipe-driven server launcher, OpenAI-compatible eval client, graders
for GPQA-Diamond, AIME 2025, MATH-500 and HumanEval, resumable runs and paired comparisons.

Modules: ``recipe`` (recipe.toml schema and loader), ``launcher`` (server command; the process
through ``sglang_oscar.serving_launcher``), ``client`` (chat completions with retries), ``datasets`` (hub / local files),
``tasks`` (prompts), ``graders`` (answer extraction), ``runner`` (resumable run),
``compare`` (paired statistics), ``recipe_run`` (``eval-recipe``), ``cli`` (verbs).
See docs/evals.md and docs/recipes.md.
"""
