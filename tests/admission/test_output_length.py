"""Expected output of requests without max_tokens: the app's learned p90 (bounded state, per model and app)."""

from extproc.admission.output_length import MAX_APPS, MIN_SAMPLES, WINDOW, OutputLengths


def test_nothing_is_expected_before_enough_completions():
    ol = OutputLengths()
    for n in range(MIN_SAMPLES - 1):
        ol.observe("m", "app", 100 + n)
    assert ol.expected("m", "app") == 0
    ol.observe("m", "app", 100)
    assert ol.expected("m", "app") > 0


def test_p90_of_the_recent_natural_lengths_per_app_and_model():
    ol = OutputLengths()
    for i in range(100):
        ol.observe("m", "essays", 1_000 + 10 * i)  # 1,000 .. 1,990
        ol.observe("m", "classifier", 5 + i % 10)  # 5 .. 14
    assert 1_880 <= ol.expected("m", "essays") <= 1_910
    assert 13 <= ol.expected("m", "classifier") <= 14
    assert ol.expected("other-model", "essays") == 0


def test_old_lengths_leave_the_window():
    ol = OutputLengths()
    for _ in range(WINDOW):
        ol.observe("m", "a", 2_000)
    for _ in range(WINDOW):  # the app changed: short answers now
        ol.observe("m", "a", 50)
    assert ol.expected("m", "a") == 50


def test_apps_are_bounded_least_recently_seen_first():
    ol = OutputLengths()
    for _ in range(MIN_SAMPLES):
        ol.observe("m", "first", 10)
    for i in range(MAX_APPS):
        ol.observe("m", f"app-{i}", 10)
    assert ol.expected("m", "first") == 0  # forgotten
    assert len(ol._apps) == MAX_APPS
