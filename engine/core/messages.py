"""What crosses between the front end (engine/async_engine.py) and the engine core, in either direction.

Front end → core: `AddRequest` (a request already admitted by engine/admission.py, so the core trusts it),
`Abort` (a request, or one completion a stop string ended), `DropAdapter` (a LoRA adapter was unloaded: free
its weights), `ExportBlocks` / `ImportBlocks` (KV blocks for or from a peer engine, answered by a
`TransferDone` in the next report), `Stop`. Core → front end: `CoreInfo` once, when the model is loaded and
the KV cache sized, then a `TurnReport` after every turn that changed something (token ids: the text is
the front end's, engine/output_text.py), and `CoreFailed` if the core cannot go on. Plain frozen dataclasses
of ints, strings and the engine's own dataclasses: pickled as they are (a 64-request
report is ~9 KB and 0.15 ms to pickle on this machine's CPU), with no framing of our own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from contract.kv_events import KVEvent
from engine.admission import EngineLimits
from engine.outputs import RequestDelta
from engine.sampling_params import SamplingParams
from engine.stats import EngineStats


@dataclass(frozen=True)
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None
    arrival_time: float


@dataclass(frozen=True)
class Abort:
    """Stop a request (its last deltas say "abort"), or with `index` one of its completions, which a stop string
    ended in the front end (engine/output_text.py; no delta: the front end has its finish)."""

    request_id: str
    index: int | None = None


@dataclass(frozen=True)
class Stop:
    """Abort whatever runs (its last deltas are reported) and end the core."""


@dataclass(frozen=True)
class DropAdapter:
    """The LoRA adapter load `adapter_id` was unloaded: the core frees its weights, unless a request still runs
    under it (then --max-cpu-loras' least-recently-used order frees them later)."""

    adapter_id: int


@dataclass(frozen=True)
class ExportBlocks:
    """Copy out the leading run of `hashes` the prefix cache holds, at most max_blocks (a peer pulls them), into
    the arena's bytes [offset, offset + size) (engine/core/arena.py)."""

    transfer_id: int
    hashes: tuple[int, ...]
    max_blocks: int
    region: tuple[int, int]  # (offset, size) in the arena


@dataclass(frozen=True)
class ImportBlocks:
    """Take in verified blocks of a peer that follow `prefix` in one hash chain (engine/kv/transfer.py), their
    payload in the arena's bytes [offset, offset + size)."""

    transfer_id: int
    prefix: tuple[int, ...]
    hashes: tuple[int, ...]
    tokens: tuple[tuple[int, ...], ...]
    lora: str | None
    region: tuple[int, int]  # (offset, size) in the arena


Command = AddRequest | Abort | DropAdapter | ExportBlocks | ImportBlocks | Stop


@dataclass(frozen=True)
class TransferDone:
    """The answer to an ExportBlocks (the blocks found and their payload) or an ImportBlocks (how many it took
    and how many it held already)."""

    transfer_id: int
    hashes: tuple[int, ...] = ()
    tokens: tuple[tuple[int, ...], ...] = ()
    lora: str | None = None
    size: int = 0  # export: payload bytes the core wrote into the command's region
    payload: bytes = field(default=b"", repr=False)  # export: those bytes, copied out by the front end
    imported: int = 0
    present: int = 0
    pending: bool = False  # export: the next block asked for is being computed here (ask again soon)
    error: BaseException | None = None  # the core could not do it (the caller counts a failed transfer)
    # time.monotonic() when the core took the command up (one clock for both processes: they share a host); the
    # caller's wait before it is the core finishing its step, not moving KV
    started_at: float = 0.0


@dataclass(frozen=True)
class CoreInfo:
    """What the front end needs of a loaded engine: names, limits, and the prefix cache it starts from."""

    model_name: str
    limits: EngineLimits
    hash_seed: int
    vocab_size: int  # the model's (the tokenizer's may be smaller)
    cached_hashes: list[int]
    last_event_seq: int
    layout: object  # contract.kv_transfer.Layout of its KV cache, for transfers between engines
    pid: int  # the core process's; 0 when the core is a thread of the front end's process
    stats: EngineStats  # at start


@dataclass(frozen=True)
class TurnReport:
    """One turn of the core: deltas, requests refused when added, KV events, and the stats after it."""

    outputs: list[RequestDelta]
    errors: list[tuple[str, BaseException]] = field(default_factory=list)
    events: list[KVEvent] = field(default_factory=list)
    stats: EngineStats | None = None
    stopped: bool = False  # the core ended after this report (a Stop was applied)
    transfers: list[TransferDone] = field(default_factory=list)


@dataclass(frozen=True)
class CoreFailed:
    """The core could not start or its loop died; `error` is the exception, its text for the logs."""

    error: BaseException
    during_start: bool


def portable(error: BaseException) -> BaseException:
    """The error itself if it survives pickling, else a RuntimeError with its type and text."""
    import pickle

    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - an exception type with an unusual constructor
        return RuntimeError(f"{type(error).__name__}: {error}")
