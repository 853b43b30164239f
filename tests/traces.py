"""The bundled traces the tests read: one place for their paths (data/traces/ in this repository)."""
from loadgen.workload import BUNDLED_TRACES, bundled_trace

TRACES = BUNDLED_TRACES
MOONCAKE = bundled_trace("mooncake_conversation_trace.jsonl")
AZURE = bundled_trace("azure_code_2023.csv")
