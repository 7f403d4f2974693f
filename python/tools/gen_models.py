"""Writes tandem_client/_models.py from the OpenAPI document in docs/api.md.

    python python/tools/gen_models.py            # rewrite the models
    python python/tools/gen_models.py --check    # exit 1 when they are not what the document says

The models are TypedDicts (what the daemon's JSON decodes to, typed for a checker), one per
schema under components.schemas, with a class of its own for each nested object. A schema's
required properties are keys a value always has; the rest may be absent.
"""
from __future__ import annotations

import argparse
import keyword
import pathlib
import sys

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "api.md"
OUT = ROOT / "python" / "src" / "tandem_client" / "_models.py"


def openapi(doc: pathlib.Path = DOC) -> dict:
    """The OpenAPI document: the yaml block under the `## OpenAPI` heading."""
    text = doc.read_text()
    _, after = text.split("\n## OpenAPI\n", 1)
    _, block = after.split("```yaml\n", 1)
    block, _ = block.split("```", 1)
    return yaml.safe_load(block)


def camel(name: str) -> str:
    return "".join(part[:1].upper() + part[1:] for part in name.replace("-", "_").split("_"))


class Writer:
    def __init__(self) -> None:
        self.classes: list[str] = []
        self.fields: dict[str, tuple[list[str], list[str]]] = {}

    def type_of(self, schema: dict, name: str) -> str:
        if "$ref" in schema:
            return schema["$ref"].rsplit("/", 1)[1]
        if "oneOf" in schema:
            return " | ".join(self.type_of(s, f"{name}{i}") for i, s in enumerate(schema["oneOf"], 1))
        if "enum" in schema:
            return "Literal[" + ", ".join(repr(v) for v in schema["enum"]) + "]"
        kind = schema.get("type")
        if isinstance(kind, list):
            return " | ".join(self.type_of({**schema, "type": k}, name) for k in kind)
        if kind == "string":
            return "str"
        if kind == "integer":
            return "int"
        if kind == "number":
            return "float"
        if kind == "boolean":
            return "bool"
        if kind == "null":
            return "None"
        if kind == "array":
            return f"list[{self.type_of(schema.get('items', {}), name + 'Item')}]"
        if kind == "object" or "properties" in schema:
            if schema.get("properties"):
                self.typed_dict(name, schema)
                return name
            extra = schema.get("additionalProperties")
            if isinstance(extra, dict):
                return f"dict[str, {self.type_of(extra, name + 'Value')}]"
            return "dict[str, Any]"
        return "Any"

    def typed_dict(self, name: str, schema: dict) -> None:
        props = schema.get("properties", {})
        required = set(schema.get("required", []))
        lines_required, lines_optional = [], []
        for prop, sub in props.items():
            field = prop + "_" if keyword.iskeyword(prop) else prop
            annotation = self.type_of(sub, name + camel(prop))
            line = f"    {field}: {annotation}"
            if sub.get("description"):
                line += f"  # {sub['description']}"
            (lines_required if prop in required else lines_optional).append(line)
        self.fields[name] = (sorted(required), sorted(props))
        doc = schema.get("description", f"The API's `{name}`.")
        if lines_required and lines_optional:
            self.classes.append(
                f"class _{name}Required(TypedDict):\n" + "\n".join(lines_required) + "\n"
            )
            self.classes.append(
                f"class {name}(_{name}Required, total=False):\n    \"\"\"{doc}\"\"\"\n\n"
                + "\n".join(lines_optional)
                + "\n"
            )
        else:
            total = "" if lines_required else ", total=False"
            self.classes.append(
                f"class {name}(TypedDict{total}):\n    \"\"\"{doc}\"\"\"\n\n"
                + "\n".join(lines_required + lines_optional)
                + "\n"
            )


def render(spec: dict) -> str:
    writer = Writer()
    for name, schema in spec["components"]["schemas"].items():
        writer.typed_dict(name, schema)
    fields = "\n".join(
        f"    {name!r}: frozenset({props!r}),"
        for name, (_, props) in sorted(writer.fields.items())
        if "_" not in name and name in spec["components"]["schemas"]
    )
    return (
        '"""The daemon\'s JSON, typed: generated from the OpenAPI document in docs/api.md by\n'
        "python/tools/gen_models.py. Do not edit; run the generator (a test fails when this\n"
        'file and the document differ)."""\n'
        "# ruff: noqa\n"
        "from __future__ import annotations\n\n"
        "from typing import Any, Literal, TypedDict\n\n"
        f"API_VERSION = {spec['info']['version']!r}\n\n"
        + "\n\n".join(writer.classes)
        + "\n\n# Every property each schema names, for checks.\nFIELDS: dict[str, frozenset[str]] = {\n"
        + fields
        + "\n}\n"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the models are stale")
    args = parser.parse_args()
    text = render(openapi())
    if args.check:
        if OUT.read_text() != text:
            print(f"{OUT} is not what docs/api.md says; run python/tools/gen_models.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
