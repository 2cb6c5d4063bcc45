"""KV blocks between engines, on the wire: what a pulling engine asks for and what the source streams back.

A pull is one HTTP request to the source engine, `POST /v1/kv/blocks` with `PullRequest.to_json()`: the
chained hashes of the blocks wanted, in prompt order, and the puller's `Layout`. The source answers 409
(`kv_layout_mismatch`) when its own layout differs, else 200 and a stream of frames, each

    u32 little-endian length of the meta | meta (JSON) | payload (meta["nbytes"] bytes)

A block frame's meta names its blocks (`hashes`, `tokens`: each block's token ids, `lora`: the adapter they
were computed under); its payload is the blocks' K and V, laid out [block, layer, K|V, slot, kv head, head dim]
in the layout's dtype. The frames cover the leading run of wanted hashes the source holds, in order, and those its running
prefill computes within `wait_s` (streamed as they are computed); the last frame is `{"end": true, "blocks": N}`. A stream that stops before it is incomplete (the source died),
and the puller keeps only the whole frames it read. Pure encoding, no I/O.
"""

from __future__ import annotations

import json
import struct
from dataclasses import asdict, dataclass, field
from enum import Enum

from contract.errors import ConfigError
from contract.hashing import hash_block

PATH = "/v1/kv/blocks"
PULL_HEADER = "x-kvfleet-kv-pull"  # router → engine: the replica URL to pull the request's prefix from
PENDING = "pending"  # ... followed by "; pending" when that replica is still computing it (just routed there)
_LEN = struct.Struct("<I")
MAX_META_BYTES = 1 << 20


