"""Reading a Triton-layout model repository from local disk.

Layout: ``<root>/<model>/config.pbtxt`` (optional for ONNX models) and numeric
version folders ``<root>/<model>/<version>/<model file>``. Problems with one
model make only that model unavailable; they are reported in
:attr:`RepositoryModel.error` rather than raised.

A deployment may name a custom configuration (``config_name``, Triton's
``--model-config-name``, the setting ``SLUICE_MODEL_CONFIG_NAME``): a model whose folder has
``configs/<name>.pbtxt`` is read with that file instead of its ``config.pbtxt``; the others
as usual. Every reader of one deployment passes the same name.

In a view joining several repositories with model namespacing
(:mod:`sluice.core.repository_namespaces`), a model served under an internal name is read
as its own name says, then renamed to its internal name, and an ensemble's steps are
resolved within its repository.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from sluice.core.config import (
    CONFIG_FILENAME,
    ONNX_FILENAME,
    PLATFORM_BY_FILE_SUFFIX,
    ModelConfig,
    VersionPolicy,
    autocomplete_from_onnx,
    config_from_proto,
    config_to_proto,
    is_onnx,
    parse_config_text,
)
from sluice.core.config.platforms import fallback_model_filename
from sluice.core.config.python_autocomplete import autocomplete_python, wants_python_autocomplete
from sluice.core.errors import InvalidConfig
from sluice.core.repository_agents import check_repository_agents
from sluice.core.repository_namespaces import (
    Namespaces,
    ambiguity,
    read_namespaces,
    unresolved_steps,
)
from sluice.core.settings import CONFIG_NAME_PATTERN, DEFAULT_MAX_BATCH_SIZE

# Triton ignores version folders that are not plain positive numbers ("01", "v1", "0").
_VERSION_DIR = re.compile(r"[1-9][0-9]*")

CUSTOM_CONFIGS = "configs"
"""The folder of a model's custom configurations (``configs/<name>.pbtxt``)."""

CONFIG_NAME = re.compile(CONFIG_NAME_PATTERN)
"""A custom configuration's name (:data:`~sluice.core.settings.CONFIG_NAME_PATTERN`)."""

DUPLICATES_FILE = ".sluice-duplicates.json"
"""In a repository that joins several (their view, made by ``sluice up``): a JSON list of
the model names two or more of them hold, served from none."""

DUPLICATE_REASON = "model appears in two or more repositories"
"""Why such a model is unavailable (Triton's words)."""


@dataclass(frozen=True, slots=True)
class RepositoryModel:
    name: str
    path: Path
    config: ModelConfig | None
    versions: tuple[int, ...]
    error: str | None = None
    listed_as: str = ""
    """The name clients know the model by, where ``name`` is an internal name (model
    namespacing: a copy of a name several repositories hold); empty otherwise."""
    ambiguous: bool = False
    """A name several repositories hold (model namespacing): no model of its own; ``error``
    is Triton's answer to a request naming it."""
    namespace: str = ""
    """Model namespacing: the repository the model comes from (its location as named),
    Triton's namespace of the model; empty otherwise."""
    once_loaded: bool = False
    """Explicit model control: an unloaded model that was loaded, and unloaded, since the
    executor started (:attr:`sluice.core.catalog.CatalogEntry.once_loaded`)."""

    @property
    def usable(self) -> bool:
        return self.error is None and self.config is not None

    def model_file(self, version: int) -> Path:
        if self.config is None:
            raise InvalidConfig(self.error or f"model '{self.name}' is unavailable")
        return self.path / str(version) / self.config.default_model_filename


