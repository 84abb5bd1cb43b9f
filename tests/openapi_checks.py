"""Schemathesis checks of our own, loaded by `st run` (SCHEMATHESIS_HOOKS=openapi_checks) in test_openapi.py.

positive_data_acceptance is told that a 400 may answer data that the schema calls valid, and
`only_unstatable_400s` narrows that back: a 400 to valid data must be one of the rejections no
JSON schema can state, because they depend on the loaded model or compare two fields. Any other
400 to valid data means the document and the server disagree. `every_route_answers_200` makes
sure the run reached the engine (a run that only met 400s and 404s would prove little).
"""

import schemathesis

UNSTATABLE = (
    "context_length_exceeded",  # the prompt (as the chat template renders it) plus max_tokens exceed the context
    "outside the vocabulary",  # prompt token ids the model has no embedding for
    "outside the tokenizer's vocabulary",  # /detokenize of ids the tokenizer does not know
    "is more than max_tokens",  # min_tokens above max_tokens (or above what the context leaves, for chat)
    "which is not among the tools",  # a tool_choice naming a function that tools does not define
)
GRAMMARS = ("response_format", "guided_regex", "guided_grammar", "tools")  # one the grammar library cannot compile


@schemathesis.check
def only_unstatable_400s(ctx, response, case):
    """A 400 to schema-valid data is one of the UNSTATABLE rejections."""
    meta = case.meta
    if meta is None or not meta.generation.mode.is_positive or response.status_code != 400:
        return None
    error = response.json()["error"]
    if error["param"] not in GRAMMARS and not any(why in (error["code"] or "") or why in error["message"] for why in UNSTATABLE):
        raise AssertionError(f"schema-valid data rejected: {error}")
    return None


@schemathesis.check
class every_route_answers_200:
    """Each operation answered 200 at least once in the run."""

    def __init__(self):
        self.tested, self.answered = set(), set()

    def after_response(self, ctx, response, case):
        self.tested.add(case.operation.label)
        if response.status_code == 200:
            self.answered.add(case.operation.label)

    def after_run(self, ctx):
        missing = sorted(self.tested - self.answered)
        if missing:
            raise AssertionError(f"never answered 200: {missing}")
