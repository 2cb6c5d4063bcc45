"""Which pools serve which model, and what a request's `model` resolves to. Pure: the pools (their declared
`models`) and what each pool's replicas list on /v1/models come in; no I/O.

A pool that declares its models (pools file `model:` / `models:`) serves those, and the LoRA adapters its
replicas list (an adapter of a replica is an adapter of the pool's model), and the adapters it loads on
demand (`adapters:`). A pool that declares
none serves what its replicas list (the union over its members whose /v1/models answered); until one of them
has answered, the pool is *unlearned*: a model no pool is known to serve is then "not known yet" (503, retry),
not "does not exist" (404).

Resolution of a request's model, in order:
1. absent (`model` missing or null): the router's `--default-model` when set, else 400 naming `model`;
2. a tenant with a `models:` allow-list that does not list it: the same 404 as an unknown model (a tenant cannot
   probe which models exist);
3. served by at least one pool: those pools (file order);
4. else, while some pool is unlearned: 503 + Retry-After; else 404 `model_not_found`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from router.pools.choice import PoolSpec
from router.refusal import Refusal, refuse


@dataclass(frozen=True)
class ModelCatalog:
    """model -> the names of the pools that serve it (file order), and the pools not learned yet."""

    pools_of: Mapping[str, tuple[str, ...]]
    unlearned: tuple[str, ...] = ()

    @property
    def models(self) -> tuple[str, ...]:
        return tuple(self.pools_of)


def catalog(pools: Sequence[PoolSpec], learned: Mapping[str, frozenset[str]],
            adapters: Mapping[str, frozenset[str]] = MappingProxyType({})) -> ModelCatalog:
    """The catalog of `pools`; `learned[pool]`: the models its replicas list (absent: none has answered);
    `adapters[pool]`: of those, the LoRA adapters (listed with a parent model)."""
    pools_of: dict[str, list[str]] = {}
    unlearned = []
    for p in pools:
        names = (*p.models, *sorted(adapters.get(p.name, ()))) if p.models else learned.get(p.name)
        on_demand = tuple(name for name, _ in p.adapters)  # its replicas load these when asked: always served
        if names is None and not on_demand:
            unlearned.append(p.name)
            continue
        if names is None:
            unlearned.append(p.name)
            names = ()
        for m in dict.fromkeys([*(sorted(names) if not p.models else names), *on_demand]):
            pools_of.setdefault(m, []).append(p.name)
    return ModelCatalog(MappingProxyType({m: tuple(ps) for m, ps in pools_of.items()}), tuple(unlearned))


def model_not_found(model: str) -> Refusal:
    """OpenAI's answer for a model that does not exist or that this caller may not use (the same, on purpose)."""
    return refuse(404, f"The model `{model}` does not exist or you do not have access to it.", "model_not_found",
                  "model", "model_not_found")


def resolve_model(requested: str | None, default_model: str | None, allowed: frozenset[str] | None,
                  cat: ModelCatalog) -> tuple[str, tuple[str, ...]] | Refusal:
    """(the model, the pools that serve it), or the refusal (rules in the module docstring)."""
    model = requested if requested is not None else default_model
    if model is None:
        return refuse(400, "you must provide a model parameter", "missing_model", "model", "missing_required_parameter")
    if allowed is not None and model not in allowed:
        return model_not_found(model)
    pools = cat.pools_of.get(model)
    if pools:
        return model, pools
    if cat.unlearned:
        return refuse(503, f"no replica has listed its models yet (pools {', '.join(cat.unlearned)}); retry",
                      "no_ready_replica", None, "no_ready_replica", [(b"retry-after", b"1")])
    return model_not_found(model)
