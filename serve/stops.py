"""Stop strings on a stream of text deltas: emit what cannot be the start of a stop string, end at one."""

from __future__ import annotations


class StopStrings:
    """OpenAI's ``stop``: the output ends before the first occurrence of any stop string, which
    is not part of the output. ``push`` returns the text safe to send now; up to (longest stop
    string - 1) characters are held back, since they may be the start of one."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""
        self.sent = 0  # text[:sent] has been returned
        self.hit = False
        self.end = 0  # once hit: where the stop string that ended the output ends in text

    def push(self, delta: str) -> str:
        """The text that can be sent after ``delta`` arrives; sets ``hit`` at a stop string."""
        self.text += delta
        # A stop string starting before ``sent`` would lie in text already seen whole: search from there.
        found = [(i, i + len(s)) for s in self.stops if (i := self.text.find(s, self.sent)) >= 0]
        end = min(found)[0] if found else max(self.sent, len(self.text) - self.hold)
        self.hit = bool(found)
        if found:
            self.end = min(found)[1]
        out, self.sent = self.text[self.sent : end], end
        return out

    def flush(self) -> str:
        """The held-back tail, once the output ends without a stop string."""
        out, self.sent = self.text[self.sent :], len(self.text)
        return "" if self.hit else out
