"""The traces bundled in data/traces/ are the published files, with their licences beside them."""
import hashlib

import pytest

from tests.traces import TRACES


def _sums() -> dict[str, str]:
    sums = {}
    for line in (TRACES / "SHA256SUMS").read_text().splitlines():
        digest, name = line.split(maxsplit=1)
        sums[name.lstrip("*")] = digest
    return sums


def test_checksums_cover_every_trace():
    on_disk = {p.name for p in TRACES.iterdir() if p.suffix in (".jsonl", ".csv")}
    assert on_disk == set(_sums()) == {"mooncake_conversation_trace.jsonl", "azure_code_2023.csv"}


@pytest.mark.parametrize("name", sorted(_sums()))
def test_trace_matches_its_checksum(name):
    assert hashlib.sha256((TRACES / name).read_bytes()).hexdigest() == _sums()[name]


def test_licences_and_readme_present():
    for rel in ("README.md", "LICENSES/Apache-2.0.txt", "LICENSES/CC-BY-4.0.md"):
        assert (TRACES / rel).is_file(), rel
