"""`quantpipe pipeline`: a recipe's candidates through calibrate, quantize, kernels, eval,
gate and publish, publishing the cheapest candidate that passes the gate.

    from quantpipe.pipeline import PipelineRecipe, run_pipeline
    code = run_pipeline(PipelineRecipe.load("evals/recipes/default.yaml"))

Files: recipe.py (PipelineRecipe, validated once), run.py (the steps), search.py (serving
bytes, the winner, search.json), html.py (search.html), cli.py.
"""

from quantpipe.pipeline.recipe import DEFAULT_RECIPE, Candidate, PipelineRecipe
from quantpipe.pipeline.run import run_pipeline

__all__ = ["DEFAULT_RECIPE", "Candidate", "PipelineRecipe", "run_pipeline"]
