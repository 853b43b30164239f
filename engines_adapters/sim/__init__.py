"""The simulated engine: one engine model behind a vLLM-compatible server or a virtual-time simulator."""
