"""The OpenAPI document matches the server: schemathesis (`st run`, every check) against a real
server on loopback with an API key, on a short run (a fixed seed and few examples per operation).

Besides schemathesis' own checks, tests/openapi_checks.py adds two: a 400 to data the document
calls valid must be one of the rejections no schema can state (the context length, the model's
vocabulary), and every operation must have answered 200 at least once."""

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from builders import build_chat_model
from chitu_core.config import EngineConfig
from chitu_core.engine.async_engine import AsyncLLM
from chitu_core.server.app import build_app
from serving import LiveServer

MODEL = "tiny-chat"
KEY = "sk-openapi"
CONFIG = """
[checks.positive_data_acceptance]
# a 400 may answer schema-valid data: openapi_checks.only_unstatable_400s says which 400s
expected-statuses = ["2xx", "400", "401", "404"]
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("openapi-llama")
    build_chat_model(path)
    # A short context keeps every generation short, whatever max_tokens and n schemathesis picks.
    llm = AsyncLLM(EngineConfig(model=str(path), device="cpu", dtype="float32", load_progress=False, max_model_len=64))
    with LiveServer(build_app(llm, [MODEL], api_keys=[KEY])) as live:
        yield live
    asyncio.run(llm.shutdown())


def test_schemathesis_finds_no_mismatch(server, tmp_path):
    config = tmp_path / "schemathesis.toml"
    config.write_text(CONFIG)
    tests = str(Path(__file__).parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")]),
           "SCHEMATHESIS_HOOKS": "openapi_checks"}
    cmd = [sys.executable, "-m", "schemathesis.cli", "--config-file", str(config), "run", f"{server.url}/openapi.json",
           "--checks", "all", "--max-examples", "15", "--seed", "1", "--generation-database", "none", "--no-color",
           "--request-timeout", "30", "--header", f"Authorization: Bearer {KEY}"]
    out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
    assert "No issues found" in out.stdout and "7 selected / 7 total" in out.stdout, out.stdout[-3000:]


def test_the_document_names_the_key_and_the_models(server):
    doc = httpx.get(server.url + "/openapi.json").json()
    assert doc["components"]["securitySchemes"] == {
        "apiKey": {"type": "http", "scheme": "bearer", "description": "one of the server's --api-key keys"}}
    secured = sorted(p for p, item in doc["paths"].items() for op in item.values() if "security" in op)
    assert secured == ["/detokenize", "/tokenize", "/v1/chat/completions", "/v1/completions", "/v1/models"]
    request = doc["components"]["schemas"]["CompletionRequest"]["properties"]["model"]
    assert request["enum"] == [MODEL]
