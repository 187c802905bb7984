"""rnnfuse.report: the records analyze and optimize return."""

from __future__ import annotations

import dataclasses
import json

import keras
import pytest

import rnnfuse

L = keras.layers


def _model():
    return keras.Sequential(
        [
            keras.Input((6, 3)),
            L.GRU(4, return_sequences=True, name="a"),
            L.GRU(4, return_sequences=True, name="b"),
            L.LSTM(4, recurrent_dropout=0.1, name="c"),
        ]
    )


def test_report_to_dict_is_json_with_rules():
    report = rnnfuse.analyze(_model())
    d = json.loads(json.dumps(report.to_dict()))
    assert d["groups"][0]["layers"] == ["a", "b"]
    assert d["skipped"]["c"]["rule"] == "recurrent_dropout"


def test_report_text_lists_groups_and_reasons():
    text = str(rnnfuse.analyze(_model()))
    assert "a -> b" in text and "recurrent_dropout" in text


def test_the_tables_keep_names_that_read_as_markup_in_any_console():
    """Rich markup must not eat `[bold]` from a layer named `enc[bold]`."""
    import io

    from rich.console import Console

    model = keras.Sequential(
        [keras.Input((6, 3)), L.GRU(4, return_sequences=True, name="enc[bold]"), L.GRU(4, return_sequences=True, name="dec[red]"),
         L.LSTM(4, name="odd[italic]")]
    )
    report = rnnfuse.analyze(model)
    buf = io.StringIO()
    console = Console(file=buf, width=200)  # markup on, as a user's console is
    for table in report.tables():
        console.print(table)
    for text in (buf.getvalue(), str(report)):
        assert "enc[bold] -> dec[red]" in text and "odd[italic]" in text


def test_records_are_frozen():
    report = rnnfuse.analyze(_model())
    with pytest.raises(dataclasses.FrozenInstanceError):
        report.groups[0].units = 3
    with pytest.raises(TypeError):
        report.skipped["x"] = "y"


def test_optimize_result_holds_model_report_and_plans():
    model = _model()
    result = rnnfuse.optimize(model, return_result=True)
    assert isinstance(result, rnnfuse.OptimizeResult)
    assert result.report == rnnfuse.analyze(model)
    assert [r.group.layers for r in result.plans] == [("a", "b")]
    assert [r.source for r in result.plans] == ["static"]
    assert result.failed == () and result.modified
    assert isinstance(rnnfuse.optimize(model), keras.Model)
