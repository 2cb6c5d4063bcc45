"""loadtest/structured_bench.py: its schemas are valid and bounded, its flags are checked, and a run against a
real engine (--url, tiny numbers) prints every figure."""

from __future__ import annotations

import signal

import jsonschema
import pytest

from loadtest import structured_bench
from tests.engine.server.conftest import API_FLAGS, start_engine


def test_schemas_are_valid_json_schemas():
    for s in structured_bench.SCHEMAS:
        jsonschema.validators.validator_for(s).check_schema(s)
    assert structured_bench.body(1, True, 8)["response_format"]["json_schema"]["schema"] == structured_bench.SCHEMAS[1]
    assert "response_format" not in structured_bench.body(1, False, 8)


def test_bad_flags(capsys):
    with pytest.raises(SystemExit):
        structured_bench.main(["--requests", "0"])
    with pytest.raises(SystemExit):
        structured_bench.main(["--servers", "tgi"])


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    server = start_engine(str(tmp_path_factory.mktemp("bench")), *API_FLAGS)
    yield server
    server.stop(signal.SIGTERM)


@pytest.mark.model
@pytest.mark.slow  # about a minute on a quiet machine (engine start + 3 mixes), more on a busy one
def test_smoke_against_a_real_engine(engine, capsys):
    assert structured_bench.main(["--url", engine.url, "--requests", "4", "--concurrency", "2",
                                  "--repeats", "1", "--max-tokens", "48"]) == 0
    out = capsys.readouterr().out
    assert "100% JSON Schema" in out and "valid 4/4" in out and "TTFT new schema" in out
