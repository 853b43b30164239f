"""``conductor serve``: the gateway, on the embedded simulated cluster unless a config names engines."""
from __future__ import annotations

import logging
import os
import socket
import sys
import threading

from gateway.config import ConfigError, GatewayConfig, load_config
from predictors.cli_args import CLIError, Parser, key_value, port


def main(argv: list[str]) -> int:
    p = Parser(prog="conductor serve", description="Serve the OpenAI-compatible gateway. With no --config it "
               "starts an embedded simulated cluster (2 prefill + 2 decode engines) on loopback.")
    p.add_argument("--config", help="TOML configuration (see docs/gateway.md and examples/conductor.toml)")
    p.add_argument("--host", help="address to bind (default 127.0.0.1, or the config's host)")
    p.add_argument("--port", type=port, help="port to bind (default 8000, or the config's port)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--policy-param", type=key_value, action="append", default=[], metavar="KEY=VALUE",
                   help="a parameter of the policy, over the config's [policy_params] (repeatable), e.g. "
                        "defer=off (conductor decides at arrival, without its wait room; docs/gateway.md)")
    args = p.parse_args(argv)
    try:
        cfg = load_config(args.config)
    except ConfigError as e:
        raise CLIError(str(e)) from None
    cfg.policy_params.update(args.policy_param)
    try:  # policy, its parameters and the engines' deployments: fail here, not at start-up
        from gateway.cluster import build_scheduler

        build_scheduler(cfg, cfg.engines)
        if cfg.tokenizer == "hf":
            from gateway.tokenizers import HFTokenizer

            assert cfg.tokenizer_path is not None  # validate() requires it with 'hf'
            HFTokenizer(cfg.tokenizer_path)
    except (ValueError, KeyError) as e:
        raise CLIError(f"bad configuration: {e.args[0] if e.args else e}") from None
    _check_store(cfg)
    cfg.host = args.host or cfg.host
    cfg.port = cfg.port if args.port is None else args.port
    sock = _bind(cfg.host, cfg.port)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    return _run(cfg, args.log_level, sock)


def _run(cfg: GatewayConfig, log_level: str, sock: socket.socket) -> int:
    """Serve until SIGTERM/SIGINT; then end within ``shutdown_timeout_s`` whatever hangs. The
    process always exits here (``os._exit`` once everything is closed): nothing left behind, an
    engine's socket or a thread, can keep a stopped gateway alive."""
    import uvicorn

    from gateway import profiling
    from gateway.app import create_app
    from gateway.netguard import (
        GuardCollector,
        Limits,
        RequestLimit,
        StartupReport,
        connection_budget,
        guarded_protocol,
        raise_open_file_limit,
    )

    log = logging.getLogger("conductor")
    soft, hard = raise_open_file_limit()
    em = cfg.embedded
    engines = len(cfg.engines) + (em.prefill + em.decode + em.both if em is not None else 0)
    budget = connection_budget(soft, engines)
    if cfg.max_connections > budget:
        log.warning("max_connections %d does not fit in %d open files with %d engines: using %d",
                    cfg.max_connections, soft, engines, budget)
    cfg.max_connections = min(cfg.max_connections or budget, budget)
    cfg.max_concurrent_requests = min(cfg.max_concurrent_requests or cfg.max_connections, cfg.max_connections)
    log.info("open files %d (hard limit %d): up to %d client connections, %d requests in progress",
             soft, hard, cfg.max_connections, cfg.max_concurrent_requests)
    limits = Limits(cfg.max_connections, cfg.header_timeout_s, cfg.body_timeout_s, cfg.max_header_bytes)
    guard = GuardCollector(limits)
    guard.request_limit = RequestLimit(create_app(cfg, guard), cfg.max_concurrent_requests)
    app = StartupReport(guard.request_limit)
    # uvicorn annotates its timeouts int but takes float seconds (they go to call_later, asyncio.timeout)
    config = uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level=log_level, access_log=False,
                            loop="uvloop", http=guarded_protocol(limits),
                            timeout_keep_alive=cfg.keepalive_timeout_s,  # type: ignore[arg-type]
                            # in-flight streams get half the shutdown budget; stopping everything the rest
                            timeout_graceful_shutdown=cfg.shutdown_timeout_s / 2)  # type: ignore[arg-type]
    server = _server(config, cfg.shutdown_timeout_s)
    profiling.install()
    code = 0
    try:
        server.run(sockets=[sock])
    except SystemExit as e:  # uvicorn exits this way when it cannot bind
        code = e.code if isinstance(e.code, int) else 1
    if not server.started:
        sys.stderr.write(f"conductor serve: error: start-up failed: {app.failure or 'see the log above'}\n")
        code = code or 1
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _server(config, shutdown_timeout_s: float):
    """uvicorn's server with a deadline on shutdown: the first SIGTERM/SIGINT starts a watchdog
    that ends the process (and its embedded engines) if the graceful stop overruns it."""
    import uvicorn

    class Server(uvicorn.Server):
        watchdog: threading.Timer | None = None

        def handle_exit(self, sig, frame) -> None:
            if self.watchdog is None:
                self.watchdog = threading.Timer(shutdown_timeout_s + 1.0, _overran, (shutdown_timeout_s,))
                self.watchdog.daemon = True
                self.watchdog.start()
            super().handle_exit(sig, frame)

        async def startup(self, sockets=None) -> None:
            await super().startup(sockets=sockets)
            if sockets is not None and self.started:  # uvicorn names the address only for sockets it bound
                self._log_started_message(sockets)

    return Server(config)


