"""A stop string that begins before the break and ends after it.

At the break the dead replica had generated text it had not shown yet (`held`): the longest tail that could
begin a stop string (and a character split over tokens). The continuation's engine sees none of it — its
stop strings are searched in its own new text only — so the router searches the stop strings that begin
inside `held`, holding back what could still become one, exactly as the uninterrupted engine would have:

    s = Straddle(held, stops, include_stop=False)
    text, stop = s.feed(new_text)      # text to show now; stop: the stop string found (the choice ends)
    text, stop = s.finish(reason)      # the continuation ended: its own stop string (if any), then the rest

Once no stop string can begin inside `held` any more, everything passes straight through.
"""

from __future__ import annotations


def held_text(decoded: str, sent: str) -> str:
    """What the replica had generated but not shown: `decoded` (its output ids decoded) past the `sent` text;
    "" when they disagree. A trailing partial character (U+FFFD) is dropped: the continuation's engine decodes
    the tokens that complete it."""
    if not decoded.startswith(sent):
        return ""
    return decoded[len(sent):].rstrip("\ufffd")


class Straddle:
    def __init__(self, held: str, stops: tuple[str, ...], include_stop: bool):
        self.stops = stops
        self.include = include_stop
        self._buf = held
        self._region = len(held) if stops else 0  # stop strings may begin at _buf[:_region]

    @property
    def held(self) -> str:
        """The text held back now (at the start: what the dead replica had not shown)."""
        return self._buf

    @property
    def done(self) -> bool:
        """No stop string can begin before the break any more: the rest passes through."""
        return self._region == 0 and not self._buf

    def feed(self, text: str) -> tuple[str, str | None]:
        if self._region == 0:
            out, self._buf = self._buf + text, ""
            return out, None
        self._buf += text
        hit = self._hit()
        if hit is not None:
            return hit
        keep = self._possible()
        if keep is None:
            out, self._buf, self._region = self._buf, "", 0
            return out, None
        out, self._buf, self._region = self._buf[:keep], self._buf[keep:], self._region - keep
        return out, None

    def finish(self, stop_reason: str | int | None = None) -> tuple[str, str | None]:
        """The continuation ended. A stop string it cut off (`stop_reason`, not in its text) may still complete
        an earlier one that began before the break; otherwise whatever is held goes out."""
        if self._region and isinstance(stop_reason, str) and not self.include:
            whole = self._buf
            self._buf += stop_reason
            hit = self._hit()
            if hit is not None:
                return hit
            self._buf = whole
        out, self._buf, self._region = self._buf, "", 0
        return out, None

    def _hit(self) -> tuple[str, str | None] | None:
        best: tuple[int, str] | None = None
        for s in self.stops:
            at = self._buf.find(s, 0, self._region + len(s) - 1)
            if 0 <= at < self._region and (best is None or at < best[0]):
                best = (at, s)
        if best is None:
            return None
        at, s = best
        out = self._buf[:at + len(s)] if self.include else self._buf[:at]
        self._buf, self._region = "", 0
        return out, s

    def _possible(self) -> int | None:
        """The first place before `_region` where the held text could still begin a stop string."""
        buf = self._buf
        for i in range(self._region):
            tail = buf[i:]
            if any(s.startswith(tail) for s in self.stops):
                return i
        return None
