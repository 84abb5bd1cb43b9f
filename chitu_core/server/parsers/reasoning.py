"""Reasoning parsers: ``<think>reasoning</think>content`` -> (reasoning_content, content).

DeepSeek-R1's chat template opens ``<think>`` in the prompt, so its output starts inside the
reasoning (an output that opens ``<think>`` again has it dropped); Qwen3 writes ``<think>`` itself,
or nothing of it when the template was given ``enable_thinking: false``. Newlines right after
either tag are dropped (the templates put them there); all other text is kept as written. An
output that ends inside the reasoning (max_tokens) has only reasoning.
"""

from chitu_core.server.parsers.text import split_at

START, END = "<think>", "</think>"


class ReasoningParser:
    """Fed the output text delta by delta; ``feed`` and ``finish`` return the (reasoning, content)
    text that can be released so far. Subclasses set ``starts_in_reasoning``."""

    starts_in_reasoning = False

    def __init__(self):
        self.in_reasoning = self.starts_in_reasoning
        self.opened = False  # past the output's start (where a <think> may open the reasoning)
        self.strip_newlines = False  # right after a tag
        self.held = ""

    def feed(self, delta: str) -> tuple[str, str]:
        self.held += delta
        reasoning, content = [], []
        while True:
            if not self.opened:
                text = self.held.lstrip()
                if text.startswith(START):
                    self.held, self.in_reasoning, self.strip_newlines = text[len(START):], True, True
                elif START.startswith(text):  # maybe "<th" so far: wait
                    return "".join(reasoning), "".join(content)
                self.opened = True
            if self.strip_newlines:
                self.held = self.held.lstrip("\n")
                if not self.held:
                    return "".join(reasoning), "".join(content)
                self.strip_newlines = False
            if not self.in_reasoning:
                content.append(self.held)
                self.held = ""
                return "".join(reasoning), "".join(content)
            released, rest = split_at(self.held, END)
            reasoning.append(released)
            if rest is None:
                self.held = self.held[len(released):]
                return "".join(reasoning), "".join(content)
            self.held, self.in_reasoning, self.strip_newlines = rest, False, True

    def finish(self) -> tuple[str, str]:
        """What is still held back, at the end of the output."""
        held, self.held = self.held, ""
        if self.strip_newlines:
            held = held.lstrip("\n")
        if not self.opened and not self.starts_in_reasoning:
            return "", held  # "<th" and no more: content
        return (held, "") if self.in_reasoning else ("", held)

    def parse(self, text: str) -> tuple[str, str]:
        """The whole output at once (a fresh parser)."""
        r1, c1 = self.feed(text)
        r2, c2 = self.finish()
        return r1 + r2, c1 + c2


class DeepSeekR1ReasoningParser(ReasoningParser):
    starts_in_reasoning = True


class Qwen3ReasoningParser(ReasoningParser):
    starts_in_reasoning = False


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "qwen3": Qwen3ReasoningParser,
}
