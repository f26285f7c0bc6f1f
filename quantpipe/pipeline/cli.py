"""`quantpipe pipeline`: a thin layer over run_pipeline(PipelineRecipe); flags override the recipe."""

from __future__ import annotations

from dataclasses import replace

import click

from quantpipe import distributed
from quantpipe.manifest import StageError
from quantpipe.pipeline.recipe import check_name
from quantpipe.quantize.config import CLIPS, KV_CACHES, METHODS, SCHEMES

# Flags that, when any is given, replace the recipe's candidates by one built from them.
CANDIDATE_FLAGS = ("scheme", "method", "group_size", "clip", "kv_cache", "bits_budget")


@click.command("pipeline", help="calibrate -> quantize each candidate -> kernels -> eval -> gate -> publish the "
                                "cheapest candidate that passes; reuses unchanged steps. Exit 0 passed (published "
                                "unless --no-publish), 1 no candidate passed, 2 cannot judge or bad input.")
@click.argument("model", required=False, default=None)
@click.option("--recipe", default=None, help="pipeline recipe [default: evals/recipes/default.yaml]")
@click.option("--name", default=None, help="artifacts/NAME/, reports/NAME/ and the registered model "
                                           "[default: the recipe's name; a recipe with name: null takes the model's]")
@click.option("--scheme", type=click.Choice(SCHEMES), default=None,
              help="one candidate of this scheme instead of the recipe's candidates (so do the flags below)")
@click.option("--method", type=click.Choice(METHODS), default=None, help="with --scheme [default: rtn]")
@click.option("--group-size", type=int, default=None)
@click.option("--clip", type=click.Choice(CLIPS), default=None)
@click.option("--kv-cache", type=click.Choice(KV_CACHES), default=None)
@click.option("--bits-budget", type=float, default=None, help="scheme mixed: average bits per weight")
@click.option("--logs", multiple=True, help="request logs [default: the recipe's calibrate logs]")
@click.option("--calib-recipe", default=None, help="calibrate recipe file, over the recipe's calibrate.recipe")
@click.option("--calib", default=None, help="an existing calibration set instead of calibrating")
@click.option("--policy", default=None, help="gate policy [default: the recipe's, else evals/gates/default.yaml]")
@click.option("--suite", default=None, help="eval suite [default: the recipe's, else evals/suites/default.yaml]")
@click.option("--registry-uri", default=None,
              help="[default: the recipe's, else MLFLOW_TRACKING_URI, else sqlite:///.quantpipe/registry.db]")
@click.option("--publish/--no-publish", "publish_model", default=None,
              help="--no-publish stops after the gate (a CI run on a pull request) [default: the recipe's]")
@distributed.cli_options("calibrate reads the logs through Ray Data, candidates are quantized in parallel and "
                         "evaluated as Ray tasks; the outputs are the same")
def pipeline_command(model, recipe, name, logs, calib_recipe, calib, policy, suite, registry_uri, publish_model,
                     ray, ray_cpus, ray_gpus, **candidate) -> int:
    from quantpipe.pipeline import PipelineRecipe, run_pipeline

    try:
        r = apply_flags(PipelineRecipe.load(recipe), name=name, logs=list(logs), calib_recipe=calib_recipe,
                        calib=calib, policy=policy, suite=suite, registry=registry_uri, publish=publish_model,
                        candidate=candidate)
        return run_pipeline(r, model, ray=ray, resources=distributed.TaskResources(num_cpus=ray_cpus, num_gpus=ray_gpus))
    except StageError as e:
        click.echo(f"quantpipe pipeline: {e}", err=True)
        return 2


def apply_flags(r, name=None, logs=(), calib_recipe=None, calib=None, policy=None, suite=None, registry=None,
                publish=None, candidate=None):
    """The recipe with the command line's flags over it, validated like the recipe itself."""
    if name is not None:
        check_name(name, "--name")
        r = replace(r, name=name)
    if calib is not None:
        if logs or calib_recipe:
            raise StageError("--calib (an existing set) takes no --logs or --calib-recipe")
        r = r.with_calibrate({"set": calib}, "--calib")
    elif logs or calib_recipe:
        recipe_file = calib_recipe or r.calib_recipe
        section = {**({"recipe": recipe_file} if recipe_file else {}), **r.calib_fields,
                   **({"logs": list(logs)} if logs else {})}
        r = r.with_calibrate(section, "--logs/--calib-recipe")
    given = {k: v for k, v in (candidate or {}).items() if v is not None}
    if given:
        r = r.with_candidates([given], "flags (--scheme ...)")
    return replace(r, policy=policy or r.policy, suite=suite or r.suite, registry=registry or r.registry,
                   publish=r.publish if publish is None else publish)
