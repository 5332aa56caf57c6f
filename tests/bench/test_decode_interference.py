"""bench.decode_interference: P10's arrivals on two simulated engines, offline, one gateway policy at a time."""

from bench import decode_interference as di


def by_name(window: di.Window) -> dict[str, dict[str, dict[str, int]]]:
    return {p.name: di.replay(p, window) for p in di.policies()}


def test_every_call_is_counted_once_in_every_policy():
    quick = di.windows()[0]
    for outcome in by_name(quick).values():
        for c in outcome.values():
            assert c["calls"] == sum(v for k, v in c.items() if k != "calls")


def test_decodes_behind_queued_prefills_do_not_finish_in_the_quick_window():
    """The quick window ends before a third of round robin's calls after the change finish; two requests in flight
    per replica let the decodes finish in time, a prefill gate at the SLO does not."""
    quick = by_name(di.windows()[0])
    forward = quick["forward"]["after"]
    assert 3 * forward["unfinished"] >= forward["calls"]
    capped = quick["in flight <= 2"]["after"]
    assert capped["unfinished"] == 0 and capped["within_slo"] >= forward["within_slo"] + forward["unfinished"]
    gate = next(v for k, v in quick.items() if k.endswith("(the SLO)"))["after"]
    assert gate["within_slo"] <= forward["within_slo"] + 1


def test_with_the_slo_added_to_the_drain_every_policy_serves_the_quick_run():
    for outcome in by_name(di.windows()[1]).values():
        assert outcome["after"]["within_slo"] == outcome["after"]["calls"]
        assert outcome["before"]["within_slo"] == outcome["before"]["calls"]
