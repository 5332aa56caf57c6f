"""docs/configuration.md is generated from the policy dataclasses (deploy/gen_config_doc.py) and must be current."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def load_generator():
    spec = importlib.util.spec_from_file_location("gen_config_doc", ROOT / "deploy" / "gen_config_doc.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gen_config_doc"] = mod
    spec.loader.exec_module(mod)
    return mod


gen = load_generator()


def test_configuration_doc_is_current():
    text, _ = gen.generate()
    current = (ROOT / "docs" / "configuration.md").read_text()
    assert current == text, "docs/configuration.md is stale: run python deploy/gen_config_doc.py"


def test_every_field_of_every_section_has_a_row():
    text, _ = gen.generate()
    for section, cls in gen.sections():
        todo = [(section, cls)]
        while todo:
            path, c = todo.pop()
            assert f"`{path}`" in text, path
            hints = typing.get_type_hints(c)
            for f in dataclasses.fields(c):
                assert f"| `{f.name}` |" in text, f"{path}.{f.name} missing"
                sub, is_list = gen.dataclass_in(hints[f.name])
                if sub is not None:
                    todo.append((f"{path}.{f.name}" + ("[]" if is_list else ""), sub))


def test_defaults_and_descriptions_come_from_the_code():
    text, _ = gen.generate()
    assert "| `port` | int | `8080` | listener port (the base URL is http://host:port/v1) |" in text
    assert "| `ttft_p95_degraded_s` | float | `15.0` | windowed p95 time to first token above this" in text
    assert "| `kind` | one of memory, redis | `\"memory\"` | `memory` (default" in text
    assert "| `max_queue` | int | `1000` | requests waiting in this lane" in text


def test_every_field_is_documented_where_it_is_defined():
    """One style: the comment on the field's line (continued below it); no field without one."""
    from extproc.config import GatewayConfig
    from extproc.routing.policy import HealthPolicy
    from extproc.schema import field_docs
    from extproc.streaming import SlowConsumerPolicy

    assert field_docs(GatewayConfig)["port"].startswith("listener port")
    assert field_docs(HealthPolicy)["min_samples"] == ("first tokens the window must hold before its p95 may "
                                                       "degrade a HEALTHY replica (a p95 of 2 samples says nothing)")
    assert field_docs(SlowConsumerPolicy)["grace_s"].startswith("how long a stream")
    _, undocumented = gen.generate()
    assert undocumented == []


def test_the_sections_are_the_policy_fields():
    import dataclasses

    from extproc.config import Policy

    names = [s.removesuffix("[]") for s, _ in gen.sections()]
    assert names == [f.name for f in dataclasses.fields(Policy) if f.name != "source"]
    assert len(names) == 11


def test_check_mode_reports_staleness(tmp_path, monkeypatch, capsys):
    stale = tmp_path / "configuration.md"
    stale.write_text("# old\n")
    monkeypatch.setattr(gen, "OUT", stale)
    monkeypatch.setattr(gen, "ROOT", tmp_path)
    assert gen.main(["--check"]) == 1
    assert gen.main([]) == 0 and gen.main(["--check"]) == 0


def known_field_paths() -> set[str]:
    paths: set[str] = set()
    for section, cls in gen.sections():
        todo = [(section.removesuffix("[]"), cls)]
        while todo:
            path, c = todo.pop()
            hints = typing.get_type_hints(c)
            for f in dataclasses.fields(c):
                paths.add(f"{path}.{f.name}")
                sub, is_list = gen.dataclass_in(hints[f.name])
                if sub is not None:
                    todo.append((f"{path}.{f.name}", sub))
    return paths


def test_operations_doc_names_only_real_policy_fields():
    import re

    text = re.sub(r"```.*?```", "", (ROOT / "docs" / "operations.md").read_text(), flags=re.S)
    sections = tuple(s.removesuffix("[]") for s, _ in gen.sections())
    known = known_field_paths()
    named = set()
    for code in re.findall(r"`([^`]+)`", text):
        for token in re.findall(r"(?<![\w-])[a-z_]+(?:\[\])?(?:\.[a-z_0-9*]+(?:\[\])?)+", code):
            token = token.replace("[]", "")
            if token.split(".")[0] in sections and not token.endswith("*"):
                named.add(token)
    wrong = sorted(t for t in named if t not in known and not any(k.startswith(t + ".") for k in known))
    assert len(named) > 40
    assert not wrong, f"docs/operations.md names policy fields that do not exist: {wrong}"


def test_operations_doc_covers_every_problem_and_alert():
    import yaml

    text = (ROOT / "docs" / "operations.md").read_text()
    for i in range(1, 14):
        assert f"| P{i} |" in text, f"P{i} missing from the knobs table"
    alerts = yaml.safe_load((ROOT / "deploy" / "alerts.yml").read_text())
    for group in alerts["groups"]:
        for rule in group["rules"]:
            assert f"`{rule['alert']}`" in text, f"alert {rule['alert']} is not explained in docs/operations.md"
