"""``prefixgate serve``: the command line, its environment variables, and the server's life.

Each simple field of :class:`~prefixgate.GatewayConfig` (a number, a string, a bool, or one of
those or ``None``) is a flag (``--max-queue-len 500``) and an environment variable
(``PREFIXGATE_MAX_QUEUE_LEN=500``); a flag wins over the variable, which wins over the default.
The serve options (``--host``, ``--port``, ``--replica``, ...) read ``PREFIXGATE_HOST`` and so
on the same way. Arguments the command does not know are vLLM engine arguments
(``--max-model-len 4096``), for the in-process engine started when no ``--replica`` is given.
The effective configuration is printed at start.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..config import GatewayConfig

__all__ = ["config_fields", "gateway_config", "main", "parse_args", "vllm_args"]

_ENV = "PREFIXGATE_"
_NONE = ("", "none", "null")


def _scalar(kind: Any) -> tuple[Callable[[str], Any], bool] | None:
    """``(parse, optional)`` for a field type made of one scalar type and maybe ``None``."""
    args = typing.get_args(kind) if typing.get_origin(kind) in (typing.Union, types.UnionType) else (kind,)
    optional = type(None) in args
    rest = [a for a in args if a is not type(None)]
    if kind is Any:
        return str, False  # a policy by name ("prefix", "cost", ...)
    if len(rest) == 2 and str in rest:  # CanonicalizeConfig | str: a rule set's name
        return str, optional
    if len(rest) != 1 or rest[0] not in (int, float, str, bool):
        return None
    base = rest[0]
    if base is bool:
        return _bool, optional
    return base, optional


def _bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def config_fields() -> list[tuple[str, Callable[[str], Any], bool]]:
    """The :class:`GatewayConfig` fields settable from the command line or the environment:
    ``(name, parse, optional)``, in the dataclass's order."""
    hints = typing.get_type_hints(GatewayConfig)
    out = []
    for f in dataclasses.fields(GatewayConfig):
        if f.name == "admission_policy":
            continue  # an object, not a name
        scalar = _scalar(hints[f.name])
        if scalar is not None:
            out.append((f.name, *scalar))
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="prefixgate serve", allow_abbrev=False,  # --model is vLLM's, not our --model-name
        description="An OpenAI-compatible server in front of vLLM: in-process engines (vLLM engine "
                    "arguments pass through) or vLLM servers (--replica URL, repeatable). Every "
                    "option also reads PREFIXGATE_<NAME> from the environment.")
    serve = p.add_argument_group("serve")
    serve.add_argument("--host", default=None, help="address to listen on (127.0.0.1)")
    serve.add_argument("--port", type=int, default=None, help="port to listen on (8000)")
    serve.add_argument("--replica", action="append", default=None, metavar="URL",
                       help="a vLLM server to route to (repeatable; comma-separated in the environment)")
    serve.add_argument("--kv-events", action="append", default=None, metavar="ENDPOINT",
                       help="where a --replica publishes its KV cache events (tcp://host:port, its "
                       "--kv-events-config endpoint; one per --replica, in order): every gateway's "
                       "mirror then follows what any gateway cached there")
    serve.add_argument("--kv-events-replay", action="append", default=None, metavar="ENDPOINT",
                       help="where a --replica replays its recent KV event batches (tcp://host:port, "
                       "its --kv-events-config replay_endpoint; one per --replica, with --kv-events): "
                       "the gateway then learns what the server cached before it started, and asks "
                       "again for batches lost on the way")
    serve.add_argument("--tokenizer", default=None, help="local tokenizer for remote replicas")
    serve.add_argument("--max-num-seqs", type=int, default=None,
                       help="each remote replica's --max-num-seqs (sizes its in-flight window); "
                       "in process, passed on to vLLM")
    serve.add_argument("--max-num-batched-tokens", type=int, default=None,
                       help="each remote replica's --max-num-batched-tokens (sizes the default "
                       "dispatch pacing, prefill_backlog_steps); in process, passed on to vLLM")
    serve.add_argument("--served-model-name", default=None, help="model name clients send")
    serve.add_argument("--tenant-header", default=None, help="header naming the tenant")
    serve.add_argument("--min-retry-after", type=float, default=None, help="least Retry-After (s)")
    serve.add_argument("--log-level", default=None, help="uvicorn log level (info)")
    gw = p.add_argument_group("gateway (GatewayConfig fields)")
    for name, _, _ in config_fields():
        gw.add_argument("--" + name.replace("_", "-"), dest="gw_" + name, default=None, metavar="VALUE")
    return p


_SERVE_DEFAULTS: dict[str, Any] = {"host": "127.0.0.1", "port": 8000, "replica": [], "kv_events": [],
                                   "kv_events_replay": [],
                                   "tokenizer": None,
                                   "max_num_seqs": None, "max_num_batched_tokens": None,
                                   "served_model_name": None,
                                   "tenant_header": "x-prefixgate-tenant", "min_retry_after": 0.1,
                                   "log_level": "info"}


