"""The MLflow pyfunc flavour of a quantpipe artifact: `predict` generates text with the runtime.

    mlflow.pyfunc.load_model("models:/NAME@champion").predict(["Hello"])

The artifact folder travels inside the logged model (MLflow artifact "artifact"); the
model loads it with the quantpipe runtime on first use, float32 on CPU unless
`params={"dtype": ...}` says otherwise.
"""

from __future__ import annotations

import mlflow.pyfunc

PREDICT_PARAMS = {"max_tokens": 64, "temperature": 0.0, "dtype": "float32"}  # predict's params and defaults


class QuantpipeModel(mlflow.pyfunc.PythonModel):
    def load_context(self, context) -> None:
        self.path = context.artifacts["artifact"]
        self.llm = None

    def _engine(self, dtype: str):
        if self.llm is None:
            from quantpipe.runtime import LLM

            self.llm = LLM(self.path, dtype=dtype, kv_cache_memory="256MiB")
        return self.llm

    def predict(self, context, model_input, params: dict | None = None) -> list[str]:
        from quantpipe.runtime import SamplingParams

        params = {**PREDICT_PARAMS, **(params or {})}
        prompts = _prompts(model_input)
        llm = self._engine(params["dtype"])
        sp = SamplingParams(max_tokens=int(params["max_tokens"]), temperature=float(params["temperature"]))
        return [o.outputs[0].text for o in llm.generate(prompts, sp)]


def _prompts(model_input) -> list[str]:
    """A list of strings, or a DataFrame / dict with a `prompt` column."""
    if isinstance(model_input, str):
        return [model_input]
    if hasattr(model_input, "columns"):
        col = "prompt" if "prompt" in model_input.columns else model_input.columns[0]
        return [str(x) for x in model_input[col]]
    if isinstance(model_input, dict):
        return [str(x) for x in model_input["prompt"]]
    return [str(x) for x in model_input]
