"""A bounded schemathesis run over the gateway's own OpenAPI description (the `POST /v1/*`
bodies included): generated valid and invalid requests must never get a 5xx."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import requests

from tests.servers import gateway

pytestmark = pytest.mark.slow

# short contexts keep the longest generated answer (no max_tokens, ignore_eos) quick
CONFIG = """
[slo]
ttft_ms = 600000
[embedded]
prefill = 1
decode = 1
time_scale = 0.05
extra_args = ["--max-model-len", "2048"]
"""


def test_schemathesis_finds_no_server_error(tmp_path):
    with gateway(CONFIG) as g:
        spec = requests.get(g["url"] + "/openapi.json").json()
        assert {"/v1/chat/completions", "/v1/completions"} <= set(spec["paths"])
        assert spec["paths"]["/v1/chat/completions"]["post"]["requestBody"]["required"]
        cli = os.path.join(os.path.dirname(sys.executable), "schemathesis")
        out = subprocess.run(
            [cli, "run", g["url"] + "/openapi.json", "--checks", "not_a_server_error", "--max-examples", "25",
             "--seed", "1", "--workers", "1", "--request-timeout", "60", "--no-color",
             "--report-dir", str(tmp_path)],
            capture_output=True, text=True, timeout=600, cwd=tmp_path)
        summary = re.search(r"(\d+) generated, (\d+) passed(.*)", out.stdout)
        assert out.returncode == 0 and summary, out.stdout[-3000:] + out.stderr[-2000:]
        generated, passed = int(summary[1]), int(summary[2])
        print(summary[0])
        assert generated >= 200 and passed == generated, summary[0]
        text = requests.get(g["url"] + "/metrics").text
        assert 'conductor_requests_total{reason="",status="ok"}' in text  # some reached the engines