def parse_args(argv: Sequence[str], environ: Mapping[str, str] | None = None
               ) -> tuple[dict[str, Any], dict[str, str], list[str]]:
    """Splits a command line into serve options, GatewayConfig fields (as text) and vLLM's.

    Args:
        argv: The arguments after ``serve``.
        environ: Read for ``PREFIXGATE_*``; ``os.environ`` when ``None``.

    Returns:
        ``(serve_options, gateway_fields, engine_args)``: flags over environment over defaults.
    """
    env = os.environ if environ is None else environ
    ns, engine_args = _parser().parse_known_args(list(argv))
    values = vars(ns)
    options: dict[str, Any] = {}
    for key, default in _SERVE_DEFAULTS.items():
        value = values[key]
        if value is None and (_ENV + key.upper()) in env:
            text = env[_ENV + key.upper()]
            value = ([u for u in text.split(",") if u] if key in ("replica", "kv_events", "kv_events_replay")
                     else type(default)(text) if isinstance(default, int | float) else text)
        options[key] = default if value is None else value
    fields = {}
    for name, _, _ in config_fields():
        value = values["gw_" + name]
        if value is None:
            value = env.get(_ENV + name.upper())
        if value is not None:
            fields[name] = value
    return options, fields, engine_args


def vllm_args(options: Mapping[str, Any], engine_args: Sequence[str]) -> list[str]:
    """The in-process engine's vLLM arguments: ``engine_args`` plus the flags serve reads itself
    (for remote replicas) and vLLM takes too, ``--max-num-seqs`` and ``--max-num-batched-tokens``."""
    out = list(engine_args)
    for key in ("max_num_seqs", "max_num_batched_tokens"):
        if options[key] is not None:
            out += ["--" + key.replace("_", "-"), str(options[key])]
    return out


def gateway_config(fields: Mapping[str, str]) -> GatewayConfig:
    """A :class:`GatewayConfig` from fields given as text (flags or environment).

    Raises:
        ValueError: A value that does not parse, or that the config refuses (naming the field).
    """
    parsers = {name: (parse, optional) for name, parse, optional in config_fields()}
    kwargs: dict[str, Any] = {}
    for name, text in fields.items():
        parse, optional = parsers[name]
        if optional and text.strip().lower() in _NONE:
            kwargs[name] = None
            continue
        try:
            kwargs[name] = parse(text)
        except ValueError as e:
            raise ValueError(f"GatewayConfig.{name}: cannot read {text!r} ({e})") from None
    return GatewayConfig(**kwargs)


def _describe(options: Mapping[str, Any], config: GatewayConfig, engine_args: Sequence[str]) -> str:
    shown = {k: (str(v) if not isinstance(v, int | float | str | bool | list | type(None)) else v)
             for k, v in ((f.name, getattr(config, f.name)) for f in dataclasses.fields(config))}
    return json.dumps({"serve": dict(options), "gateway": shown, "engine_args": list(engine_args)},
                      indent=2, default=str)


async def _engines(options: Mapping[str, Any], engine_args: Sequence[str]) -> tuple[list[Any], Any]:
    """The engines to serve, and a coroutine function that stops them."""
    if options["replica"]:
        from ..remote import RemoteVllm

        events = options["kv_events"] or [None] * len(options["replica"])
        replays = options["kv_events_replay"] or [None] * len(options["replica"])
        remotes = [await RemoteVllm.connect(url, tokenizer=options["tokenizer"],
                                            max_num_seqs=options["max_num_seqs"],
                                            max_num_batched_tokens=options["max_num_batched_tokens"],
                                            kv_events=endpoint, kv_events_replay=replay)
                   for url, endpoint, replay in zip(options["replica"], events, replays, strict=True)]

        async def stop_remote() -> None:
            for r in remotes:
                await r.close()

        return list(remotes), stop_remote
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from ..vllm_engine import VllmEngine

    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser(prog="prefixgate serve (vLLM engine)"))  # type: ignore[no-untyped-call]
    args = AsyncEngineArgs.from_cli_args(parser.parse_args(vllm_args(options, engine_args)))
    engine = VllmEngine.from_engine_args(args)

    async def stop_local() -> None:
        engine.shutdown()

    return [engine], stop_local


async def serve(options: Mapping[str, Any], config: GatewayConfig, engine_args: Sequence[str]) -> None:
    """Starts the engines and the gateway, serves until interrupted, then closes both."""
    import uvicorn

    from ..gateway import Gateway
    from .app import create_app

    if options["kv_events"] and len(options["kv_events"]) != len(options["replica"]):
        raise SystemExit(f"prefixgate serve: --kv-events needs one endpoint per --replica, in order "
                         f"(got {len(options['kv_events'])} for {len(options['replica'])})")
    if options["kv_events_replay"] and len(options["kv_events_replay"]) != len(options["kv_events"]):
        raise SystemExit(f"prefixgate serve: --kv-events-replay needs one endpoint per --kv-events, in "
                         f"order (got {len(options['kv_events_replay'])} for {len(options['kv_events'])})")
    if options["replica"] and engine_args:
        raise SystemExit(f"prefixgate serve: with --replica, vLLM engine arguments do not apply: "
                         f"{list(engine_args)}")
    engines, stop = await _engines(options, engine_args)
    try:
        async with Gateway(engines, config) as gateway:
            app = create_app(gateway, model_name=options["served_model_name"],
                             tenant_header=options["tenant_header"],
                             min_retry_after=options["min_retry_after"])
            server = uvicorn.Server(uvicorn.Config(app, host=options["host"], port=options["port"],
                                                   log_level=options["log_level"]))
            await server.serve()
            await gateway.aclose(timeout=5.0)
    finally:
        await stop()


def main(argv: Sequence[str] | None = None) -> int:
    """``prefixgate serve``: parses, prints the configuration, serves. Returns the exit status."""
    options, fields, engine_args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        config = gateway_config(fields)
    except ValueError as e:
        print(f"prefixgate serve: {e}", file=sys.stderr)
        return 2
    print(_describe(options, config, engine_args), flush=True)
    asyncio.run(serve(options, config, engine_args))
    return 0
