"""The breaking-change check catches what it promises: each test doctors the
committed snapshot the way a careless server change would and asserts the
checker names it; additions pass with the stale notice.

    pytest clients/generated/test_openapi_diff.py   (check.sh runs it)
"""

import copy
import json
import pathlib
import subprocess
import sys

import pytest

import openapi_diff

HERE = pathlib.Path(__file__).resolve().parent
SNAPSHOT = json.loads((HERE / "openapi.snapshot.json").read_text(encoding="utf-8"))


@pytest.fixture
def new():
    return copy.deepcopy(SNAPSHOT)


def breaking(new_doc):
    found, _ = openapi_diff.check(SNAPSHOT, new_doc)
    return found


def test_the_snapshot_against_itself_is_clean_and_not_stale():
    assert openapi_diff.check(SNAPSHOT, copy.deepcopy(SNAPSHOT)) == ([], False)


def test_a_removed_response_field_is_breaking(new):
    grant = new["components"]["schemas"]["GrantDto"]
    del grant["properties"]["lease_token"]
    grant["required"].remove("lease_token")
    found = breaking(new)
    # GrantDto is reached from two operations; the first walked names it.
    assert len(found) == 1 and found[0].startswith("removed response property POST "), found
    assert found[0].endswith(" 201.turn.lease_token"), found


def test_a_retyped_response_field_is_breaking(new):
    new["components"]["schemas"]["GrantDto"]["properties"]["fence"]["type"] = "string"
    found = breaking(new)
    assert len(found) == 1 and found[0].startswith("retyped response property POST "), found
    assert found[0].endswith(" 201.turn.fence: ['integer'] -> ['string']"), found


def begin_object(doc):
    """BeginRequest's object: its first allOf part (the document relates
    two of its fields in the second)."""
    begin = doc["components"]["schemas"]["BeginRequest"]
    return begin["allOf"][0] if "allOf" in begin else begin


def test_a_new_required_request_field_is_breaking(new):
    begin = begin_object(new)
    begin["properties"]["tenant"] = {"type": "string"}
    begin["required"].append("tenant")
    found = breaking(new)
    assert found == ["new required request property POST /v1/turns body.tenant"], found


def wrap_begin_request(new, alternatives):
    """BeginRequest as `allOf` its old object and `anyOf` `alternatives`."""
    schemas = new["components"]["schemas"]
    derived = schemas["BeginRequest"]
    schemas["BeginRequest"] = {"allOf": [derived, {"anyOf": alternatives}]}


def test_a_field_required_by_one_alternative_only_is_not_a_new_required_field(new):
    wrap_begin_request(new, [
        {"properties": {"wait_ms": {"type": "null"}}},
        {"required": ["on_busy"], "properties": {"on_busy": {"type": "string", "enum": ["wait", "interrupt"]}}},
    ])
    assert breaking(new) == []


def test_a_field_required_by_an_all_of_part_is_a_new_required_field(new):
    schemas = new["components"]["schemas"]
    schemas["BeginRequest"] = {"allOf": [schemas["BeginRequest"], {"required": ["on_busy"]}]}
    found = breaking(new)
    assert any("new required request property" in f and "on_busy" in f for f in found), found


def test_a_new_required_header_is_breaking(new):
    new["paths"]["/v1/turns"]["post"].setdefault("parameters", []).append(
        {"in": "header", "name": "X-Tenant", "required": True, "schema": {"type": "string"}})
    found = breaking(new)
    assert found == ["new required request property POST /v1/turns header parameter x-tenant"], found


def test_a_removed_request_field_is_breaking(new):
    # Begin bodies refuse unknown fields: a client still sending it would get 400.
    del new["components"]["schemas"]["ClaimToolRequest"]["properties"]["args"]
    new["components"]["schemas"]["ClaimToolRequest"]["required"].remove("args")
    assert breaking(new) == ["removed request property POST /v1/turns/{turn_id}/tools body.args"]


def test_a_narrowed_request_field_is_breaking(new):
    new["components"]["schemas"]["ClaimOrphanRequest"]["properties"]["min_orphaned_ms"]["type"] = "string"
    found = breaking(new)
    assert len(found) == 1 and found[0].startswith(
        "retyped request property POST /v1/orphans/claim body.min_orphaned_ms:"), found


def test_a_removed_enum_value_is_breaking(new):
    new["components"]["schemas"]["ErrorCode"]["enum"].remove("session_busy")
    found = breaking(new)
    assert any("removed enum value \"session_busy\"" in f for f in found), found


def test_a_removed_request_enum_value_is_breaking(new):
    new["components"]["schemas"]["DecisionDto"]["enum"].remove("reject")
    found = breaking(new)
    assert any("removed enum value \"reject\" at POST /v1/turns body.confirmation.decision" in f
               for f in found), found


def test_a_removed_status_code_is_breaking(new):
    del new["paths"]["/v1/turns"]["post"]["responses"]["429"]
    assert breaking(new) == ["removed status 429 of POST /v1/turns"]


def test_a_removed_operation_is_breaking(new):
    del new["paths"]["/v1/turns/{turn_id}/heartbeat"]
    assert breaking(new) == ["removed operation POST /v1/turns/{turn_id}/heartbeat"]


def test_a_renamed_operation_id_is_breaking(new):
    new["paths"]["/v1/turns"]["post"]["operationId"] = "start"
    assert breaking(new) == ["operationId of POST /v1/turns changed: begin -> start"]


def test_additions_pass_but_say_the_snapshot_is_stale(new):
    schemas = new["components"]["schemas"]
    schemas["GrantDto"]["properties"]["node"] = {"type": "string"}
    begin_object(new)["properties"]["priority"] = {"type": "integer"}
    schemas["ErrorCode"]["enum"].append("tenant_at_capacity")
    new["paths"]["/v1/turns"]["post"]["responses"]["418"] = {"description": "a teapot"}
    new["paths"]["/v1/tenants"] = {"get": {"operationId": "tenants", "responses": {"200": {"description": "ok"}}}}
    assert openapi_diff.check(SNAPSHOT, new) == ([], True)


def test_the_command_line_fails_naming_the_change_and_passes_additions(tmp_path, new):
    snapshot = HERE / "openapi.snapshot.json"
    doctored = copy.deepcopy(new)
    doctored["components"]["schemas"]["ErrorCode"]["enum"].remove("lease_lost")
    path = tmp_path / "doctored.json"
    path.write_text(json.dumps(doctored))
    run = subprocess.run([sys.executable, str(HERE / "openapi_diff.py"), str(snapshot), str(path)],
                         capture_output=True, text=True, check=False)
    assert run.returncode == 1, run
    assert "BREAKING: removed enum value \"lease_lost\"" in run.stderr, run.stderr

    new["info"]["description"] += " More words."
    path.write_text(json.dumps(new))
    run = subprocess.run([sys.executable, str(HERE / "openapi_diff.py"), str(snapshot), str(path)],
                         capture_output=True, text=True, check=False)
    assert run.returncode == 0, run
    assert "snapshot is stale: update with clients/generated/check.sh --update-snapshot" in run.stdout
