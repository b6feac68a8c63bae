"""Loading a config: YAML files and dotted ``key=value`` overrides, validated into a model, with
errors that name the field, the value given and what is allowed; saving one back."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ValidationError

from postrl.config.command import RunCommandConfig
from postrl.config.run import ConfigError, RunConfig, activate_import_paths


def _union_members(annotation: Any) -> list[tuple[Any, set[str]]]:
    """The members of a (possibly Annotated) union with the tags that select each: a ``Tag(...)``
    or the Literal values of its ``type`` field."""
    import typing

    while typing.get_origin(annotation) is Annotated:
        annotation = typing.get_args(annotation)[0]
    if typing.get_origin(annotation) not in (typing.Union, __import__("types").UnionType):
        return []
    members = []
    for arg in typing.get_args(annotation):
        tags: set[str] = set()
        cls = arg
        if typing.get_origin(arg) is Annotated:
            cls, *meta = typing.get_args(arg)
            tags |= {m.tag for m in meta if hasattr(m, "tag")}
        if typing.get_origin(cls) in (typing.Union, __import__("types").UnionType):  # a tagged union, optional
            members += _union_members(cls)
            continue
        type_field = getattr(cls, "model_fields", {}).get("type")
        if type_field is not None and typing.get_origin(type_field.annotation) is Literal:
            tags |= set(typing.get_args(type_field.annotation))
        members.append((cls, tags))
    return members


def _user_location(model: type[BaseModel], loc: tuple[Any, ...]) -> tuple[list[str], Any]:
    """The field path as the user wrote it (without pydantic's union tags such as ``custom`` in
    ``reward.components.0.custom.weight``), and the model the last part belongs to."""
    import typing

    parts: list[str] = []
    current: Any = model
    for part in loc:
        members = _union_members(current)
        if members:
            chosen = next((cls for cls, tags in members if part in tags), None)
            if chosen is not None:
                current = chosen
                continue
        while typing.get_origin(current) is Annotated:
            current = typing.get_args(current)[0]
        if isinstance(part, int) and typing.get_origin(current) in (list, tuple):
            current = typing.get_args(current)[0] if typing.get_args(current) else None
        elif isinstance(current, type) and issubclass(current, BaseModel):
            field = current.model_fields.get(str(part))
            current = field.annotation if field is not None else None
        else:
            current = None
        parts.append(str(part))
    return parts, current


def _allowed(model: type[BaseModel], loc: tuple[Any, ...]) -> str:
    """The allowed field names where an unknown field ``loc`` was given."""
    _, parent = _user_location(model, loc[:-1])
    members = _union_members(parent)
    if len(members) == 1:
        parent = members[0][0]
    names = sorted(getattr(parent, "model_fields", {})) if isinstance(parent, type) else []
    return f" (allowed: {', '.join(names)})" if names else ""


def _unused_here(model: type[BaseModel], loc: tuple[Any, ...]) -> str:
    """How to name a field the config has no place for: one another command uses (``train.precision``
    in a ``postrl dpo`` config) is named as such, so it is not mistaken for a typo."""
    others = [name for name, other in command_models().items() if other is not model and _has_field(other, loc)]
    where = ".".join(_user_location(model, loc)[0]) or "<config>"
    if not others:
        return f"unknown config field '{where}'"
    mine = next((name for name, m in command_models().items() if m is model), "this command")
    users = " and ".join(f"postrl {name}" for name in others)
    name = where.rsplit(".", 1)[-1]
    own = f" (the top-level {name} is postrl {mine}'s)" if "." in where and name in model.model_fields else ""
    return f"config field '{where}' is used by {users}, not by postrl {mine}, which would ignore it: remove it{own}"


def _has_field(model: type[BaseModel], loc: tuple[Any, ...]) -> bool:
    parts, _ = _user_location(model, loc)
    current: Any = model
    for part in parts:
        fields = getattr(current, "model_fields", None)
        if fields is None or part not in fields:
            return False
        current = fields[part].annotation
    return True


def format_validation_error(err: ValidationError, model: type[BaseModel] = RunConfig) -> str:
    lines = []
    seen = set()
    for e in err.errors():
        loc = tuple(e["loc"])
        where = ".".join(_user_location(model, loc)[0]) or "<config>"
        if e["type"] == "extra_forbidden":
            line = f"{_unused_here(model, loc)}{_allowed(model, loc)}"
        elif e["type"] == "missing":
            line = f"config field '{where}' is required"
        elif e["type"] == "value_error":  # our own validators: the message names the fields
            message = e["msg"].removeprefix("Value error, ")
            line = message if not loc else f"config field '{where}': {message}"
        else:
            line = f"config field '{where}': got {e.get('input')!r}: {e['msg']}"
        if line not in seen:
            seen.add(line)
            lines.append(line)
    return "invalid config:\n  " + "\n  ".join(lines)


def _parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like key.sub=value")
    key, raw = item.split("=", 1)
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {item!r} has an empty key")
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {item!r}: value is not valid YAML: {exc}") from exc
    return key.split("."), value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for item in overrides:
        path, value = _parse_override(item)
        node = data
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: '{part}' is a value, not a section")
            node = child
        node[path[-1]] = value
    return data


def build_config(data: dict[str, Any], overrides: list[str] | None = None, model: type[Any] | None = None) -> Any:
    """Validate ``data`` + overrides as ``model`` (default :class:`RunConfig`)."""
    model = model or RunConfig
    data = apply_overrides(copy.deepcopy(data), overrides or [])
    if "import_paths" in model.model_fields:  # plugins and custom reward functions are imported while validating
        paths = data.get("import_paths")
        activate_import_paths([str(p) for p in paths] if isinstance(paths, list) else [])
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, model)) from None


def load_config(
    path: str | Path | None,
    overrides: list[str] | None = None,
    model: type[Any] | None = None,
    import_config_dir: bool = True,
) -> Any:
    """A YAML file + dotted overrides validated as ``model`` (default :class:`RunConfig`).

    With ``import_config_dir``, the file's folder joins ``import_paths`` (when the model has that
    field), so a reward module next to the config imports without PYTHONPATH."""
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            loaded = yaml.safe_load(path.read_text())
        except yaml.YAMLError as exc:
            where = str(exc).replace('"<unicode string>"', str(path))
            raise ConfigError(f"config file {path} is not valid YAML: {where}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {path} must hold a mapping at the top level")
        check_command(loaded or {}, model or RunConfig, path)
        # overrides first, so a data path given on the command line is found the same way as one in the file
        data = _data_files_found_near(
            apply_overrides(copy.deepcopy(loaded or {}), overrides or []), path.resolve().parent
        )
        overrides = []
        if import_config_dir and "import_paths" in (model or RunConfig).model_fields:
            here = str(path.resolve().parent)
            paths = data.get("import_paths") or []
            if isinstance(paths, list) and here not in paths:
                data = {**data, "import_paths": [*paths, here]}
    return build_config(data, overrides, model)


def command_models() -> dict[str, type[BaseModel]]:
    """The config model of each command that starts a run."""
    from postrl.config.dpo import DPORunConfig
    from postrl.config.sft import SFTRunConfig

    return {"train": RunConfig, "dpo": DPORunConfig, "sft": SFTRunConfig}


def check_command(data: dict[str, Any], model: type[BaseModel], path: Path) -> None:
    """A config written for another command (a GRPO config given to ``postrl dpo``) says so."""
    unknown = set(data) - set(model.model_fields)
    if not unknown:
        return
    models = command_models()
    mine = next((name for name, m in models.items() if m is model), None)
    fits = [name for name, other in models.items() if other is not model and unknown <= set(other.model_fields)]
    if fits:
        which = " or ".join(f"`postrl {name}`" for name in fits)
        raise ConfigError(
            f"{path} is a {which} config (it has {', '.join(sorted(unknown))}), not a `postrl {mine}` "
            f"one: run it with {' or '.join(f'postrl {name}' for name in fits)} {path}"
        )


def _data_files_found_near(data: dict[str, Any], config_dir: Path) -> dict[str, Any]:
    """A relative ``data.train_files`` entry that is not under the working directory but is next to
    the config file means the file next to the config (so an example runs from any directory)."""
    section = data.get("data")
    if not isinstance(section, dict):
        return data
    section = dict(section)
    for key in ("train_files", "val_files"):
        files = section.get(key)
        if isinstance(files, list):
            section[key] = [find_data_file(f, config_dir) if isinstance(f, str) else f for f in files]
    return {**data, "data": section}


def find_data_file(name: str, config_dir: Path | None) -> str:
    """A relative path that is not under the working directory but is next to the config file
    means the file next to the config; otherwise the name is kept (a missing file is reported when
    the data is loaded, naming both places)."""
    if "://" in name or Path(name).is_absolute() or Path(name).exists() or config_dir is None:
        return name
    near = config_dir / name
    return str(near) if near.exists() else name


def save_config(config: RunCommandConfig, path: Path) -> None:
    path.write_text(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))
