"""What the OpenAPI document says beyond the pydantic schemas, so that it matches the server.

Each route declares the error statuses it answers, with OpenAI's error body (`ErrorResponse`);
a streaming route declares `text/event-stream` beside JSON for its 200. No route answers 422 (a
body that fails validation is a 400), so FastAPI's 422 entries leave the document. The document
is this server's: `model` lists the names it serves, and when API keys are set the routes that
need one declare a bearer scheme. Integer bounds are written as the integers they are (FastAPI's
document holds them as floats, in which int64's bounds would read 2^63 and -2^63).
"""

from fastapi import FastAPI

from chitu_core.sampling.params import INT64_MAX, INT64_MIN
from chitu_core.server.schemas import ErrorResponse

WHY = {
    400: "The request is invalid: the message says what was wrong, `param` names the field.",
    401: "The API key is missing or wrong (only when the server has keys).",
    404: "The model is not served here.",
    500: "The engine failed while running the request (the server must be restarted), or a bug.",
    503: "The server is at capacity (retry later), or its engine has failed.",
}


def errors(*statuses: int) -> dict:
    """``responses=`` entries for these error statuses, each with the error body."""
    return {code: {"model": ErrorResponse, "description": WHY[code]} for code in statuses}


def streamed(model: type, chunk: type, events: str) -> dict:
    """The 200 of a route that answers ``model`` as JSON, or with ``stream: true`` server-sent
    events: each event's data a ``chunk`` (or, when the engine fails mid-stream, an error), the
    last one ``[DONE]``. The schema describes one event; ``tailor`` adds ``chunk``'s schema."""
    json_data = {"type": "string", "contentMediaType": "application/json", "contentSchema": {"anyOf": [
        {"$ref": f"#/components/schemas/{chunk.__name__}"}, {"$ref": "#/components/schemas/ErrorResponse"}]}}
    event = {"type": "object", "required": ["data"], "properties": {"data": {"anyOf": [{"const": "[DONE]"}, json_data]}}}
    return {200: {"model": model, "description": f"JSON, or with `stream: true` server-sent events: {events}",
                  "content": {"text/event-stream": {"schema": event}}}}


def tailor(app: FastAPI, served_names: list[str], keyed: bool, chunks: tuple[type, ...] = (),
           tool_auto: bool = True) -> None:
    """Make ``app.openapi()`` produce this server's document (built once, on first request);
    ``chunks``: the models of ``streamed`` events that no route names otherwise; ``tool_auto``:
    false where the server has no tool-call parser (tools then need tool_choice other than auto)."""
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            doc = build()  # cached by FastAPI in app.openapi_schema: changed in place here
            exact_int_bounds(doc)
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            for chunk in chunks:
                schema = chunk.model_json_schema(ref_template="#/components/schemas/{model}", mode="serialization")
                for name, sub in {**schema.pop("$defs", {}), chunk.__name__: schema}.items():
                    schemas.setdefault(name, sub)
            for name in ("HTTPValidationError", "ValidationError"):
                schemas.pop(name, None)
            if keyed:
                doc["components"]["securitySchemes"] = {
                    "apiKey": {"type": "http", "scheme": "bearer", "description": "one of the server's --api-key keys"}}
            for operation in (op for item in doc["paths"].values() for op in item.values()):
                operation["responses"].pop("422", None)
                if keyed and "401" in operation["responses"]:
                    operation["security"] = [{"apiKey": []}]
                body = operation.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema", {})
                name_models(schemas.get(body.get("$ref", "").rpartition("/")[2], {}), served_names)
            if not tool_auto and "ChatCompletionRequest" in schemas:
                schemas["ChatCompletionRequest"].setdefault("allOf", []).append(NO_AUTO_TOOLS)
        return app.openapi_schema

    app.openapi = openapi


# With no tool-call parser: tools (some) with tool_choice "auto" (or none given) are a 400.
NO_AUTO_TOOLS = {"not": {"required": ["tools"], "properties": {
    "tools": {"type": "array", "minItems": 1}, "tool_choice": {"anyOf": [{"const": "auto"}, {"type": "null"}]}}}}


def name_models(request: dict, served_names: list[str]) -> None:
    """A request schema's ``model`` (a string, or a string or null) becomes one of ``served_names``."""
    model = request.get("properties", {}).get("model", {})
    for choice in [model, *model.get("anyOf", [])]:
        if choice.get("type") == "string":
            choice["enum"] = list(served_names)


def exact_int_bounds(node) -> None:
    """Integer schemas' bounds back to integers, in place: float 2.0**63 is int64's INT64_MAX as a float."""
    if isinstance(node, dict):
        if node.get("type") == "integer":
            for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
                bound = node.get(key)
                if isinstance(bound, float) and bound.is_integer():
                    node[key] = INT64_MAX if bound == 2.0**63 else INT64_MIN if bound == -(2.0**63) else int(bound)
        for value in node.values():
            exact_int_bounds(value)
    elif isinstance(node, list):
        for value in node:
            exact_int_bounds(value)
