"""The `--json` records of `inspect`, `bench` and `check` (schema version 1).

Every record is one JSON object with the same envelope and types in every
command; rnnfuse/schema/cli-output-v1.json is the JSON Schema (documented
in docs/api.md). A version that changes a field's meaning or type bumps
`schema_version`; adding a field does not.

>>> SCHEMA_VERSION
1
"""

from __future__ import annotations

import json
import re
from importlib import resources
from typing import Any, Sequence

__all__ = ["SCHEMA_VERSION", "envelope", "error_record", "group_records", "input_records", "load_schema"]

SCHEMA_VERSION = 1
SCHEMA_FILE = "cli-output-v1.json"


def load_schema() -> dict:
    """The JSON Schema of the `--json` records, as shipped in rnnfuse/schema/."""
    text = resources.files("rnnfuse.schema").joinpath(SCHEMA_FILE).read_text("utf-8")
    return json.loads(text)


def rnnfuse_version() -> str:
    """The installed distribution's version (the source tree's without one)."""
    from importlib import metadata

    try:
        return metadata.version("rnnfuse")
    except metadata.PackageNotFoundError:
        from rnnfuse import __version__

        return __version__


def envelope(command: str, model_name: str) -> dict:
    from rnnfuse.placement import backend_name

    return {
        "schema_version": SCHEMA_VERSION,
        "command": command,
        "rnnfuse_version": rnnfuse_version(),
        "backend": backend_name(),
        "model": model_name,
    }


def error_record(command: str | None, exit_code: int, message: str) -> dict:
    """The `--json` record of a failed command (no keras import needed)."""
    return {
        "schema_version": SCHEMA_VERSION,
        "command": command,
        "rnnfuse_version": rnnfuse_version(),
        "error": {"exit_code": exit_code, "message": message},
    }


def group_records(chosen: Sequence[Any]) -> list[dict]:
    """One JSON object per `TuneResult` (group, plan, source)."""
    from rnnfuse.placement import placement

    records = []
    for result in chosen:
        plan = result.plan.for_length(len(result.group.layers))
        where = placement(result.plan, result.source)
        records.append(
            {
                **result.group.to_dict(),
                "plan": {
                    "name": result.plan.name,
                    "pieces": list(plan.pieces),
                    "algorithm": plan.algorithm,
                    "source": result.source,
                },
                "runs": {"fused": where.fused, "how": where.how, "why": where.why},
            }
        )
    return records


_DESCRIBED = re.compile(r"^(?P<name>.*?): (?P<dtype>\w+) \[(?P<shape>[\d, ]*)\](?:, (?P<values>.*))?$")


def input_records(described: Sequence[str]) -> list[dict]:
    """{name, dtype, shape, values} per line of `random_inputs`' descriptions."""
    records = []
    for line in described:
        match = _DESCRIBED.match(line)
        if match is None:
            records.append({"name": line, "dtype": None, "shape": None, "values": line})
            continue
        shape = [int(d) for d in match["shape"].split(",") if d.strip()]
        values = match["values"] or ("random booleans" if match["dtype"] == "bool" else "")
        records.append(
            {"name": match["name"], "dtype": match["dtype"], "shape": shape, "values": values}
        )
    return records


def describe_input(record: dict) -> str:
    """The one line the text output prints for an input record."""
    if record["shape"] is None:
        return record["values"]
    return f"{record['name']}: {record['dtype']} {record['shape']}, {record['values']}"
