"""Breaking changes between two OpenAPI 3.1 documents: the committed snapshot
(what clients were generated from) and the document the server serves now.

    python3 openapi_diff.py SNAPSHOT CURRENT

Breaking (exit 1, each named on stderr):
  - an operation (method + path) removed, or its operationId changed (the
    name a generated client calls it by);
  - a documented response status removed;
  - a response property removed, or retyped (it now may hold a type the
    snapshot did not allow), at any depth reached from a response body;
  - a request property (body or parameter) newly required, removed, or
    retyped (a type the snapshot accepted is refused);
  - an enum value removed, in a request or a response.
Anything else that differs (new operations, statuses, optional properties,
enum values, descriptions) passes, with "snapshot is stale: update with …".
Identical documents pass silently. Standard library only.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from typing import Any

METHODS = ("get", "put", "post", "delete", "options", "head", "patch", "trace")
UPDATE_HINT = "clients/generated/check.sh --update-snapshot"
# Schemas nest; references may recurse (JsonValue). A walk stops at this depth.
MAX_DEPTH = 32


@dataclass
class Diff:
    old: dict
    new: dict
    breaking: list[str] = field(default_factory=list)
    # (old schema id, new schema id, direction) pairs already compared: a
    # recursive schema is walked once.
    seen: set = field(default_factory=set)

    def resolve(self, doc: dict, schema: Any) -> Any:
        """`schema` with local references followed (bounded: a cycle of pure refs ends)."""
        for _ in range(MAX_DEPTH):
            if not (isinstance(schema, dict) and "$ref" in schema):
                return schema
            pointer = schema["$ref"]
            if not pointer.startswith("#/"):
                raise ValueError(f"only local references are supported: {pointer}")
            target: Any = doc
            for part in pointer[2:].split("/"):
                target = target[part.replace("~1", "/").replace("~0", "~")]
            schema = target
        raise ValueError(f"reference chain longer than {MAX_DEPTH}")

    def branches(self, doc: dict, schema: Any) -> list[dict]:
        """The schema and, flattened, its anyOf/oneOf/allOf branches, resolved."""
        schema = self.resolve(doc, schema)
        if not isinstance(schema, dict):
            return []
        found = [schema]
        for key in ("anyOf", "oneOf", "allOf"):
            for branch in schema.get(key, []):
                found.extend(self.branches(doc, branch))
        return found

    def types(self, doc: dict, schema: Any) -> set[str] | None:
        """The JSON types a schema allows; None for any."""
        allowed: set[str] = set()
        for branch in self.branches(doc, schema):
            declared = branch.get("type")
            if isinstance(declared, str):
                allowed.add(declared)
            elif isinstance(declared, list):
                allowed.update(declared)
        if not allowed:
            return None
        if "number" in allowed:
            allowed.add("integer")
        return allowed

    def properties(self, doc: dict, schema: Any) -> tuple[dict, set[str]]:
        """Properties and required names of an object schema. Properties
        across its branches, each as the first branch to name it states it
        (an alternative that narrows one does not restate it); required
        names of the schema and its allOf parts only: what one anyOf or
        oneOf alternative requires binds only a body that takes it."""
        props: dict[str, Any] = {}
        for branch in self.branches(doc, schema):
            for name, prop in branch.get("properties", {}).items():
                props.setdefault(name, prop)
        return props, self.required(doc, schema)

    def required(self, doc: dict, schema: Any, depth: int = 0) -> set[str]:
        schema = self.resolve(doc, schema)
        if not isinstance(schema, dict) or depth > MAX_DEPTH:
            return set()
        names = set(schema.get("required", []))
        for part in schema.get("allOf", []):
            names |= self.required(doc, part, depth + 1)
        return names

    def enum(self, doc: dict, schema: Any) -> set | None:
        values = None
        for branch in self.branches(doc, schema):
            if "enum" in branch:
                values = (values or set()) | {json.dumps(v, sort_keys=True) for v in branch["enum"]}
        return values

    def items(self, doc: dict, schema: Any) -> Any:
        for branch in self.branches(doc, schema):
            if isinstance(branch.get("items"), (dict, bool)):
                return branch["items"]
        return None

    def compare(self, where: str, old: Any, new: Any, direction: str, depth: int = 0) -> None:
        """Compare one schema; `direction` is "request" (the client writes it)
        or "response" (the client reads it)."""
        if depth > MAX_DEPTH:
            return
        key = (id(self.resolve(self.old, old)), id(self.resolve(self.new, new)), direction)
        if key in self.seen:
            return
        self.seen.add(key)

        old_types, new_types = self.types(self.old, old), self.types(self.new, new)
        if direction == "response" and old_types is not None:
            extra = (new_types or {"anything"}) - old_types
            if extra:
                self.breaking.append(f"retyped response property {where}: "
                                     f"{sorted(old_types)} -> {sorted(new_types or ['any'])}")
        if direction == "request" and new_types is not None:
            lost = (old_types or {"anything"}) - new_types
            if lost:
                self.breaking.append(f"retyped request property {where}: "
                                     f"{sorted(old_types or ['any'])} -> {sorted(new_types)}")

        old_enum, new_enum = self.enum(self.old, old), self.enum(self.new, new)
        if old_enum is not None and new_enum is not None:
            for value in sorted(old_enum - new_enum):
                self.breaking.append(f"removed enum value {value} at {where}")

        old_props, old_required = self.properties(self.old, old)
        new_props, new_required = self.properties(self.new, new)
        for name, old_prop in sorted(old_props.items()):
            at = f"{where}.{name}"
            if name not in new_props:
                self.breaking.append(f"removed {direction} property {at}")
                continue
            self.compare(at, old_prop, new_props[name], direction, depth + 1)
        if direction == "request":
            for name in sorted(new_required - old_required):
                self.breaking.append(f"new required request property {where}.{name}")

        old_items, new_items = self.items(self.old, old), self.items(self.new, new)
        if old_items is not None and new_items is not None:
            self.compare(f"{where}[]", old_items, new_items, direction, depth + 1)

    def operations(self) -> None:
        old_paths, new_paths = self.old.get("paths", {}), self.new.get("paths", {})
        for path, old_item in sorted(old_paths.items()):
            for method in METHODS:
                if method not in old_item:
                    continue
                name = f"{method.upper()} {path}"
                old_op = old_item[method]
                new_op = new_paths.get(path, {}).get(method)
                if new_op is None:
                    self.breaking.append(f"removed operation {name}")
                    continue
                if old_op.get("operationId") != new_op.get("operationId"):
                    self.breaking.append(f"operationId of {name} changed: "
                                         f"{old_op.get('operationId')} -> {new_op.get('operationId')}")
                self.responses(name, old_op, new_op)
                self.requests(name, old_op, new_op)

    def responses(self, name: str, old_op: dict, new_op: dict) -> None:
        old_responses = old_op.get("responses", {})
        new_responses = new_op.get("responses", {})
        for status, old_response in sorted(old_responses.items()):
            if status not in new_responses:
                self.breaking.append(f"removed status {status} of {name}")
                continue
            old_body = self.json_body(self.old, old_response)
            new_body = self.json_body(self.new, new_responses[status])
            if old_body is not None and new_body is not None:
                self.compare(f"{name} {status}", old_body, new_body, "response")

    def requests(self, name: str, old_op: dict, new_op: dict) -> None:
        old_body = self.json_body(self.old, old_op.get("requestBody"))
        new_body = self.json_body(self.new, new_op.get("requestBody"))
        if old_body is not None and new_body is not None:
            self.compare(f"{name} body", old_body, new_body, "request")
        old_required = bool((self.resolve(self.old, old_op.get("requestBody")) or {}).get("required"))
        new_required = bool((self.resolve(self.new, new_op.get("requestBody")) or {}).get("required"))
        if new_required and not old_required:
            self.breaking.append(f"request body of {name} newly required")

        def params(doc: dict, op: dict) -> dict:
            found = {}
            for p in op.get("parameters", []):
                p = self.resolve(doc, p)
                found[(p["in"], p["name"].lower() if p["in"] == "header" else p["name"])] = p
            return found

        old_params, new_params = params(self.old, old_op), params(self.new, new_op)
        for key, new_param in sorted(new_params.items()):
            old_param = old_params.get(key)
            label = f"{name} {key[0]} parameter {key[1]}"
            if old_param is None:
                if new_param.get("required"):
                    self.breaking.append(f"new required request property {label}")
                continue
            if new_param.get("required") and not old_param.get("required"):
                self.breaking.append(f"new required request property {label}")
            self.compare(label, old_param.get("schema"), new_param.get("schema"), "request")
        for key in sorted(set(old_params) - set(new_params)):
            self.breaking.append(f"removed request property {name} {key[0]} parameter {key[1]}")

    def json_body(self, doc: dict, holder: Any) -> Any:
        holder = self.resolve(doc, holder)
        if not isinstance(holder, dict):
            return None
        content = holder.get("content", {})
        for media, body in content.items():
            if media.split(";")[0].strip() == "application/json" and "schema" in body:
                return body["schema"]
        return None


def check(old: dict, new: dict) -> tuple[list[str], bool]:
    """The breaking changes from `old` to `new`, and whether they differ at all."""
    diff = Diff(old, new)
    diff.operations()
    stale = json.dumps(old, sort_keys=True) != json.dumps(new, sort_keys=True)
    return diff.breaking, stale


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[1], encoding="utf-8") as f:
        old = json.load(f)
    with open(argv[2], encoding="utf-8") as f:
        new = json.load(f)
    breaking, stale = check(old, new)
    if breaking:
        print(f"openapi_diff: {len(breaking)} breaking change(s) against {argv[1]}:", file=sys.stderr)
        for line in breaking:
            print(f"  BREAKING: {line}", file=sys.stderr)
        print("openapi_diff: if the break is intended, version the API and update the snapshot "
              f"({UPDATE_HINT})", file=sys.stderr)
        return 1
    if stale:
        print(f"openapi_diff: no breaking change; snapshot is stale: update with {UPDATE_HINT}")
    else:
        print("openapi_diff: the served document matches the snapshot")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
