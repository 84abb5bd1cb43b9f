"""Helpers for streaming text parsers: holding back what may be the start of a tag."""


def partial_tag(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag`` (0 if none):
    the part to hold back, as the next delta may complete the tag."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def split_at(text: str, tag: str) -> tuple[str, str | None]:
    """(what can be released, the rest after ``tag``), or (releasable, None) with ``tag`` not
    (yet) in ``text``; a possible partial tag at the end is not releasable (the caller keeps it)."""
    i = text.find(tag)
    if i >= 0:
        return text[:i], text[i + len(tag):]
    return text[: len(text) - partial_tag(text, tag)], None