@dataclass(frozen=True)
class Layout:
    """What two engines must agree on for one's blocks to be valid in the other's cache."""

    model: str
    block_size: int
    dtype: str  # torch's name: "bfloat16", "float32", ...
    num_layers: int
    num_kv_heads: int
    head_dim: int
    hash_seed: int

    @property
    def itemsize(self) -> int:
        return {"float32": 4, "bfloat16": 2, "float16": 2}[self.dtype]

    @property
    def block_bytes(self) -> int:
        """Bytes of one block's K and V over every layer."""
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * self.itemsize

    def mismatch(self, other: Layout) -> str | None:
        """The first field that differs from other's ("dtype", "block_size", ...), or None."""
        mine, theirs = asdict(self), asdict(other)
        return next((k for k in mine if mine[k] != theirs[k]), None)

    @classmethod
    def from_dict(cls, d: object) -> Layout:
        if not isinstance(d, dict):
            raise ConfigError("layout", "layout must be an object")
        try:
            return cls(model=str(d["model"]), block_size=int(d["block_size"]), dtype=str(d["dtype"]),
                       num_layers=int(d["num_layers"]), num_kv_heads=int(d["num_kv_heads"]),
                       head_dim=int(d["head_dim"]), hash_seed=int(d["hash_seed"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError("layout", f"layout is missing or has a bad field: {e}") from None


def pull_header(source: str, pending: bool) -> str:
    return f"{source}; {PENDING}" if pending else source


def parse_pull_header(value: str) -> tuple[str, bool]:
    """(the source URL as written, whether it is still computing the prefix)."""
    source, _, flag = value.partition(";")
    return source.strip(), flag.strip() == PENDING


@dataclass(frozen=True)
class PullRequest:
    hashes: tuple[int, ...]
    layout: Layout
    max_bytes: int  # the most payload the puller takes; the source stops before a frame would pass it
    wait_s: float = 0.0  # how long the source may wait for blocks its running prefill is computing
    expect_s: float = 0.0  # how long it may wait for the request that computes them to reach it (a router just sent it)

    def to_json(self) -> bytes:
        return json.dumps({"hashes": [f"{h:032x}" for h in self.hashes], "layout": asdict(self.layout),
                           "max_bytes": self.max_bytes, "wait_s": self.wait_s, "expect_s": self.expect_s}).encode()

    @classmethod
    def from_json(cls, body: bytes) -> PullRequest:
        try:
            d = json.loads(body)
        except ValueError:
            raise ConfigError("body", "the body must be JSON") from None
        if not isinstance(d, dict):
            raise ConfigError("body", "the body must be a JSON object")
        hashes = d.get("hashes")
        if not isinstance(hashes, list) or not all(isinstance(h, str) for h in hashes):
            raise ConfigError("hashes", "hashes must be a list of hex strings")
        try:
            parsed = tuple(int(h, 16) for h in hashes)
        except ValueError:
            raise ConfigError("hashes", "hashes must be a list of hex strings") from None
        max_bytes = d.get("max_bytes")
        if not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < 1:
            raise ConfigError("max_bytes", "max_bytes must be a positive integer")
        waits = []
        for name in ("wait_s", "expect_s"):
            value = d.get(name, 0.0)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < float("inf"):
                raise ConfigError(name, f"{name} must be a number of seconds >= 0")
            waits.append(float(value))
        return cls(parsed, Layout.from_dict(d.get("layout")), max_bytes, *waits)


@dataclass(frozen=True)
class BlockFrame:
    hashes: tuple[int, ...]
    tokens: tuple[tuple[int, ...], ...]
    lora: str | None
    payload: bytes = field(repr=False)
    waited_s: float = 0.0  # how long the source waited for its prefill to compute these blocks before sending them

    def encode(self) -> bytes:
        meta = json.dumps({"hashes": [f"{h:032x}" for h in self.hashes], "tokens": self.tokens, "lora": self.lora,
                           "nbytes": len(self.payload), "waited_s": round(self.waited_s, 6)}).encode()
        return _LEN.pack(len(meta)) + meta + self.payload


def end_frame(num_blocks: int) -> bytes:
    meta = json.dumps({"end": True, "blocks": num_blocks, "nbytes": 0}).encode()
    return _LEN.pack(len(meta)) + meta


class FrameError(ValueError):
    """The stream does not parse as frames."""


class FrameReader:
    """Feed it the bytes as they arrive; `frames()` hands back each whole frame once, `ended` says the end frame
    came."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._meta: tuple[dict, int] | None = None  # the current frame's meta and where its payload starts
        self.ended = False
        self.end_blocks = 0

    def feed(self, data: bytes) -> list[BlockFrame]:
        self._buf += data
        out: list[BlockFrame] = []
        while not self.ended:
            if self._meta is None:  # parsed once per frame, not again for each chunk of its payload
                if len(self._buf) < _LEN.size:
                    break
                (meta_len,) = _LEN.unpack_from(self._buf)
                if meta_len > MAX_META_BYTES:
                    raise FrameError(f"frame meta of {meta_len} bytes exceeds {MAX_META_BYTES}")
                if len(self._buf) < _LEN.size + meta_len:
                    break
                try:
                    meta = json.loads(bytes(self._buf[_LEN.size:_LEN.size + meta_len]))
                    int(meta["nbytes"])
                except (ValueError, KeyError, TypeError):
                    raise FrameError("frame meta is not JSON with nbytes") from None
                self._meta = (meta, _LEN.size + meta_len)
            meta, start = self._meta
            nbytes = int(meta["nbytes"])
            if len(self._buf) < start + nbytes:
                break
            with memoryview(self._buf) as view:
                payload = bytes(view[start:start + nbytes])  # one copy (a bytearray slice would make two)
            del self._buf[:start + nbytes]
            self._meta = None
            if meta.get("end"):
                self.ended = True
                self.end_blocks = int(meta.get("blocks", 0))
                break
            try:
                out.append(BlockFrame(tuple(int(h, 16) for h in meta["hashes"]),
                                      tuple(tuple(int(t) for t in tok) for tok in meta["tokens"]),
                                      meta.get("lora"), payload, float(meta.get("waited_s", 0.0))))
            except (KeyError, TypeError, ValueError):
                raise FrameError("block frame meta lacks hashes or tokens") from None
        return out


class Refusal(str, Enum):
    """Why blocks offered by a source were refused (values label the refusals metric)."""

    HASH = "hash"  # not the hash the puller computed, or not the hash of the tokens it came with
    TOKENS = "tokens"  # not the prompt's tokens at that place
    LAYOUT = "layout"  # model, block size, dtype, layers, heads or hash seed differ
    SIZE = "size"  # the payload's length is not the blocks' (a corrupt frame)
    ADAPTER = "adapter"  # computed under another LoRA adapter (or none)
    STREAM = "stream"  # the stream did not parse as frames


class PullOutcome(str, Enum):
    """How one pull ended, on the puller (values label kvfleet:kv_pulls_total)."""

    PULLED = "pulled"  # every block asked for arrived
    PARTIAL = "partial"  # some arrived; the source held no more, or the byte limit was reached
    NONE = "none"  # the source held none of them
    HELD = "held"  # the puller held the whole prefix already: nothing asked
    REFUSED = "refused"  # a block or the layout failed the checks (kvfleet:kv_import_refusals_total says which)
    FAILED = "failed"  # the source could not be reached, answered an error, or died mid-stream
    TIMEOUT = "timeout"  # the puller's --kv-pull-timeout passed first
    INVALID = "invalid"  # the pull header is not an http(s)://host:port URL
    JOINED = "joined"  # a request without a header waited for another's pull of its prefix instead of computing it


def verify(frame: BlockFrame, layout: Layout, expected_hashes: list[int], prompt: list[int], first_block: int,
           parent: int | None, salt: str | None, adapter: str | None) -> tuple[int, Refusal | None]:
    """How many of the frame's blocks are the prompt's blocks first_block, first_block+1, ...: each one's hash
    must be the one the puller computed, its tokens the prompt's, and its hash recomputed from those tokens
    on its parent must match (so a source cannot pass off other content under a right hash). Returns (blocks
    valid, why the next one is refused or None)."""
    n = len(frame.hashes)
    if len(frame.tokens) != n or len(frame.payload) != n * layout.block_bytes:
        return 0, Refusal.SIZE
    if (frame.lora or None) != (adapter or None):
        return 0, Refusal.ADAPTER
    bs = layout.block_size
    for j in range(n):
        i = first_block + j
        if i >= len(expected_hashes) or frame.hashes[j] != expected_hashes[i]:
            return j, Refusal.HASH
        if list(frame.tokens[j]) != prompt[i * bs:(i + 1) * bs]:
            return j, Refusal.TOKENS
        if hash_block(parent, frame.tokens[j], salt if i == 0 else None, layout.hash_seed,
                      adapter if i == 0 else None) != frame.hashes[j]:
            return j, Refusal.HASH
        parent = frame.hashes[j]
    return n, None
