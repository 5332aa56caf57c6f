"""The published results block (README.md, docs/benchmarks.md) is generated from a run's JSON, never typed."""

from __future__ import annotations

import json
from pathlib import Path

from bench import report

RUN = Path(__file__).resolve().parents[2] / "bench" / "results" / "scenarios.json"


def test_results_block_is_replaced_between_markers_and_names_the_run(tmp_path: Path) -> None:
    result = json.loads(RUN.read_text())
    page = tmp_path / "page.md"
    page.write_text(f"# Title\n\nbefore\n\n{report.RESULTS_BEGIN}\nstale numbers\n{report.RESULTS_END}\n\nafter\n")
    assert report.update_results_block(result, page)
    text = page.read_text()
    assert "stale numbers" not in text and text.startswith("# Title\n\nbefore\n") and text.endswith("\n\nafter\n")
    assert f"at commit `{result['_meta']['commit']}`" in text
    for sid in (k for k in result if not k.startswith("_")):
        assert f"\n| {sid} | " in text, sid
    assert report.update_results_block(result, page) and page.read_text() == text  # idempotent


def test_a_page_without_markers_is_left_alone(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("no markers here\n")
    assert not report.update_results_block({"_meta": {}}, page)
    assert page.read_text() == "no markers here\n"


def test_the_published_pages_carry_the_markers() -> None:
    root = RUN.parents[2]
    for name in ("README.md", "docs/benchmarks.md"):
        text = (root / name).read_text()
        assert text.count(report.RESULTS_BEGIN) == 1 and text.count(report.RESULTS_END) == 1, name


def test_the_block_shows_what_each_scenario_offered_and_which_bars_are_out_of_reach() -> None:
    """The offered rate is every goodput's ceiling: it is the second column, and a goodput bar that asks for more
    than is offered is named out of reach under the table."""
    result = {"P7": {"sluice": {"slo_goodput_rps": 15.5, "offered_rps": 15.5, "refused_classes": []},
                     "envoy-tuned": {"slo_goodput_rps": 15.5}},
              "_meta": {"systems": ["envoy-tuned", "sluice"], "commit": "abc"}}
    block = report.results_block(result)
    assert "| scenario | offered | envoy-tuned | sluice |" in block and "\n| P7 | 15.5 | 15.5 | 15.5 | 1.00x |" in block
    assert "The goodput bars of P7 are out of reach at their load" in block


def test_the_offered_column_names_sluices_own_offer_where_closed_loop_clients_offer_less() -> None:
    result = {"P11": {"sluice": {"slo_goodput_rps": 9.5, "offered_rps": 10.2, "refused_classes": []},
                      "envoy-rr": {"slo_goodput_rps": 18.4, "offered_rps": 19.5}},
              "_meta": {"systems": ["envoy-rr", "sluice"], "commit": "abc"}}
    assert "\n| P11 | 19.5 (sluice 10.2) | 18.4 | 9.5 |" in report.results_block(result)
