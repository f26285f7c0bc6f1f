"""quantpipe's runtime: the paged continuous-batching engine, its model code, the
OpenAI-compatible server and the load tester. `LLM` / `SamplingParams` are the offline API."""

from quantpipe.runtime.llm import LLM
from quantpipe.runtime.outputs import CompletionOutput, RequestOutput
from quantpipe.runtime.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
