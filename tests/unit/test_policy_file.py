"""Where the policy comes from (`--config FILE` > ./sluice.yaml > the built-in default), where `sluice up` writes
its run files, and the commented policy file `sluice init` writes."""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path

import pytest
import yaml

from extproc.cli import default_run_dir, main
from extproc.config import EMBEDDED_POLICY, Policy, default_policy_path, load_policy, policy_from_dict, \
    policy_to_dict
from extproc.policy_template import render
from extproc.schema import field_docs, file_fields


def test_the_policy_file_is_config_then_cwd_then_the_built_in_default(tmp_path: Path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert default_policy_path() == EMBEDDED_POLICY and EMBEDDED_POLICY.is_file()
    assert main(["render", "--out", "a"]) == 0
    assert "port_value: 8101" in (tmp_path / "a" / "cds.yaml").read_text()  # the demo's replicas
    local = tmp_path / "sluice.yaml"
    local.write_text(yaml.safe_dump({"pools": [{"model": "m", "replicas": ["127.0.0.1:7001"]}]}))
    assert default_policy_path() == local
    assert main(["render", "--out", "b"]) == 0
    assert "port_value: 7001" in (tmp_path / "b" / "cds.yaml").read_text()
    other = tmp_path / "other.yaml"
    other.write_text(yaml.safe_dump({"pools": [{"model": "m", "replicas": ["127.0.0.1:7002"]}]}))
    assert main(["render", "--out", "c", "--config", str(other)]) == 0
    assert "port_value: 7002" in (tmp_path / "c" / "cds.yaml").read_text()


def test_up_writes_its_run_files_in_the_user_state_directory_not_the_cwd(monkeypatch, tmp_path: Path):
    policy = load_policy(EMBEDDED_POLICY)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    assert default_run_dir(policy) == tmp_path / "state" / "sluice" / "up-8080"
    monkeypatch.delenv("XDG_STATE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_run_dir(policy) == tmp_path / "home" / ".local" / "state" / "sluice" / "up-8080"


def test_init_writes_a_policy_that_passes_check_and_is_the_built_in_demo(tmp_path: Path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["init"]) == 0
    written = tmp_path / "sluice.yaml"
    assert written.read_text() == render()
    assert "sluice check" in capsys.readouterr().out
    assert main(["check"]) == 0  # ./sluice.yaml, validated by the policy builder and by `envoy --mode validate`
    assert f"policy {written}: OK" in capsys.readouterr().out
    assert policy_to_dict(load_policy(written)) == policy_to_dict(load_policy(EMBEDDED_POLICY))


def test_init_refuses_to_overwrite_without_force(tmp_path: Path, capsys):
    target = tmp_path / "conf"
    target.mkdir()
    (target / "sluice.yaml").write_text("# mine\n")
    assert main(["init", str(target)]) == 1
    assert "already exists" in capsys.readouterr().err
    assert (target / "sluice.yaml").read_text() == "# mine\n"
    assert main(["init", str(target), "--force"]) == 0
    assert (target / "sluice.yaml").read_text() == render()
    assert main(["init", str(tmp_path / "new" / "p.yaml")]) == 0 and (tmp_path / "new" / "p.yaml").is_file()


def _sections(cls: type) -> typing.Iterator[type]:
    """`cls` and every dataclass its fields hold (directly or as list items)."""
    yield cls
    for name, tp in typing.get_type_hints(cls).items():
        if name not in file_fields(cls):
            continue
        inner = [tp, *typing.get_args(tp)]
        for t in inner:
            if dataclasses.is_dataclass(t):
                yield from _sections(t)


def test_init_lists_every_field_under_its_own_description():
    text = render()
    prose = " ".join(re.sub(r"^[\s#]*", "", line) for line in text.splitlines())
    keys = {m.group(1) for m in re.finditer(r"^[\s#-]*(\w+):", text, re.M)}
    for cls in _sections(Policy):
        docs = field_docs(cls)
        for name in file_fields(cls):
            assert docs.get(name), f"{cls.__name__}.{name} has no description"
            assert " ".join(docs[name].split()) in prose, f"{cls.__name__}.{name}: description missing"
            assert name in keys, f"{cls.__name__}.{name} is not listed"


def test_uncommenting_every_field_spells_out_the_same_policy():
    """Every commented-out line is a field at its default: removing the `# ` markers (what `render(all_active=True)`
    writes) gives the same policy, so the listed defaults are the real ones."""
    commented, active = render().splitlines(), render(all_active=True).splitlines()
    assert len(commented) == len(active)
    differing = 0
    for line, full in zip(commented, active):
        if line != full:
            differing += 1
            col = line.index("# ")
            assert line[:col] + line[col + 2:] == full, (line, full)
    assert differing > 200  # most fields are left at their defaults
    built_in = policy_to_dict(load_policy(EMBEDDED_POLICY))
    assert policy_to_dict(policy_from_dict(yaml.safe_load("\n".join(active)))) == built_in
    assert policy_to_dict(policy_from_dict(yaml.safe_load("\n".join(commented)))) == built_in


@pytest.mark.parametrize("section", ["admission", "routing", "budgets"])
def test_an_uncommented_section_is_valid_yaml_on_its_own(section: str):
    """Uncommenting one whole section (its key and its block) gives a valid policy."""
    lines = render().splitlines()
    start = lines.index(f"# {section}:")
    block = [lines[start]]
    for line in lines[start + 1:]:
        if not line.startswith("#  "):
            break
        block.append(line)
    edited = lines[:start] + [line[2:] for line in block] + lines[start + len(block):]
    policy = policy_from_dict(yaml.safe_load("\n".join(edited)))
    assert getattr(policy, section) == getattr(load_policy(EMBEDDED_POLICY), section)
