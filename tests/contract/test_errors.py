"""The OpenAI error body: code is a string or null, type comes from the status."""

import pytest

from contract.errors import error_body, error_type


def test_error_body_has_the_openai_shape():
    assert error_body("no", error_type(400), "messages", "invalid_value") == {
        "error": {"message": "no", "type": "invalid_request_error", "param": "messages", "code": "invalid_value"}}
    assert error_body("gone", error_type(404))["error"]["code"] is None


def test_error_types_by_status():
    assert [error_type(s) for s in (400, 401, 404, 418, 429, 500, 502, 503, 504)] == [
        "invalid_request_error", "authentication_error", "not_found_error", "invalid_request_error",
        "rate_limit_error", "internal_error", "upstream_error", "service_unavailable", "server_error"]


def test_an_integer_code_is_refused():
    with pytest.raises(TypeError, match="string or None"):
        error_body("x", "invalid_request_error", None, 404)
