"""LoRA adapters at the HTTP edge: which adapter names this replica serves, and vLLM's endpoints to change that.

`LoRARegistry` maps an adapter name (what a request sends as its `model`) to a `LoRARequest` (name, a number
unique to this load, its directory). Adapters come from --lora-modules at start and from
`POST /v1/load_lora_adapter` {"lora_name", "lora_path"}; `POST /v1/unload_lora_adapter` {"lora_name"} forgets
one. A load reads and checks the adapter against the base model here (off the event loop), so a bad
directory, a mismatched base, a rank over --max-lora-rank or an unsupported target module is a 400 naming
the field, and nothing reaches the engine; the engine core then reads it again the first time a request
names it (and keeps up to --max-cpu-loras in memory). Both endpoints need the internal token when one is set.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import PlainTextResponse

from engine.errors import LoRAError
from engine.lora.request import LoRARequest
from engine.server.errors import APIError, bad_request
from engine.server.kv_events import check_internal_token

if TYPE_CHECKING:
    from engine.model.llama import ModelConfig


class LoRARegistry:
    def __init__(self, base_config: Callable[[], ModelConfig], max_rank: int, base_names: tuple[str, ...] = ()):
        """base_config: the base model's config (read when the first adapter is checked)."""
        self._base_config = base_config
        self._config: ModelConfig | None = None
        self.max_rank = max_rank
        self.base_names = base_names
        self.adapters: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    @classmethod
    def from_args(cls, args, base_names: tuple[str, ...] = ()) -> LoRARegistry | None:
        """The registry of an engine started with these EngineArgs, its --lora-modules checked and registered;
        None when LoRA is off. Raises LoRAError for a bad --lora-modules directory."""
        if not args.lora_enabled:
            return None

        def base_config() -> ModelConfig:
            from engine.model.llama import ModelConfig
            from engine.model.loader import load_hf_config
            from engine.model.registry import resolve_model

            return ModelConfig.from_hf(load_hf_config(resolve_model(args.model, args.allow_download)))

        registry = cls(base_config, args.max_lora_rank, base_names or (args.model_name,))
        for name, path in args.lora_modules:
            registry.add(name, path)
        return registry

    def get(self, name: str | None) -> LoRARequest | None:
        return None if name is None else self.adapters.get(name)

    def add(self, name: str, path: str) -> LoRARequest:
        """Check the adapter at path and serve it as `name` (LoRAError naming the field if it cannot be)."""
        if not isinstance(name, str) or not name.strip():
            raise LoRAError("lora_name", "lora_name must be a non-empty string")
        if name in self.base_names:
            raise LoRAError("lora_name", f"lora_name {name!r} is the base model's name")
        if name in self.adapters:
            raise LoRAError("lora_name", f"the LoRA adapter {name!r} has already been loaded")
        if self._config is None:
            self._config = self._base_config()
        from engine.lora.adapter import load_adapter  # imports torch: a server without LoRA never does

        load_adapter(path, self._config, self.max_rank)  # raises LoRAError; the engine core reads it again
        if name in self.adapters:  # loaded meanwhile by a concurrent call
            raise LoRAError("lora_name", f"the LoRA adapter {name!r} has already been loaded")
        request = self.adapters[name] = LoRARequest(name, next(self._ids), path)
        return request

    def remove(self, name: str) -> LoRARequest | None:
        return self.adapters.pop(name, None)


async def _body(request: Request) -> dict:
    try:
        body = await request.json()
    except ValueError:
        raise bad_request("the body must be a JSON object") from None
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object")
    return body


def _registry(state) -> LoRARegistry:
    if state.lora is None:
        raise bad_request("LoRA adapters are not enabled on this engine (start it with --enable-lora or "
                          "--lora-modules)", None, "lora_disabled")
    return state.lora


async def load_lora_adapter(state, request: Request) -> PlainTextResponse:
    check_internal_token(state, request)
    registry = _registry(state)
    body = await _body(request)
    name, path = body.get("lora_name"), body.get("lora_path")
    if not isinstance(name, str) or not name.strip():
        raise bad_request("lora_name must be a non-empty string", "lora_name")
    if not isinstance(path, str) or not path.strip():
        raise bad_request("lora_path must be a non-empty string", "lora_path")
    try:
        await asyncio.to_thread(registry.add, name, path)
    except LoRAError as e:
        raise bad_request(str(e), e.param, e.code) from None
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(state, request: Request) -> PlainTextResponse:
    check_internal_token(state, request)
    registry = _registry(state)
    body = await _body(request)
    name = body.get("lora_name")
    if not isinstance(name, str) or not name.strip():
        raise bad_request("lora_name must be a non-empty string", "lora_name")
    gone = registry.remove(name)
    if gone is None:
        raise APIError(404, f"The LoRA adapter '{name}' cannot be found", "lora_name", "lora_adapter_not_found")
    drop = getattr(state.engine, "drop_adapter", None)
    if drop is not None:  # the engine core frees its weights (unless a request still runs under it)
        drop(gone.id)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


def model_cards(state, created: int, max_model_len: int) -> list[dict]:
    """The adapters' /v1/models entries: parent is the base model, root the adapter's directory (as vLLM)."""
    if state.lora is None:
        return []
    return [{"id": name, "object": "model", "created": created, "owned_by": "kvfleet", "root": lora.path,
             "parent": state.config.model_name, "max_model_len": max_model_len}
            for name, lora in state.lora.adapters.items()]
