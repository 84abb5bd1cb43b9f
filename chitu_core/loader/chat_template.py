"""Chat templates rendered with jinja2 as transformers renders them (``render_jinja_template``, 5.x).

The same environment: sandboxed and immutable, ``trim_blocks`` and ``lstrip_blocks``, loop controls,
``raise_exception``, ``strftime_now``, a ``tojson`` that does not escape HTML and takes ``indent``,
``separators``, ``sort_keys`` and ``ensure_ascii``, a ``dict`` and a ``namespace`` that refuse
underscore names, and a ``{% generation %}`` block (rendered as its body). The same inputs: messages
without their None-valued keys, reasoning under ``reasoning_content`` and ``thinking`` too, and
everything the template sees rebuilt from plain JSON types (anything else becomes "<TypeName>").
"""

import dataclasses
import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache

REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def render_chat(template: str, conversation, tools: list[dict] | None = None, documents: list[dict] | None = None,
                add_generation_prompt: bool = False, **variables) -> str:
    """One conversation (a list of message dicts, or objects with ``model_dump``) rendered by ``template``."""
    messages = _plain(getattr(conversation, "messages", conversation))
    if not isinstance(messages, list) or not messages:
        raise ValueError("a chat template needs a non-empty list of messages")
    if any(not isinstance(m, dict) for m in messages):
        raise TypeError(f"chat messages should be dicts, but got {messages!r}")
    if tools is not None and any(not isinstance(t, dict) for t in tools):
        raise ValueError("tools should be JSON schemas (dicts); functions are converted only by transformers")
    messages = [_with_reasoning_aliases({k: v for k, v in m.items() if v is not None}) for m in messages]
    return _compiled(template).render(messages=messages, tools=_plain(tools), documents=_plain(documents),
                                      add_generation_prompt=add_generation_prompt, **_plain(variables))


def _with_reasoning_aliases(message: dict) -> dict:
    reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
    return message if reasoning is None else {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _plain(value):
    """``value`` rebuilt from JSON types (transformers' _plain_template_data)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    for base in (str, int, float):
        if isinstance(value, base):
            return base(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if hasattr(value, "item") and type(value).__module__ == "numpy":
        return _plain(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


@lru_cache(maxsize=16)
def _compiled(template: str):
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}``: transformers marks assistant spans with it; we only render."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    class TemplateDict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"chat templates cannot store underscore-prefixed attributes on a namespace ({name!r})")

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env.from_string(template)
