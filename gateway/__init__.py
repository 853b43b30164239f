"""Mooncake-style Conductor: the OpenAI-compatible gateway and the `conductor` command."""
