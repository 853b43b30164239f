"""The Mooncake-style KV store: its model (model.py), engine key recipes (keys.py), the
``conductor sim-store`` service (server.py) and the clients engines and the gateway use (client.py)."""
