"""The models cannot drift: they are what docs/api.md's OpenAPI document says (regenerated
and compared), and the document is what the daemon's Rust types accept and send (asked of
a real daemon). A field added on one side and not the other fails one of these."""
from __future__ import annotations

import importlib.util
import pathlib
import re
import sys

import pytest

import tandem_client
from tandem_client import _models

from conftest import REPO, ScriptedModel

spec = importlib.util.spec_from_file_location("gen_models", REPO / "python" / "tools" / "gen_models.py")
assert spec and spec.loader
gen_models = importlib.util.module_from_spec(spec)
sys.modules["gen_models"] = gen_models
spec.loader.exec_module(gen_models)


def test_the_models_are_what_the_openapi_document_says() -> None:
    generated = gen_models.render(gen_models.openapi())
    committed = gen_models.OUT.read_text()
    assert committed == generated, "python/src/tandem_client/_models.py is stale: run python/tools/gen_models.py"


def test_a_change_to_the_document_changes_the_models(tmp_path: pathlib.Path) -> None:
    doc = (REPO / "docs" / "api.md").read_text()
    changed = doc.replace("        keep_state: {type: boolean, default: false}\n", "        keep_state: {type: boolean, default: false}\n        shiny: {type: string}\n", 1)
    assert changed != doc
    (tmp_path / "api.md").write_text(changed)
    assert gen_models.render(gen_models.openapi(tmp_path / "api.md")) != gen_models.OUT.read_text()


def accepted_fields(client: tandem_client.Client, method: str, path: str, body: dict, at: str = "") -> set[str]:
    """The fields the daemon's type accepts at `at` (a dotted path into `body`): it names
    them all when it refuses an unknown one."""
    probe = dict(body)
    target = probe
    for part in [p for p in at.split(".") if p]:
        target[part] = dict(target.get(part, {}))
        target = target[part]
    target["zz_unknown"] = 1
    with pytest.raises(tandem_client.InvalidRequest) as refused:
        client._call(method, path, json=probe)
    message = refused.value.message
    assert "unknown field `zz_unknown`" in message, message
    listed = message.split("expected one of", 1)[1] if "expected one of" in message else message.split("expected", 1)[1]
    return set(re.findall(r"`([a-z_]+)`", listed))


SCHEMAS = {
    # schema: (method, path, a valid body, where in it the schema sits)
    "TaskSpec": ("POST", "/v1/tasks", {"task": "x"}, ""),
    "Limits": ("POST", "/v1/tasks", {"task": "x"}, "limits"),
    "TaskSpecCheck": ("POST", "/v1/tasks", {"task": "x"}, "check"),
    "TaskSpecApproval": ("POST", "/v1/tasks", {"task": "x"}, "approval"),
    "SessionSpec": ("POST", "/v1/sessions", {}, ""),
    "ExecSpec": ("POST", "/v1/exec", {"language": "python", "code": "1"}, ""),
}


@pytest.mark.parametrize("schema", sorted(SCHEMAS))
def test_the_document_names_every_field_the_daemon_accepts(client: tandem_client.Client, schema: str) -> None:
    method, path, body, at = SCHEMAS[schema]
    documented = set(_models.__dict__[schema].__annotations__) | set(
        getattr(_models, f"_{schema}Required", type("none", (), {"__annotations__": {}})).__annotations__
    )
    assert accepted_fields(client, method, path, body, at) == documented


def test_the_daemons_answers_have_the_documented_fields(client: tandem_client.Client, model: ScriptedModel) -> None:
    def check(schema: str, value: dict) -> None:
        fields = _models.FIELDS[schema]
        required = set(getattr(_models, f"_{schema}Required", _models.__dict__[schema]).__annotations__) if hasattr(
            _models, f"_{schema}Required"
        ) else set(_models.__dict__[schema].__annotations__) - set(getattr(_models.__dict__[schema], "__optional_keys__", ()))
        assert set(value) <= fields, f"{schema}: the daemon sent {sorted(set(value) - fields)}, which the document lacks"
        assert required <= set(value), f"{schema}: the daemon left out {sorted(required - set(value))}"

    model.script("```python\nprint(1)\n```", "TERMINATE")
    task = client.run("print one", executor="local")
    record = {k: v for k, v in task.items() if k not in ("transcript", "daemon", "pending_approval")}
    check("Task", record)
    with client.session("local") as s:
        check("SessionInfo", s.info)
        check("BlockResult", s.run("print(1)"))
        check("Upload", s.put_files({"a.txt": "a"}))
        for f in s.files():
            check("FileInfo", f)


def test_the_package_type_checks() -> None:
    """The package is typed (`py.typed`): mypy finds nothing in it."""
    import subprocess

    run = subprocess.run(
        [sys.executable, "-m", "mypy", "--ignore-missing-imports", "--no-incremental", str(REPO / "python" / "src" / "tandem_client")],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout + run.stderr
