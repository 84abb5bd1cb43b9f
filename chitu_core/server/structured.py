"""Structured output and logit_bias, from OpenAI's fields to SamplingParams'.

A request's constraint comes from ``response_format`` (``text``, ``json_object``, or
``json_schema`` with its ``schema``) or from vLLM's extra fields ``guided_regex`` and
``guided_grammar`` (EBNF); at most one of them. Server code may attach a constraint of its own
instead (a tool call's schema, say): ``handlers.sampling_params`` takes it. Either way it is
parsed here as the grammar library will compile it (without the tokenizer's tables, so cheaply),
and what the library does not support is a 400 naming it, before the request reaches the engine."""

from chitu_core.sampling import grammar
from chitu_core.sampling.params import StructuredOutput
from chitu_core.server import schemas as s
from chitu_core.server.errors import bad_request


def requested_constraint(req: s._Request) -> tuple[StructuredOutput | None, str | None]:
    """The request's constraint and the field it came from, or (None, None). 400 for two at once."""
    given = []
    fmt = req.response_format
    if fmt is not None and fmt.type != "text":
        given.append("response_format")
    given += [name for name in ("guided_regex", "guided_grammar") if getattr(req, name) is not None]
    if len(given) > 1:
        raise bad_request(f"give at most one output constraint; this request has {' and '.join(given)}", given[1])
    if not given:
        return None, None
    if given[0] == "guided_regex":
        return StructuredOutput(regex=req.guided_regex), "guided_regex"
    if given[0] == "guided_grammar":
        return StructuredOutput(grammar=req.guided_grammar), "guided_grammar"
    if fmt.type == "json_object":
        return StructuredOutput(json_object=True), "response_format"
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise bad_request('response_format of type "json_schema" needs json_schema: {"name": ..., "schema": {...}}',
                          "response_format.json_schema")
    return StructuredOutput(json_schema=fmt.json_schema.schema_), "response_format.json_schema.schema"


def check_constraint(constraint: StructuredOutput, param: str | None) -> None:
    """400 naming what the grammar library does not support in the constraint."""
    try:
        grammar.check(constraint)
    except grammar.GrammarError as exc:
        raise bad_request(f"{param or 'the output constraint'}: {exc}", param) from None


def logit_bias(req: s._Request) -> dict[int, float]:
    """OpenAI's logit_bias ({"token id as a string": bias}) with integer keys (the schema admits
    only digits); whether each id is in the vocabulary is the engine's to say."""
    return {int(key): bias for key, bias in (req.logit_bias or {}).items()}
