"""`mlaserve serve [MODEL]`: resolve the options, start uvicorn and the engine process, stop cleanly.
`mlaserve precompile [MODEL]`: the same engine options, warm-up only (`precompile.py`).

vLLM's command lines work: the model may be given positionally, and the vLLM flags DeepSeek users
pass are answered by one table (`mlaserve/config/vllm_flags.py`, docs/vllm_flags.md): each is
one of our options under the same name (`--max-model-len`, `-tp`), mapped to one of ours
(`--block-size` is `--page-size`, `--enforce-eager` is `--no-cuda-graph`; logged at start-up),
accepted with no effect where the behaviour is already ours (`--trust-remote-code`,
`--disable-log-stats`; the log says why), or refused with exit 2 and a line naming the flag, the
reason and what to use instead (`--data-parallel-size 8`).

Before anything starts, the options are checked, the model folder is looked at (config.json,
tokenizer) and the port is bound: any problem is one line on stderr and exit 2 (a bad option or
model path) or 1 (the port cannot be bound), with no traceback and no engine started. Then the
HTTP server comes up (so /health and /ready answer while the weights load); the engine process
loads and warms up the model, then /ready turns 200. SIGTERM or SIGINT stops admitting
requests, lets in-flight ones finish for up to `--shutdown-timeout` seconds, then ends every
open response itself (an SSE error event `server_shutdown` and `[DONE]`, or a 503 body) and
exits 0. A model that fails to load exits 1, and so does an engine process that dies while
serving: /health turns 503 at once, the open requests fail with `engine_dead`, then the server
stops listening and exits 1 without waiting for the dead engine, so that an orchestrator
restarts it (docs/api.md).

With `--nnodes K --node-rank R` and R > 0 no HTTP server starts: the process is node R's
launcher of its tensor-parallel ranks (`engine/tp_node.py`), exiting 0 when node 0 stops the
group and 1 when node 0 goes away or a rank fails (README, "Two nodes").

Parsing, `--help`, `--version` and a bad option import neither torch nor the engine, uvicorn or
the app (`mlaserve serve --help` answers in well under two seconds): `serve` imports them when
it starts the server.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable, Mapping, Sequence
from types import FrameType
from typing import TYPE_CHECKING, Any

from mlaserve.config import ConfigError
from mlaserve.config.vllm_flags import VLLM_FLAGS, VllmFlag, translate
from mlaserve.jit_cache import apply_jit_cache, cache_python_bytecode
from mlaserve.service.settings import (
    CHOICES,
    CONFIG_ENV,
    ServerConfig,
    Settings,
    load_settings,
    options,
)
from mlaserve.service.version import server_version

# The precompile command's --help text (its module imports the engine only when it runs).
PRECOMPILE_DESCRIPTION = (
    "Build the engine with the given engine options (the same as `mlaserve serve`'s, from the "
    "command line, MLASERVE_* variables or --config), run its warm-up (every JIT compilation "
    "and CUDA-graph capture a server start runs) and exit 0, printing the cache folder, the "
    "number of compilations and the start-up phases. With --cache-dir (or its variable) the "
    "compiled kernels land there, so that `mlaserve serve` started later with the same options "
    "and folder compiles nothing: run it in an image build or an init container."
)

if TYPE_CHECKING:
    import uvicorn

__all__ = [
    "PRECOMPILE_DESCRIPTION",
    "build_parser",
    "main",
    "parse_settings",
    "resolve_torch_threads",
    "serve",
]

logger = logging.getLogger("mlaserve.service")

# Threads of the server's own besides the engine's: the event loop and the tokenizer worker.
SERVICE_THREADS = 2
# uvicorn's graceful-shutdown timeout runs this much longer than ours, so that the engine ends
# the open responses (error event + [DONE]) before uvicorn would cancel them mid-body.
UVICORN_SHUTDOWN_MARGIN_S = 5.0


def resolve_torch_threads(flag: int | None, environ: dict[str, str] | os._Environ) -> int | None:
    """The torch intra-op thread count to set: the flag; else None (keep torch's choice) when
    OMP_NUM_THREADS is set; else the CPUs this process may use minus the service's threads.
    Unset, torch takes every core of the machine, which under contention is ~10x slower."""
    if flag is not None:
        return flag
    if environ.get("OMP_NUM_THREADS"):
        return None
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, cpus - SERVICE_THREADS)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mlaserve", description="OpenAI-compatible server for DeepSeek-V2/V3 (MLA) models."
    )
    parser.add_argument("--version", action="version", version=f"mlaserve {server_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve_parser = commands.add_parser(
        "serve",
        help="serve a model over HTTP",
        description="Serve a model over HTTP. Every option can also be set by an environment "
        "variable (shown with each option) or in a YAML/JSON file given with --config; the "
        "command line wins over the environment, which wins over the file.",
    )
    _add_options(serve_parser, with_server=True)
    precompile_parser = commands.add_parser(
        "precompile",
        help="fill the JIT cache for a configuration, without serving",
        description=PRECOMPILE_DESCRIPTION,
    )
    _add_options(precompile_parser, with_server=False, extra=("log_level", "torch_threads"))
    return parser


def _add_options(
    parser: argparse.ArgumentParser, *, with_server: bool, extra: tuple[str, ...] = ()
) -> None:
    """MODEL, --config and the options: the engine's, and the server's (`with_server`; else
    only those named in `extra`)."""
    parser.add_argument(
        "model_tag",
        nargs="?",
        metavar="MODEL",
        default=argparse.SUPPRESS,
        help="checkpoint folder, as vLLM takes it (the same as --model)",
    )
    parser.add_argument(
        "--config",
        metavar="FILE",
        default=argparse.SUPPRESS,
        help=f"YAML or JSON file of options, keys as the option names (env {CONFIG_ENV})",
    )
    server_group = parser.add_argument_group("server options")
    engine_group = parser.add_argument_group("engine options")
    for opt in options():
        if opt.target is ServerConfig and not with_server and opt.name not in extra:
            continue
        group = server_group if opt.target is ServerConfig else engine_group
        default = "" if opt.default is None else f"default: {opt.default}; "
        text = f"{opt.help} ({default}env {opt.env})".replace("%", "%%")
        flags = [opt.flag, *_ALIASES.get(opt.name, ())]
        if opt.base_type is bool:
            group.add_argument(
                *flags, dest=opt.name, action=argparse.BooleanOptionalAction,
                default=argparse.SUPPRESS, help=text,
            )  # fmt: skip
        else:
            choices = CHOICES.get(opt.name)
            metavar = (
                "{" + ",".join(choices) + "}"
                if choices
                else _METAVARS.get(opt.name) or _METAVARS.get(opt.base_type, "VALUE")
            )
            group.add_argument(
                *flags, dest=opt.name, metavar=metavar, default=argparse.SUPPRESS, help=text
            )
    vllm_group = parser.add_argument_group(
        "vLLM flags", "taken as the given option, accepted with no effect (logged), or refused "
        "naming what to use instead (docs/vllm_flags.md)",
    )  # fmt: skip
    server_only = {o.name for o in options() if o.target is ServerConfig}
    for row in VLLM_FLAGS:
        # precompile listens on nothing: no vLLM flag that only sets a server option
        if not with_server and row.expect and set(row.expect) <= server_only:
            continue
        if row.kind != "same":
            vllm_group.add_argument(
                row.flag, *row.aliases, action=_VllmFlagAction, row=row, nargs=row.nargs,
                metavar=None if row.nargs == 0 else "VALUE", default=argparse.SUPPRESS,
                help=_vllm_help(row).replace("%", "%%"),
            )  # fmt: skip


# Where the vLLM flags' notes collect in the parsed arguments (not an option name).
NOTES_KEY = "vllm_flag_notes"


def _vllm_help(row: VllmFlag) -> str:
    if row.kind == "refused":
        accepted = f" ({', '.join(row.noop_values)}: accepted)" if row.noop_values else ""
        return f"not supported{accepted}: {row.why}"
    return row.why.split(": ", 1)[-1]


class _VllmFlagAction(argparse.Action):
    """A vLLM flag from the table: sets the options it maps to and records its note, or ends
    parsing as argparse does (exit 2) with the reason it is refused."""

    def __init__(self, option_strings: list[str], dest: str, row: VllmFlag, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, **kwargs)
        self.row = row

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        value = True if self.nargs == 0 else values
        try:
            options, note = translate(self.row, value)
        except ConfigError as e:
            parser.error(str(e))
        for name, val in options.items():
            setattr(namespace, name, val)
        if note:
            notes = getattr(namespace, NOTES_KEY, [])
            setattr(namespace, NOTES_KEY, [*notes, note])


_ALIASES: dict[str, tuple[str, ...]] = {
    "tensor_parallel_size": ("-tp",),
    "deterministic_inference": ("--enable-deterministic-inference",),
}
_METAVARS: dict = {int: "N", float: "X", str: "TEXT", "model": "PATH", "tokenizer": "PATH",
                   "api_key": "KEY", "host": "HOST", "served_model_name": "NAME",
                   "chat_template": "FILE|TEMPLATE"}  # fmt: skip


def parse_settings(argv: Sequence[str] | None, environ: Mapping[str, str]) -> tuple[str, Settings]:
    """The command and its resolved settings (command line, environment, config file), before
    any look at the model; ConfigError for a bad value, SystemExit(2) from argparse."""
    args = vars(build_parser().parse_args(argv))
    command = args.pop("command")
    config_file = args.pop("config", None)
    notes = args.pop(NOTES_KEY, [])
    positional = args.pop("model_tag", None)
    if positional is not None:
        if args.get("model", positional) != positional:
            raise ConfigError(
                f"model: given twice, as {positional!r} and --model {args['model']!r}"
            )
        args["model"] = positional
    settings = load_settings(args, environ, config_file)
    return command, dataclasses.replace(settings, notes=notes)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        command, settings = parse_settings(argv, os.environ)
        # Before the engine process is spawned: it inherits the cache's variables.
        apply_jit_cache(settings.engine.cache_dir)
        cache_python_bytecode(settings.engine.cache_dir)  # this process's imports from here on
        from mlaserve.service.preflight import preflight  # the tokenizer's files: transformers

        settings = preflight(settings)
    except ConfigError as e:
        print(f"mlaserve: error: {e}", file=sys.stderr)
        return 2
    if settings.engine.nnodes > 1 and command == "precompile":
        print("mlaserve: error: nnodes: precompile runs on one node (run it on each node with "
              "its own share of the ranks' options, or warm the cache on one node)",
              file=sys.stderr)  # fmt: skip
        return 2
    if command == "precompile":
        from mlaserve.service.precompile import precompile

        for note in settings.notes:
            print(f"mlaserve: {note}", file=sys.stderr)
        threads = resolve_torch_threads(settings.server.torch_threads, os.environ)
        return precompile(settings, torch_threads=threads)
    if settings.engine.node_rank > 0:
        return serve_node(settings)
    try:
        sock = bind_socket(settings.server.host, settings.server.port)
    except OSError as e:
        where = f"{settings.server.host}:{settings.server.port}"
        print(f"mlaserve: error: cannot listen on {where}: {e.strerror or e}", file=sys.stderr)
        return 1
    with sock:
        return serve(settings, sock)


def serve_node(settings: Settings) -> int:
    """`--node-rank R > 0`: no HTTP server, only this node's tensor-parallel ranks, until node 0
    stops them or goes away (`engine/tp_node.py`; README, "Two nodes")."""
    from mlaserve.engine.tp_node import run_node

    _setup_logging(settings.server.log_level)
    logger.info("mlaserve %s, node %d of %d (no HTTP server on this node)", server_version(),
                settings.engine.node_rank, settings.engine.nnodes)  # fmt: skip
    for line in settings.describe():
        logger.info("  %s", line)
    try:
        return run_node(settings.engine)
    except ConfigError as e:
        print(f"mlaserve: error: {e}", file=sys.stderr)
        return 2


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper() if level != "trace" else "DEBUG",
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def bind_socket(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the engine starts: a taken port is an error at once
    (uvicorn binds only after the app's startup, i.e. after the engine began loading)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto IPPROTO_TCP, not the default 0: asyncio disables Nagle (TCP_NODELAY) only on
    # accepted sockets whose proto says TCP. With proto 0 every response after the first on a
    # keep-alive connection (headers and body are two writes) waited ~40 ms for the client's
    # delayed ACK.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.set_inheritable(True)
    except OSError:
        sock.close()
        raise
    return sock


def _make_server(config: uvicorn.Config, on_exit: Callable[[], None]) -> uvicorn.Server:
    """uvicorn's server, telling the engine to stop admitting as soon as a signal arrives."""
    import uvicorn

    class _Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            on_exit()
            super().handle_exit(sig, frame)

    return _Server(config)


def serve(settings: Settings, sock: socket.socket | None = None) -> int:
    """Run the server until a signal stops it; returns the process exit code. `sock` is the
    bound listening socket (`bind_socket`); without it uvicorn binds host:port itself."""
    from mlaserve.service.engine_process import spawn_engine

    server_cfg = settings.server
    _setup_logging(server_cfg.log_level)
    logger.info("mlaserve %s, effective configuration:", server_version())
    for line in settings.describe():
        logger.info("  %s", line)
    for warning in settings.warnings:
        logger.warning(warning)
    for note in settings.notes:
        logger.info("vLLM flag %s", note)

    threads = resolve_torch_threads(server_cfg.torch_threads, os.environ)
    logger.info("torch intra-op threads: %s", threads if threads is not None else "OMP_NUM_THREADS")
    # The engine process first: its imports (torch, the kernels) and the weights' load overlap
    # the HTTP stack's imports below (uvicorn, fastapi, transformers for the tokenizer).
    spawned = spawn_engine(settings.engine, torch_threads=threads)

    import uvicorn

    from mlaserve.service.app import build_app
    from mlaserve.service.async_engine import AsyncEngine
    from mlaserve.service.chat import ChatOptions

    exit_code = 0
    server: uvicorn.Server | None = None

    def on_engine_error(_: BaseException) -> None:  # on the loop; AsyncEngine logged the cause
        nonlocal exit_code
        exit_code = 1
        if server is not None:
            server.should_exit = True  # uvicorn's main loop polls it

    engine = AsyncEngine(
        settings.engine,
        max_queue=server_cfg.max_queue,
        on_load_error=on_engine_error,
        on_fatal=on_engine_error,
        shutdown_timeout=server_cfg.shutdown_timeout,
        tokenizer_queue=server_cfg.tokenizer_queue,
        torch_threads=threads,
        spawned=spawned,
    )
    logger.info(
        "admission: %d sequences in flight (max_num_seqs + max_queue); tokenizer queue: %d",
        engine.admission_bound,
        engine.tokenizer_worker.max_pending,
    )
    app = build_app(
        engine,
        api_key=server_cfg.api_key,
        max_request_bytes=server_cfg.max_request_bytes,
        shutdown_timeout=server_cfg.shutdown_timeout,
        max_prompts_per_request=server_cfg.max_prompts_per_request,
        max_prompt_tokens_per_request=server_cfg.max_prompt_tokens_per_request,
        max_logprobs=server_cfg.max_logprobs,
        log_requests=not server_cfg.disable_log_requests,
        chat_options=ChatOptions(
            chat_template=server_cfg.chat_template,
            tool_call_parser=server_cfg.tool_call_parser,
            enable_auto_tool_choice=server_cfg.enable_auto_tool_choice,
            reasoning_parser=server_cfg.reasoning_parser,
        ),
    )
    config = uvicorn.Config(
        app,
        host=server_cfg.host,
        port=server_cfg.port,
        log_level=server_cfg.log_level,
        access_log=not server_cfg.disable_uvicorn_access_log,
        timeout_graceful_shutdown=server_cfg.shutdown_timeout + UVICORN_SHUTDOWN_MARGIN_S,
        lifespan="on",
    )
    server = _make_server(config, on_exit=engine.begin_drain)
    # NOTE: after a graceful shutdown uvicorn re-raises the signal it caught, restoring the
    # previous handler first; a no-op handler there turns SIGTERM into a clean exit 0.
    previous = {sig: signal.signal(sig, _ignore) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run(sockets=[sock] if sock is not None else None)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if exit_code == 0 and not server.started:
        exit_code = 1  # e.g. the port was taken
    logger.info("mlaserve stopped (exit code %d)", exit_code)
    return exit_code


def _ignore(sig: int, frame: FrameType | None) -> None:
    pass