def _overran(timeout_s: float) -> None:
    from gateway.embedded import kill_all

    sys.stderr.write(f"conductor serve: shutdown took longer than {timeout_s:g} s: exiting now\n")
    sys.stderr.flush()
    kill_all()
    os._exit(1)


def _check_store(cfg) -> None:
    """An explicit store must answer at start (exit 2 naming it); an optional one only warns."""
    st = cfg.store
    if st is None:
        return
    _check_mooncake(cfg)
    if st.start_master:
        return
    import json
    import urllib.request

    try:
        with urllib.request.urlopen(st.url.rstrip("/") + "/health", timeout=max(1.0, st.timeout_s)) as r:
            ok = r.status == 200 and json.loads(r.read()).get("status") == "ok"
    except (OSError, ValueError, AttributeError):
        ok = False
    if not ok:
        if not st.optional:
            raise CLIError(f"cannot reach the KV store at {st.url} (its /health); start it, fix [store] url, "
                           "or set [store] optional = true")
        logging.getLogger("conductor").warning("the KV store at %s does not answer; running without it until "
                                               "it does", st.url)


def _check_mooncake(cfg: GatewayConfig) -> None:
    """A master to start must be installed; embedded engines that will open the real Mooncake
    client (wildcard listeners) need a network namespace with only loopback up."""
    st = cfg.store
    if st is None or st.kind != "mooncake":
        return
    if st.start_master:
        from gateway.mooncake_master import MasterMissing, find_master

        try:
            find_master(st.master_bin)
        except MasterMissing as e:
            raise CLIError(str(e)) from None
    em = cfg.embedded
    if em is not None and em.store and em.prefill + em.both > 0 and (st.start_master or st.master_rpc):
        from engines_adapters.store.mooncake import NETNS_HINT, loopback_only

        why = loopback_only()
        if why is not None:
            raise CLIError(f"the embedded engines would open the Mooncake client here ({why}): {NETNS_HINT}; "
                           "or set [embedded] store = false")


def _bind(host: str, port_: int) -> socket.socket:
    """The gateway's listening socket, bound now, before the embedded engines choose their ports:
    a port only chosen (not held) while they start could be handed to one of them, and the gateway
    would then fail to bind its own. It listens at once, as a socket-activated service's does: with
    SO_REUSEADDR (for a restart over TIME_WAIT connections) only a listening socket keeps a second
    gateway off the port. A client connecting before start-up ends waits in the backlog."""
    s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, port_))
        s.listen(2048)
    except OSError as e:
        s.close()
        raise CLIError(f"cannot bind {host}:{port_}: {e.strerror}") from None
    return s
