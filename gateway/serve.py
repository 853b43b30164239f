"""``conductor serve``: the gateway, on the embedded simulated cluster unless a config names engines."""
from __future__ import annotations

import logging
import socket

from gateway.config import ConfigError, load_config
from predictors.cli_args import CLIError, Parser, port


def main(argv: list[str]) -> int:
    p = Parser(prog="conductor serve", description="Serve the OpenAI-compatible gateway. With no --config it "
               "starts an embedded simulated cluster (2 prefill + 2 decode engines) on loopback.")
    p.add_argument("--config", help="TOML configuration (see docs/gateway.md and examples/conductor.toml)")
    p.add_argument("--host", help="address to bind (default 127.0.0.1, or the config's host)")
    p.add_argument("--port", type=port, help="port to bind (default 8000, or the config's port)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    args = p.parse_args(argv)
    try:
        cfg = load_config(args.config)
    except ConfigError as e:
        raise CLIError(str(e)) from None
    try:  # policy, its parameters and the engines' deployments: fail here, not at start-up
        from gateway.cluster import build_scheduler

        build_scheduler(cfg, cfg.engines)
        if cfg.tokenizer == "hf":
            from gateway.tokenizers import HFTokenizer

            HFTokenizer(cfg.tokenizer_path)
    except (ValueError, KeyError) as e:
        raise CLIError(f"bad configuration: {e.args[0] if e.args else e}") from None
    _check_store(cfg)
    cfg.host = args.host or cfg.host
    cfg.port = cfg.port if args.port is None else args.port
    _check_bindable(cfg.host, cfg.port)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    import uvicorn

    from gateway.app import create_app

    uvicorn.run(create_app(cfg), host=cfg.host, port=cfg.port, log_level=args.log_level, access_log=False,
                loop="uvloop", http="httptools", timeout_graceful_shutdown=5)
    return 0


def _check_store(cfg) -> None:
    """An explicit store must answer at start (exit 2 naming it); an optional one only warns."""
    st = cfg.store
    if st is None:
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


def _check_bindable(host: str, port_: int) -> None:
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port_))
    except OSError as e:
        raise CLIError(f"cannot bind {host}:{port_}: {e.strerror}") from None
