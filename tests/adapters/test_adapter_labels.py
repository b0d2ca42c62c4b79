"""The bound on /metrics' lora_name values (AdapterLabels), with a hand-driven clock: the first N adapters get a
label until the first window ends; then the N with the most requests in the window keep or get theirs, the series
of the others are removed, and their requests count as "<other>"."""

from __future__ import annotations

from lora_server.server.metrics import LORA_LABEL_WINDOW_S, OTHER_ADAPTERS, AdapterLabels


def test_top_adapters_by_requests_keep_their_labels():
    now = [0.0]
    dropped: list[set[str]] = []
    labels = AdapterLabels(2, dropped.append, clock=lambda: now[0])
    assert labels.label(None) == ""  # the base model: its own series, never counted against the bound
    other = OTHER_ADAPTERS
    assert [labels.label(a) for a in ("a", "b", "c", "a", "c", "c")] == ["a", "b", other, "a", other, other]
    # the window ends: c (3 requests) and a (2) are the top two; b (1) loses its label and its series go
    now[0] = LORA_LABEL_WINDOW_S
    assert labels.label("b") == OTHER_ADAPTERS
    assert dropped == [{"b"}] and labels.labelled == {"a", "c"}
    assert labels.label("c") == "c" and labels.label("a") == "a"
    # next window: b 3 requests (counted, though under <other>), a 1, c 1 -> b and a (ties by name) win
    for _ in range(2):
        labels.label("b")
    now[0] = 2 * LORA_LABEL_WINDOW_S
    assert labels.label("d") == OTHER_ADAPTERS
    assert dropped == [{"b"}, {"c"}] and labels.labelled == {"a", "b"}


def test_zero_labels_puts_every_adapter_in_other():
    labels = AdapterLabels(0, lambda names: None, clock=lambda: 0.0)
    assert labels.label("a") == OTHER_ADAPTERS and labels.label(None) == ""
