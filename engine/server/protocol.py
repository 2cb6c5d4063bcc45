"""OpenAI wire format for /v1/chat/completions and /v1/completions, plus vLLM's extra fields.

Request models are strict (no "5" for an int, no true for a number, no NaN) and validate ranges, so
bad input is rejected at the edge with a 400 that names the field. Structured outputs: `response_format`
(json_object, json_schema), vLLM's `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` and
`structured_outputs`, and (chat) `tools`, `tool_choice`, `parallel_tool_calls`; their meaning is
engine/server/structured.py's. OpenAI fields this server does not implement (functions, function_call,
audio; tools on /v1/completions) are refused with a 400 naming the field unless their value asks for
nothing, so an agent never gets plain text where it asked for something else. Other unknown fields are
ignored. Responses are plain dicts built by the handlers (chat.py, completions.py); only requests need models.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from contract.request import COMPLETIONS_DEFAULT_MAX_TOKENS, MAX_N, lone_surrogate_path, max_tokens_of
from engine.sampling_params import SamplingParams

MAX_LOGPROBS = 20
MAX_STOP = 16
MAX_PROMPTS = 64  # prompts in one /v1/completions batch

_STRICT = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")

TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]

_NO_OPS: dict[str, tuple] = {  # values of unimplemented fields that ask for the default behaviour
    "tools": (None, []), "functions": (None, []), "tool_choice": (None, "none", "auto"),
    "function_call": (None, "none", "auto"), "audio": (None,),
}
_TOOL_NAME = r"^[a-zA-Z0-9_.-]{1,64}$"


class CacheControl(BaseModel):
    """Anthropic's cache breakpoint (contract/cache_control.py): the prompt up to what carries it is pinned in the
    KV cache for the TTL (engine/server/prompt_cache.py). Never dumped: the chat template does not see it."""

    model_config = _STRICT
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] = "5m"


class TextPart(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = Field(None, exclude=True)


class FunctionCall(BaseModel):
    model_config = _STRICT
    name: str
    arguments: str


class ToolCallMessage(BaseModel):
    model_config = _STRICT
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallMessage] | None = None  # assistant
    tool_call_id: str | None = None  # tool
    cache_control: CacheControl | None = Field(None, exclude=True)

    @model_validator(mode="after")
    def _content_needed(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs 'content'")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return self


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    schema_: dict | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = _STRICT
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_needed(self) -> ResponseFormat:
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise ValueError("a json_schema response_format needs json_schema.schema")
        return self


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` (one of its fields)."""

    model_config = _STRICT
    json_: dict | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: Annotated[list[str], Field(min_length=1)] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class FunctionDef(BaseModel):
    model_config = _STRICT
    name: str = Field(pattern=_TOOL_NAME)
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    function: FunctionDef
    cache_control: CacheControl | None = Field(None, exclude=True)


class NamedFunction(BaseModel):
    model_config = _STRICT
    name: str


