"""Request bodies' integers (``chitu_core.server.schemas``): JSON Schema's integers include whole floats (16.0),
which pydantic's strict mode refuses, so the request models turn them into ints first; a prompt of token ids
that is all ints already goes through untouched."""

import pydantic
import pytest

from chitu_core.server import schemas as s


def completion(prompt, **fields):
    return s.CompletionRequest.model_validate({"model": "m", "prompt": prompt, **fields})


def test_a_prompt_of_ints_passes_as_it_is():
    ids = list(range(100, 228))
    assert s.integral(ids) is ids
    assert completion(ids).prompt == ids


def test_whole_floats_become_ints_in_prompts_and_fields():
    assert completion([1, 2.0, 3]).prompt == [1, 2, 3]
    assert completion([[1.0, 2], [3]]).prompt == [[1, 2], [3]]
    req = completion([5], max_tokens=16.0, n=2.0)
    assert (req.max_tokens, req.n) == (16, 2) and type(req.max_tokens) is int


@pytest.mark.parametrize("prompt", [[1, 2.5], [True, 2], ["a", ""], [[1], []], [1, "2"]],
                         ids=["fraction", "bool", "empty string", "empty list", "string id"])
def test_what_is_no_prompt_of_token_ids_is_refused(prompt):
    with pytest.raises(pydantic.ValidationError):
        completion(prompt)
