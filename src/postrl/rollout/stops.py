"""Stop-string detection that decodes only a short tail of each response, never the whole text."""

from __future__ import annotations

from typing import Any


class StopChecker:
    def __init__(self, tokenizer: Any, stop: tuple[str, ...]) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        # each token decodes to at least one character, so this many tokens cover any stop string
        self.window = max((len(s) for s in self.stop), default=0) + 1

    def hit(self, response_ids: list[int]) -> bool:
        if not self.stop:
            return False
        tail = self.tokenizer.decode(response_ids[-self.window :], skip_special_tokens=False)
        return any(s in tail for s in self.stop)