class NamedToolChoice(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingRequest(BaseModel):
    """Fields shared by chat and completions (OpenAI + vLLM extras)."""

    model_config = _STRICT
    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=100.0)
    top_p: float | None = Field(None, ge=1e-8, le=1.0)  # a smaller top_p rounds to 0 in float32: keep nothing
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # OpenAI's prompt caching: a routing hint (read by routers) and a retention (the engine's LRU and lower tier
    # keep prefixes as long as they can either way: with --kv-tier-gib every evicted block goes to the lower tier,
    # which "24h" asks for); validated as the router's contract/request.py validates them
    prompt_cache_key: str | None = Field(None, min_length=1, max_length=1024)
    prompt_cache_retention: Literal["in_memory", "in-memory", "24h"] | None = None
    # vLLM extras
    top_k: int | None = Field(None, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    # below ~1e-37 logits / penalty overflow to inf; 0.01 is already a 100x sharpening
    repetition_penalty: float = Field(1.0, ge=0.01, le=10.0)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    cache_salt: str | None = Field(None, min_length=1, max_length=256)
    priority: int = Field(0, ge=-2**31, le=2**31 - 1)  # vLLM's: lower runs first under --scheduling-policy priority
    return_token_ids: bool = False  # vLLM's: token ids in the response (contract/token_ids.py)
    # structured outputs (engine/server/structured.py)
    response_format: ResponseFormat | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1)] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None
    # OpenAI fields not implemented here: accepted only with values that ask for nothing
    functions: Any = None
    function_call: Any = None
    audio: Any = None

    @field_validator("functions", "function_call", "audio")
    @classmethod
    def _not_implemented(cls, v, info: ValidationInfo):
        return _nothing_asked(v, info.field_name)

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOP or any(not s for s in stops):
            raise ValueError(f"stop must be a non-empty string or a list of at most {MAX_STOP} non-empty strings")
        return v

    @field_validator("stream_options")
    @classmethod
    def _check_stream_options(cls, v, info: ValidationInfo):
        if v is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed when stream is true")
        return v

    def stop_list(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, logit_bias: tuple) -> SamplingParams:
        """SamplingParams for this request (raises SamplingParamsError naming the field)."""
        return SamplingParams(
            n=self.n, max_tokens=max_tokens, min_tokens=self.min_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k, min_p=self.min_p,
            repetition_penalty=self.repetition_penalty, frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty, seed=self.seed, stop=self.stop_list(),
            stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos,
            logit_bias=logit_bias, logprobs=logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens, priority=self.priority)


def _unicode_text(v, field: str):
    """No lone UTF-16 surrogate in the text the tokenizer reads (valid JSON, but no tokenizer can encode it)."""
    path = lone_surrogate_path(v, field)
    if path is not None:
        raise ValueError(f"{path} holds a lone UTF-16 surrogate (not valid Unicode text)")
    return v


def _nothing_asked(v, field: str):
    if v in _NO_OPS[field]:
        return v
    raise ValueError(f"{field} is not supported by this server (use tools / tool_choice on /v1/chat/completions; "
                     f"audio is not implemented); send the request without it")


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(..., min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True

    @field_validator("messages", "tools", mode="before")
    @classmethod
    def _valid_text(cls, v, info: ValidationInfo):
        return _unicode_text(v, info.field_name)

    @field_validator("top_logprobs")
    @classmethod
    def _check_top_logprobs(cls, v, info: ValidationInfo):
        if v is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs set to true")
        return v

    def requested_max_tokens(self) -> int | None:
        return max_tokens_of(self.max_completion_tokens, self.max_tokens)

    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


PromptType = str | Annotated[list[str], Field(min_length=1)] | Annotated[list[TokenId], Field(min_length=1)] \
    | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]


class CompletionRequest(_SamplingRequest):
    prompt: PromptType
    tools: Any = None
    tool_choice: Any = None

    @field_validator("tools", "tool_choice")
    @classmethod
    def _no_tools(cls, v, info: ValidationInfo):
        return _nothing_asked(v, info.field_name)
    max_tokens: int | None = Field(COMPLETIONS_DEFAULT_MAX_TOKENS, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, v):
        _unicode_text(v, "prompt")
        if isinstance(v, list) and v and not isinstance(v[0], int) and len(v) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request")
        return v

    @field_validator("echo")
    @classmethod
    def _check_echo(cls, v, info: ValidationInfo):
        if v and info.data.get("logprobs") is not None:
            raise ValueError("echo together with logprobs is not supported")
        return v

    @field_validator("best_of")
    @classmethod
    def _check_best_of(cls, v, info: ValidationInfo):
        if v is not None and v != info.data.get("n", 1):
            raise ValueError("best_of other than n is not supported")
        return v

    @field_validator("suffix")
    @classmethod
    def _check_suffix(cls, v):
        if v:
            raise ValueError("suffix is not supported")
        return v

    def prompts(self) -> list[str | list[int]]:
        """The prompt(s) as a list: text prompts and/or token id lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [list(p)]
        return list(p)
