"""Whether a JSON schema has a finite instance: a schema whose required properties (or minItems items)
lead through `$ref` back to itself, `{"type": "object", "required": ["a"], "properties": {"a": {"$ref": "#"}}}`,
is matched by no finite JSON value. llguidance compiles it, and its matcher dies a few tokens into the
output, so the api refuses it (structured.py) instead.

The question is the productivity of a grammar's rules: each subschema needs all of its requirements
(`$ref`, `allOf`, the required properties of an object, the first minItems items of an array) and one
of its alternatives (`anyOf`, `oneOf`); a worklist marks what has a finite instance from the leaves up,
in time linear in the part of the schema the root's requirements reach. What is not understood as a
requirement counts as none (an untyped schema, `not`, `if`, `enum`, `patternProperties`, remote refs),
so a schema is only refused where every instance is infinite; other unsatisfiable schemas are
llguidance's to report.
"""

from __future__ import annotations

from collections import defaultdict
from urllib.parse import unquote

_ALTERNATIVES = ("anyOf", "oneOf")


def _pointer(root, ref: str):
    """The subschema that a local `$ref` ("#" and a JSON pointer) names in `root`, or None."""
    node = root
    for part in ref[1:].split("/")[1:] if ref != "#" else ():
        part = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _only_type(schema: dict) -> str | None:
    kind = schema.get("type")
    if isinstance(kind, list) and len(kind) == 1:
        kind = kind[0]
    return kind if isinstance(kind, str) else None


def _requirements(root, schema) -> tuple[list, list[list]]:
    """(subschemas `schema`'s instances all need an instance of, [alternatives: one of each list needed])."""
    if schema is False:
        return [], [[]]  # no instance at all: an empty set of alternatives
    if not isinstance(schema, dict) or "const" in schema or "enum" in schema:
        return [], []
    needs, choices = [], []
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#") and (target := _pointer(root, ref)) is not None:
        needs.append(target)
    if isinstance(schema.get("allOf"), list):
        needs.extend(schema["allOf"])
    choices.extend(schema[k] for k in _ALTERNATIVES if isinstance(schema.get(k), list))
    kind = _only_type(schema)
    if kind == "object" and isinstance(schema.get("required"), list):
        properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        extra = schema.get("additionalProperties") if "patternProperties" not in schema else None
        for name in schema["required"]:
            if isinstance(name, str) and name in properties:
                needs.append(properties[name])
            elif isinstance(extra, (dict, bool)):  # a name no property nor pattern names
                needs.append(extra)
    if kind == "array" and isinstance(schema.get("minItems"), int) and schema["minItems"] > 0:
        prefix = schema.get("prefixItems") if isinstance(schema.get("prefixItems"), list) else []
        needs.extend(prefix[: schema["minItems"]])
        if schema["minItems"] > len(prefix) and isinstance(schema.get("items"), (dict, bool)):
            needs.append(schema["items"])
    return needs, choices


def endless_requirement(root) -> str | None:
    """None when `root` has a finite instance (or this cannot tell); else why it has none."""
    # nodes: id(subschema) -> ("all", child ids) | ("any", child ids); an "any" node per list of alternatives
    nodes: dict[object, tuple[str, list]] = {}
    refs: dict[object, str] = {}  # a node reached through $ref: the ref, to name in the message
    todo = [root]
    while todo:
        schema = todo.pop()
        if id(schema) in nodes:
            continue
        needs, choices = _requirements(root, schema)
        children = [id(s) for s in needs]
        for j, alternatives in enumerate(choices):
            key = (id(schema), j)
            nodes[key] = ("any", [id(s) for s in alternatives])
            children.append(key)
            todo.extend(alternatives)
        nodes[id(schema)] = ("all", children)
        todo.extend(needs)
        if isinstance(schema, dict) and isinstance(schema.get("$ref"), str) and needs:
            refs.setdefault(id(needs[0]), schema["$ref"])
    parents: dict[object, list] = defaultdict(list)
    missing = {}
    for key, (kind, children) in nodes.items():
        missing[key] = len(children) if kind == "all" else 1
        for child in children:
            parents[child].append(key)
    finite: set = set()
    ready = [key for key, (kind, children) in nodes.items() if kind == "all" and not children]
    while ready:
        key = ready.pop()
        if key in finite:
            continue
        finite.add(key)
        for parent in parents[key]:
            missing[parent] -= 1
            if missing[parent] == 0:
                ready.append(parent)
    if id(root) in finite:
        return None
    cycle = next((ref for key, ref in refs.items() if key not in finite), None)
    where = f" (through $ref {cycle!r})" if cycle else ""
    return (
        "every value would have to hold another without end: its required properties or minItems items "
        f"lead back to a schema that requires them again{where}"
    )
