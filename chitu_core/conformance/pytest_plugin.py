"""The conformance suite as pytest: ``pytest --pyargs chitu_core.conformance --backend NAME``.

Registered as the ``pytest11`` entry point ``chitu_conformance``, so it is loaded in every pytest
run of an environment with chitu-core; it only adds options and imports nothing else until the
suite's own test module (``chitu_core/conformance/test_backend.py``) is collected. Each case is a
test: unsupported and skipped cases are reported as skips, failures carry the case's detail, and
the support matrix is printed at the end of the run.
"""

import pytest

_SESSION = pytest.StashKey[object]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("chitu-conformance", "chitu-core conformance suite (pytest --pyargs chitu_core.conformance)")
    group.addoption("--backend", dest="chitu_backend", default=None, metavar="NAME",
                    help="backend to run the chitu-core conformance suite on (its entry-point name)")
    group.addoption("--conformance-ops", dest="chitu_conformance_ops", default="", metavar="GLOBS",
                    help="comma-separated globs of the rows or ops to run (default: all)")
    group.addoption("--conformance-dtypes", dest="chitu_conformance_dtypes", default="float32,bfloat16,float16",
                    metavar="DTYPES", help="comma-separated dtypes (default: float32,bfloat16,float16)")


def session(config: pytest.Config):
    """The conformance Session for --backend (built once per run), or None when no backend is given."""
    name = config.getoption("chitu_backend")
    if not name:
        return None
    if _SESSION not in config.stash:
        from chitu_core.conformance.runner import Session, build_cases, load_target, parse_dtypes
        from chitu_core.errors import ChituError

        try:
            target = load_target(name)
            dtypes = parse_dtypes(config.getoption("chitu_conformance_dtypes"))
        except (ChituError, ValueError) as exc:
            raise pytest.UsageError(f"conformance: {exc}") from exc
        config.stash[_SESSION] = Session(target, build_cases(target, dtypes, config.getoption("chitu_conformance_ops")))
    return config.stash[_SESSION]


def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    conformance = config.stash.get(_SESSION, None)
    if conformance is None:
        return
    done = [conformance.result(c) for c in conformance.cases if conformance.has_result(c)]
    if not done:
        return
    from chitu_core.conformance.report import environment, markdown

    terminalreporter.write_sep("=", "chitu-core conformance")
    terminalreporter.write(markdown(done, environment(conformance.target)))
