"""The launcher's flags for `EngineConfig`, generated from its fields: a flag per field,
named after it, of its type, with its default and help from the field and its metadata
(`jaxpd.config.knob`), as vLLM builds its command line from its config dataclasses. A
default is written once, in `EngineConfig`; a flag whose default is not the field's
says so in the field (`launch_default`: `LLM` resolves the unset value).

Plain Python (absl flags): importing this loads no jax.
"""
from __future__ import annotations

import dataclasses

from absl import flags

from jaxpd.config import EngineConfig, prefix_caching_by_default

FIELDS = tuple(dataclasses.fields(EngineConfig))


def flag_default(field: dataclasses.Field):
    """The default of `field`'s flag: the field's own, or its `launch_default`."""
    return field.metadata.get("launch_default", field.default)


def _kind(field: dataclasses.Field) -> str:
    """"bool", "int", "float" or "str": the field's type less None (and `MeshSpec`, which
    the flag spells as its string)."""
    kinds = [t.strip() for t in str(field.type).split("|")]
    kinds = [t for t in kinds if t not in ("None", "MeshSpec")]
    if len(kinds) != 1 or kinds[0] not in ("bool", "int", "float", "str"):
        raise TypeError(f"EngineConfig.{field.name}: no flag type for {field.type!r}")
    return kinds[0]


def define_config_flags(fv: flags.FlagValues) -> None:
    """A flag on `fv` for every `EngineConfig` field."""
    for field in FIELDS:
        name, default, help_text = field.name, flag_default(field), field.metadata["help"]
        options = dict(field.metadata.get("flag", {}))
        choices = options.pop("choices", None)
        kind = _kind(field)
        if choices is not None:
            flags.DEFINE_enum(name, default, choices, help_text, flag_values=fv, **options)
        elif kind == "bool":
            flags.DEFINE_bool(name, default, help_text, flag_values=fv, **options)
        elif kind == "int":
            flags.DEFINE_integer(name, default, help_text, flag_values=fv, **options)
        elif kind == "float":
            flags.DEFINE_float(name, default, help_text, flag_values=fv, **options)
        else:
            flags.DEFINE_string(name, default, help_text, flag_values=fv, **options)


def config_options(fv: flags.FlagValues, processes: int = 1) -> dict:
    """`LLM` keyword arguments for `EngineConfig` from the flags: every field whose flag
    holds a value (an unset one, None, is left to `LLM` and `EngineConfig`). A role's
    mesh across `processes` resolves unset prefix caching here, where the count is
    known (`prefix_caching_by_default`)."""
    options = {f.name: fv[f.name].value for f in FIELDS if fv[f.name].value is not None}
    if fv.enable_prefix_caching is None and processes > 1:
        options["enable_prefix_caching"] = prefix_caching_by_default(
            fv.mesh, fv.layerwise_min_tokens, fv.kv_transfer_dtype, processes)
    return options
