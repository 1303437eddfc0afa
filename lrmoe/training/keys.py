"""Key names and type coercion of ``lrmoe train``'s settings: the dotted
``section.field`` names, the flat names of earlier versions, and the conversion of YAML /
JSON / ``--set`` values to each field's annotated type.
"""
from __future__ import annotations

import dataclasses
import difflib
import typing
from typing import Any, Dict, List, Mapping, Tuple

from lrmoe.training.sections import SECTION_TYPES, _is_int

# ====================================================================== keys
#: dotted name -> (section, field, type hint)
_FIELDS: Dict[str, Tuple[str, str, Any]] = {}
#: flat (bare) name -> dotted name
FLAT_KEYS: Dict[str, str] = {}
#: a field name of two sections: its flat name keeps the meaning it had before the
#: ``lrmoe`` section got a seed of its own (``seed`` was always ``run.seed``)
_FLAT_OWNER = {"seed": "run.seed"}
for _sec, _cls in SECTION_TYPES.items():
    _hints = typing.get_type_hints(_cls)
    for _f in dataclasses.fields(_cls):
        if not _f.init:  # derived (BackwardConfig.rate_pq)
            continue
        _FIELDS[f"{_sec}.{_f.name}"] = (_sec, _f.name, _hints[_f.name])
        if _f.name in _FLAT_OWNER:
            continue
        assert _f.name not in FLAT_KEYS, _f.name  # flat names must stay unambiguous
        FLAT_KEYS[_f.name] = f"{_sec}.{_f.name}"
FLAT_KEYS.update(_FLAT_OWNER)
FLAT_KEYS["data"] = "data.source"


def config_keys() -> List[str]:
    """Every settable key, dotted (``section.field``)."""
    return list(_FIELDS)


def resolve_key(key: str) -> str:
    """The dotted name of ``key``: a dotted name itself, or a flat name (``lr`` ->
    ``optim.lr``).

    Raises:
        ValueError: an unknown key, with the closest names.
    """
    if key in _FIELDS:
        return key
    if key in FLAT_KEYS:
        return FLAT_KEYS[key]
    close = difflib.get_close_matches(key, list(_FIELDS), n=4, cutoff=0.5)
    close += [FLAT_KEYS[k] for k in difflib.get_close_matches(key.split(".")[-1], FLAT_KEYS,
                                                              n=3, cutoff=0.7)]
    close = list(dict.fromkeys(close))
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    raise ValueError(f"unknown config key {key!r}{hint} (all keys: lrmoe train --print-config)")


def mapping_keys(data: Mapping[str, Any], where: str) -> List[Tuple[str, str, Any]]:
    """The settings of one mapping (a YAML file, a ``train_config.json``): sections
    (``optim: {lr: ...}``), dotted or flat keys, as ``[(dotted, key as written, value)]``.

    Raises:
        ValueError: an unknown key (with close matches), or two spellings of one setting
            (``model: {hidden_size: ..}`` and a flat ``hidden_size``), naming both.
    """
    out: List[Tuple[str, str, Any]] = []
    seen: Dict[str, str] = {}
    for key, value in data.items():
        key = str(key)
        if key in SECTION_TYPES and isinstance(value, Mapping):
            items = [(resolve_key(f"{key}.{k}"), f"{key}.{k}", v) for k, v in value.items()]
        else:
            items = [(resolve_key(key), key, value)]
        for dotted, written, v in items:
            if dotted in seen:
                raise ValueError(f"{where}: {seen[dotted]!r} and {written!r} both set "
                                 f"{dotted}; keep one of them")
            seen[dotted] = written
            out.append((dotted, written, v))
    return out


def set_key(d: Dict[str, Any], dotted: str, value: Any) -> None:
    """``d[section][field] = value`` for the dotted key ``section.field``."""
    section, name = dotted.split(".", 1)
    d.setdefault(section, {})[name] = value


def _coerce(value: Any, hint: Any, key: str) -> Any:
    """Convert a YAML/JSON value to the annotated type ``hint`` (int, float, bool, str,
    Optional[...], Tuple[float, float]). Ints stay ints: a float seed or step count is
    refused unless it is integral (``1e3``)."""
    origin = typing.get_origin(hint)
    if origin is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            return None
        return _coerce(value, args[0], key)
    if origin in (tuple, Tuple):
        if isinstance(value, str):
            value = [v for v in value.replace("(", "").replace(")", "").split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{key} must be a list like [0.9, 0.95], got {value!r}")
        args = typing.get_args(hint)
        if len(value) != len(args):
            raise ValueError(f"{key} must have {len(args)} entries, got {value!r}")
        return tuple(_coerce(v, a, key) for v, a in zip(value, args))
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
            return value.lower() in ("true", "yes", "1")
        raise ValueError(f"{key} must be true or false, got {value!r}")
    if hint is int:
        if isinstance(value, str):
            try:
                return int(value.replace("_", ""))
            except ValueError:
                try:
                    value = float(value)
                except ValueError:
                    raise ValueError(f"{key} must be an int, got {value!r}") from None
        if isinstance(value, float) and value.is_integer() and abs(value) < 2.0 ** 53:
            return int(value)  # exact: YAML reads 1e3 as a float
        if not _is_int(value):
            raise ValueError(f"{key} must be an int, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, str):  # YAML 1.1 reads 3e-4 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                raise ValueError(f"{key} must be a number, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{key} must be a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ValueError(f"{key} must be a string, got {value!r}")
        return str(value)
    return value


def section_from_mapping(cls: type, data: Mapping[str, Any], section: str) -> Any:
    """The section ``cls`` from a mapping of its fields, each coerced to its annotation.

    Raises:
        ValueError: not a mapping, an unknown field (with close matches), a bad value.
    """
    if not isinstance(data, Mapping):
        raise ValueError(f"{section} must be a mapping of its fields, got {data!r}")
    kwargs = {}
    for key, value in data.items():
        dotted = f"{section}.{key}"
        if dotted not in _FIELDS:
            resolve_key(dotted)  # raises with close matches
        kwargs[key] = _coerce(value, _FIELDS[dotted][2], dotted)
    return cls(**kwargs)


def flatten(d: Mapping[str, Any], prefix: str = "") -> Dict[str, Any]:
    """Nested dict -> ``{"section.field": value}`` (tuples as lists)."""
    out: Dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, Mapping):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = list(v) if isinstance(v, tuple) else v
    return out
