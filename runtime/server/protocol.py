"""Request bodies, OpenAI-shaped with vLLM's extensions, bounded on every number.

Static bounds live here (pydantic Field); bounds that depend on the model (context
length, vocabulary, KV capacity) are checked in serving.py. Unknown fields are
ignored, as OpenAI's own API and vLLM do.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, field_validator

MAX_TOKENS_BOUND = 1 << 20  # far above any context we serve; the model's own limit is checked later
TokenId = Annotated[StrictInt, Field(ge=0, le=1 << 31)]
Seed = Annotated[StrictInt, Field(ge=-(1 << 63), le=(1 << 64) - 1)]  # torch.Generator.manual_seed's range
Priority = Annotated[StrictInt, Field(ge=-(1 << 31), le=(1 << 31) - 1)]
StopStr = Annotated[StrictStr, Field(min_length=1, max_length=256)]
Num = StrictFloat  # accepts JSON ints and floats; strings like "0.5" and booleans are refused
# OpenAI's `metadata`: labels the request log keeps for calibration (task type, tenant, conversation).
METADATA_MAX_PAIRS, METADATA_MAX_KEY, METADATA_MAX_VALUE = 16, 64, 512


def check_metadata(value: object) -> dict[str, str] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(f"must be an object of string keys and string values, got {type(value).__name__}")
    if len(value) > METADATA_MAX_PAIRS:
        raise ValueError(f"may hold at most {METADATA_MAX_PAIRS} key-value pairs, got {len(value)}")
    for k, v in value.items():
        if not isinstance(v, str):
            raise ValueError(f"value of {k!r} must be a string, got {type(v).__name__}")
        if len(k) > METADATA_MAX_KEY:
            raise ValueError(f"keys must be at most {METADATA_MAX_KEY} characters, got {len(k)} ({k[:20]!r}...)")
        if len(v) > METADATA_MAX_VALUE:
            raise ValueError(f"value of {k!r} must be at most {METADATA_MAX_VALUE} characters, got {len(v)}")
    return value


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class SamplingFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    max_tokens: Annotated[StrictInt, Field(ge=1, le=MAX_TOKENS_BOUND)] | None = None
    temperature: Annotated[Num, Field(ge=0, le=100, allow_inf_nan=False)] | None = None
    top_p: Annotated[Num, Field(gt=0, le=1, allow_inf_nan=False)] | None = None
    top_k: Annotated[StrictInt, Field(ge=-1, le=1 << 20)] | None = None
    min_p: Annotated[Num, Field(ge=0, le=1, allow_inf_nan=False)] | None = None
    seed: Seed | None = None
    stop: StopStr | Annotated[list[StopStr], Field(max_length=16)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=64)] | None = None
    n: Annotated[StrictInt, Field(ge=1, le=128)] = 1
    ignore_eos: StrictBool = False
    min_tokens: Annotated[StrictInt, Field(ge=0, le=MAX_TOKENS_BOUND)] = 0
    priority: Priority = 0
    user: Annotated[StrictStr, Field(max_length=256)] | None = None
    metadata: dict | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    skip_special_tokens: StrictBool = True
    # Accepted for compatibility; only their defaults are supported (checked in serving.py).
    presence_penalty: Annotated[Num, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[Num, Field(ge=-2, le=2)] | None = None

    _metadata = field_validator("metadata", mode="before")(check_metadata)


PromptIds = Annotated[list[TokenId], Field(min_length=1, max_length=1 << 20)]


class CompletionRequest(SamplingFields):
    prompt: StrictStr | PromptIds | list[StrictStr] | list[PromptIds]
    logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None
    echo: StrictBool = False
    best_of: Annotated[StrictInt, Field(ge=1, le=128)] | None = None


class TextPart(BaseModel):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None


class ChatRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=4096)]
    max_completion_tokens: Annotated[StrictInt, Field(ge=1, le=MAX_TOKENS_BOUND)] | None = None
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None
    add_generation_prompt: StrictBool = True


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=4096)] | None = None
    add_generation_prompt: StrictBool = True
    add_special_tokens: StrictBool = True  # the model's BOS, where its tokenizer adds one


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    tokens: Annotated[list[TokenId], Field(max_length=1 << 20)]
