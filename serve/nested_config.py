"""The settings that are themselves a record (speculative_config, kv_eviction, kv_transfer_config): each given as
None, the record, or vLLM's dict of its fields, read here by one rule."""

from __future__ import annotations

import dataclasses


def nested_config(cls, value, setting: str, example: str, required: str | None = None, choices=()):
    """None, a `cls`, or a dict of its fields -> None or a `cls`. A value of another type, an unknown key, or a
    missing `required` key is a ValueError in one line naming `setting` (and the example dict, the known keys, the
    choices)."""
    if value is None or isinstance(value, cls):
        return value
    if not isinstance(value, dict):
        raise ValueError(f"{setting} must be a dict like {example}, not {type(value).__name__}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"{setting}: unknown key {unknown[0]!r}; known: {', '.join(sorted(known))}")
    if required is not None and required not in value:
        raise ValueError(f"{setting} needs a {required}: {' or '.join(choices)}")
    return cls(**value)
