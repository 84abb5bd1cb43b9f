"""Every conformance case as a pytest test (see ``pytest_plugin``): run with
``pytest --pyargs chitu_core.conformance --backend NAME``."""

import pytest

from chitu_core.conformance.pytest_plugin import session


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "conformance_case" not in metafunc.fixturenames:
        return
    conformance = session(metafunc.config)
    if conformance is None:
        skip = pytest.mark.skip(reason="give --backend NAME to run the chitu-core conformance suite")
        metafunc.parametrize("conformance_case", [pytest.param(None, marks=skip)], ids=["no-backend"])
        return
    metafunc.parametrize("conformance_case", conformance.cases, ids=[c.key for c in conformance.cases])


def test_conformance(conformance_case, request: pytest.FixtureRequest) -> None:
    result = session(request.config).result(conformance_case)
    if result.status in ("unsupported", "skipped"):
        pytest.skip(f"{result.status}: {result.detail}")
    if result.status == "fail":
        pytest.fail(result.detail, pytrace=False)
