"""The `--json` records match the JSON Schema shipped in rnnfuse/schema/.

Each command's record is validated with `jsonschema` against
cli-output-v1.json, read through importlib.resources as an installed
package reads it; the same field has the same type in every command.
"""

from __future__ import annotations

import json

import jsonschema
import keras
import pytest

from rnnfuse import cli
from rnnfuse.cli.output import SCHEMA_VERSION, input_records, load_schema


def _stack():
    return keras.Sequential(
        [
            keras.Input((6, 3), name="x"),
            keras.layers.LSTM(4, return_sequences=True, name="lstm_a"),
            keras.layers.LSTM(4, name="lstm_b"),
            keras.layers.Dense(2, name="head"),
        ],
        name="stack",
    )


def _text():
    tokens = keras.Input((None,), dtype="int32", name="tokens")
    x = keras.layers.Embedding(7, 3, mask_zero=True, name="embed")(tokens)
    x = keras.layers.GRU(4, return_sequences=True, name="gru_a")(x)
    return keras.Model(tokens, keras.layers.GRU(4, name="gru_b")(x), name="text")


@pytest.fixture
def saved(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _stack().save("stack.keras")
    _text().save("text.keras")
    return tmp_path


def _json(capsys, *argv) -> dict:
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


def test_the_schema_is_valid_and_versioned():
    schema = load_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    assert schema["properties"]["schema_version"] == {"const": SCHEMA_VERSION}


COMMANDS = {
    "inspect": ("inspect", "stack.keras", "--json"),
    "inspect-none": ("inspect", "stack.keras", "--min-layers", "3", "--json"),
    "bench": ("bench", "text.keras", "--steps", "4", "--batch", "2", "--repeats", "1",
              "--warmup", "1", "--json"),
    "check": ("check", "text.keras", "--steps", "4", "--batch", "2", "--json"),
    "check-fused": ("check", "stack.keras", "--plan", "fused", "--batch", "2", "--json"),
    "check-per-layer": ("check", "stack.keras", "--plan", "per-layer", "--batch", "2", "--json"),
}


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_command_matches_the_schema(saved, capsys, name):
    record = _json(capsys, *COMMANDS[name])
    jsonschema.validate(record, load_schema())
    assert record["schema_version"] == SCHEMA_VERSION
    assert record["command"] == COMMANDS[name][0]
    assert isinstance(record["groups"], list)
    if name == "inspect-none":
        assert record["groups"] == []
    if name == "check-per-layer":
        assert record["groups"][0]["plan"]["pieces"] == []
        assert record["groups"][0]["runs"]["fused"] is False
        assert record["compared_fused_path"] is False


def test_the_schema_rejects_the_old_free_text_fields(saved, capsys):
    record = _json(capsys, *COMMANDS["check"])
    record["groups"] = 1
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(record, load_schema())


@pytest.mark.parametrize(
    "argv", [("check", "missing.keras", "--json"), ("bench", "text.keras", "--batch", "0", "--json"), ("--json",)]
)
def test_an_error_under_json_is_a_record_of_the_schema(saved, capsys, argv):
    code = cli.main(list(argv))
    record = json.loads(capsys.readouterr().out)
    assert code == 2
    jsonschema.validate(record, load_schema())
    assert record["error"]["exit_code"] == 2 and record["error"]["message"]
    record["groups"] = []  # an error record holds no result
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(record, load_schema())
    del record["groups"], record["error"]  # nor is a record without error or result valid
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(record, load_schema())


def test_input_records_are_structured():
    [tokens, x, flag] = input_records(
        [
            "tokens: int32 [4, 6], token ids 1..6, right-padded with 0",
            "x: float32 [4, 8, 3], standard normal",
            "mask: bool [4, 8]",
        ]
    )
    assert tokens == {"name": "tokens", "dtype": "int32", "shape": [4, 6],
                      "values": "token ids 1..6, right-padded with 0"}
    assert x["shape"] == [4, 8, 3] and x["values"] == "standard normal"
    assert flag["dtype"] == "bool" and flag["values"] == "random booleans"