def scan_repository(
    root: Path, config_name: str = "", *, default_max_batch_size: int = DEFAULT_MAX_BATCH_SIZE
) -> list[RepositoryModel]:
    """Every model under ``root``, sorted by name (hidden directories skipped), each with
    its custom configuration ``config_name`` where it has one; in a view joining several
    repositories, the names two or more of them hold come as unavailable models (with model
    namespacing: as ambiguous names, each copy served under its internal name).
    ``default_max_batch_size``: what autocomplete gives a model that can batch
    (:func:`autocomplete_from_onnx`)."""
    if not root.exists():
        raise InvalidConfig(f"model repository {root} does not exist")
    if not root.is_dir():
        raise InvalidConfig(f"model repository {root} is not a directory")
    model_dirs = sorted(
        (p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")),
        key=lambda p: p.name,
    )
    namespaces = read_namespaces(root)
    models = [_read_one(p, config_name, default_max_batch_size, namespaces) for p in model_dirs]
    models += [
        RepositoryModel(name, root / name, None, (), DUPLICATE_REASON)
        for name in duplicate_names(root)
    ]
    models += ambiguous_models(root, namespaces, {p.name for p in model_dirs})
    models.sort(key=lambda model: model.name)
    by_name = {model.name: model for model in models}
    return [_with_transaction_policy(model, by_name.get) for model in models]


def duplicate_names(root: Path) -> list[str]:
    """The names :data:`DUPLICATES_FILE` lists (none where there is no such file): models
    that no folder of ``root`` holds, unavailable with :data:`DUPLICATE_REASON`."""
    try:
        names = json.loads((root / DUPLICATES_FILE).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as exc:
        raise InvalidConfig(f"cannot read {root / DUPLICATES_FILE}: {exc}") from None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise InvalidConfig(f"{root / DUPLICATES_FILE} is not a list of model names")
    return names


def ambiguous_models(
    root: Path, namespaces: Namespaces | None, folders: set[str]
) -> list[RepositoryModel]:
    """The names of ``namespaces`` (the record of the view ``root``) that several
    repositories hold, each an unavailable model with Triton's answer to a request naming
    it; none that ``folders`` (the view's) hold."""
    if namespaces is None:
        return []
    return [
        RepositoryModel(name, root / name, None, (), ambiguity(name, len(copies)), ambiguous=True)
        for name, copies in namespaces.ambiguous().items()
        if name not in folders
    ]


def read_model(
    path: Path, config_name: str = "", *, default_max_batch_size: int = DEFAULT_MAX_BATCH_SIZE
) -> RepositoryModel:
    """One model directory (with its custom configuration ``config_name`` where it has
    one); model-level problems end up in ``error``. An ensemble's composing models are read
    from the same repository (for its transaction policy)."""
    try:
        namespaces = read_namespaces(path.parent)
    except InvalidConfig as exc:
        return RepositoryModel(path.name, path, None, (), exc.message)
    model = _read_one(path, config_name, default_max_batch_size, namespaces)
    if model.config is None or not model.config.is_ensemble:
        return model
    read: dict[str, RepositoryModel | None] = {}

    def sibling(name: str) -> RepositoryModel | None:
        if name not in read:
            folder = path.parent / name
            read[name] = (
                _read_one(folder, config_name, default_max_batch_size, namespaces)
                if name and folder.is_dir()
                else None
            )
        return read[name]

    return _with_transaction_policy(model, sibling)


def _read_one(
    path: Path, config_name: str, default_max_batch_size: int, namespaces: Namespaces | None
) -> RepositoryModel:
    name = path.name
    own_name = name if namespaces is None else namespaces.name_of(name)
    listed_as = own_name if own_name != name else ""
    namespace = "" if namespaces is None else namespaces.repository_of(name)
    try:
        config, versions = _load(path, config_name, default_max_batch_size, own_name)
        if namespaces is not None:
            config = _in_namespace(config, name, namespaces)
    except InvalidConfig as exc:
        return RepositoryModel(name, path, None, (), exc.message, listed_as, namespace=namespace)
    return RepositoryModel(name, path, config, versions, listed_as=listed_as, namespace=namespace)


def _in_namespace(config: ModelConfig, view_name: str, namespaces: Namespaces) -> ModelConfig:
    """``config`` (read under the model's own name) as the view serves it: named
    ``view_name``, its steps (an ensemble's) calling the models they resolve to from its
    repository; InvalidConfig with Triton's reason for a step that resolves to none.

    Each step's ``model_namespace`` is the repository of the model it resolves to, as
    Triton writes it there: the field is Triton's own (reserved: what a configuration sets
    is not read, steps resolve by name alone)."""
    index = namespaces.index_of(view_name)
    steps = [step.model_name for step in config.ensemble_steps]
    resolved = steps if index is None else [namespaces.resolve(s, index) for s in steps]
    unresolved = [step for step, to in zip(steps, resolved, strict=True) if to is None]
    if unresolved:
        assert index is not None
        repository = namespaces.repositories[index]
        raise InvalidConfig(unresolved_steps(repository, config.name, dict.fromkeys(unresolved)))
    if config.name == view_name and not steps:
        return config
    msg = config_to_proto(config)
    msg.name = view_name
    for step, to in zip(msg.ensemble_scheduling.step, resolved, strict=True):
        assert to is not None
        step.model_name = to
        step.model_namespace = namespaces.repository_of(to)
    return config_from_proto(msg, model_name=view_name)


def _with_transaction_policy(
    model: RepositoryModel, lookup: Callable[[str], RepositoryModel | None]
) -> RepositoryModel:
    """An ensemble is decoupled exactly when one of its composing models is (at any depth
    of nested ensembles), as Triton fills in its ``model_transaction_policy``: each response
    of such a model runs the steps after it again, and the ensemble answers each time."""
    config = model.config
    if config is None or not config.is_ensemble:
        return model
    decoupled = _reaches_decoupled(config, lookup, {model.name})
    if decoupled == config.decoupled:
        return model
    raw = dict(config.raw)
    raw["model_transaction_policy"] = {
        **(raw.get("model_transaction_policy") or {}),
        "decoupled": decoupled,
    }
    return replace(model, config=replace(config, raw=raw))


def composing_models(
    config: ModelConfig, lookup: Callable[[str], RepositoryModel | None]
) -> list[str]:
    """The models ensemble ``config`` calls, at any depth of nested ensembles, each once,
    those a nested ensemble calls before it (the order Triton loads them in). Models that
    ``lookup`` does not find are left out (the ensemble's load reports them)."""
    found: list[str] = []

    def visit(ensemble: ModelConfig, path: set[str]) -> None:
        for step in ensemble.ensemble_steps:
            name = step.model_name
            if name in found or name in path:
                continue  # (a cycle is refused when the ensemble loads)
            composing = lookup(name)
            if composing is None:
                continue
            if composing.config is not None and composing.config.is_ensemble:
                visit(composing.config, path | {name})
            found.append(name)

    visit(config, {config.name})
    return found


def _reaches_decoupled(
    config: ModelConfig, lookup: Callable[[str], RepositoryModel | None], seen: set[str]
) -> bool:
    for step in config.ensemble_steps:
        composing = lookup(step.model_name)
        if composing is None or composing.config is None:
            continue  # (the ensemble's load reports it)
        if not composing.config.is_ensemble:
            if composing.config.decoupled:
                return True
        elif composing.name not in seen:  # (a cycle is refused when the ensemble loads)
            seen.add(composing.name)
            if _reaches_decoupled(composing.config, lookup, seen):
                return True
    return False


def available_versions(path: Path) -> tuple[int, ...]:
    """The version folders of a model directory, ascending."""
    try:
        entries = list(path.iterdir())
    except OSError as exc:
        raise InvalidConfig(f"cannot list the model directory: {exc.strerror}") from None
    return tuple(
        sorted(int(p.name) for p in entries if _VERSION_DIR.fullmatch(p.name) and p.is_dir())
    )


def config_source(path: Path, config_name: str = "") -> str:
    """Which configuration file of the model folder ``path`` is read, relative to it:
    ``configs/<config_name>.pbtxt`` where there is one (Triton's custom model
    configuration), else ``config.pbtxt`` (which need not exist)."""
    if config_name:
        if not CONFIG_NAME.fullmatch(config_name):
            raise InvalidConfig(f"invalid custom model configuration name '{config_name}'")
        custom = f"{CUSTOM_CONFIGS}/{config_name}.pbtxt"
        if (path / custom).is_file():
            return custom
    return CONFIG_FILENAME


def _load(
    path: Path, config_name: str, default_max_batch_size: int, name: str
) -> tuple[ModelConfig, tuple[int, ...]]:
    """The model in folder ``path``, read as model ``name`` (the folder's name, but for a
    copy served under an internal name)."""
    config = _read_config(path, config_source(path, config_name), name)
    available = available_versions(path)
    if not available:
        raise InvalidConfig("no version directory (expected numeric folders such as 1/)")
    policy = config.version_policy if config is not None else VersionPolicy()
    if policy.kind == "specific":
        missing = sorted(set(policy.versions) - set(available))
        if missing:
            listed = ", ".join(str(v) for v in missing)
            raise InvalidConfig(
                f"version_policy: specific version {listed} has no version directory"
            )
    versions = policy.select(available)
    if not versions:
        raise InvalidConfig("the version policy selects no available version")
    newest = path / str(versions[-1])
    if config is not None and config.is_ensemble:
        # An ensemble's version folder holds no model file (Triton's layout: an empty 1/);
        # its composing models are checked when it loads.
        check_repository_agents(config, path)
        return config, versions

    if config is None:
        if not (newest / ONNX_FILENAME).is_file():
            raise InvalidConfig(
                f"{CONFIG_FILENAME} is missing and the model cannot be auto-completed"
            )
        config = autocomplete_from_onnx(
            None,
            newest / ONNX_FILENAME,
            model_name=name,
            default_max_batch_size=default_max_batch_size,
        )
    elif not config.platform and not config.backend:
        config = _infer_platform(config, newest)
    python_file = newest / (config.default_model_filename or "model.py")
    if wants_python_autocomplete(config, python_file):
        config = autocomplete_python(config, python_file)
    if is_onnx(config.platform, config.backend) and not (config.inputs and config.outputs):
        model_file = newest / config.default_model_filename
        if not model_file.is_file():
            raise InvalidConfig(f"model file {_relative(path, model_file)} is missing")
        config = autocomplete_from_onnx(config, model_file, model_name=name)

    config = _fallback_model_file(config, path, versions)
    if config.default_model_filename:
        for version in versions:
            model_file = path / str(version) / config.default_model_filename
            if not model_file.exists():
                raise InvalidConfig(f"model file {_relative(path, model_file)} is missing")
    check_repository_agents(config, path)
    return config, versions


def _read_config(path: Path, source: str, name: str) -> ModelConfig | None:
    config_path = path / source
    if not config_path.exists():
        return None
    try:
        text = config_path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidConfig(f"{source}: cannot read the file: {exc}") from None
    return parse_config_text(text, model_name=name, source=source)


def _infer_platform(config: ModelConfig, version_dir: Path) -> ModelConfig:
    """Triton picks the platform from the model file when the config names none."""
    candidates = (
        [config.default_model_filename]
        if config.default_model_filename
        else [f"model{suffix}" for suffix in PLATFORM_BY_FILE_SUFFIX]
    )
    for filename in candidates:
        known = PLATFORM_BY_FILE_SUFFIX.get(Path(filename).suffix)
        if known is not None and (version_dir / filename).exists():
            msg = config_to_proto(config)
            msg.platform, msg.backend = known
            if not config.default_model_filename:
                msg.default_model_filename = filename
            return config_from_proto(msg, model_name=config.name)
    raise InvalidConfig(
        f"{CONFIG_FILENAME}: neither platform nor backend is set, and no known model file "
        f"({', '.join(candidates)}) was found to infer them from"
    )


def _fallback_model_file(config: ModelConfig, path: Path, versions: tuple[int, ...]) -> ModelConfig:
    """Use the platform's alternative file (model.pt2 for model.pt) when every version has it."""
    filename = config.default_model_filename
    fallback = fallback_model_filename(config.platform, config.backend, filename)
    if fallback is None or all((path / str(v) / filename).exists() for v in versions):
        return config
    if not all((path / str(v) / fallback).is_file() for v in versions):
        return config
    msg = config_to_proto(config)
    msg.default_model_filename = fallback
    return config_from_proto(msg, model_name=config.name)


def _relative(model_dir: Path, file: Path) -> str:
    return file.relative_to(model_dir.parent).as_posix()
