"""The one small mechanism behind every patch: data records, version gates, import hooks.

A :class:`Patch` is data: which distribution and module, which object, which versions
are affected, how to check that the code is the code we expect, how to apply (returning
an undo). The :class:`Registry` decides, applies lazily when the target module is first
imported (a post-import hook) or at once when it already is, records what happened for
:func:`patch_report`, and reverts to the exact original objects. Nothing here imports the
target libraries: versions come from package metadata.
"""

from __future__ import annotations

import importlib.metadata
import sys
import threading
import types
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import wrapt
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from leakfree._text import format_table
from leakfree._warnings import PatchWarning

__all__ = ["Patch", "PatchRecord", "PatchReport", "Registry", "installed_version"]

#: apply(target_object, module, option) -> undo
Apply = Callable[[Any, types.ModuleType, Any], Callable[[], None]]
#: check(target_object, module) -> None if it is the code we expect, else why not
#: ``check(target, module, option)``: None to apply, or why not.
Check = Callable[[Any, types.ModuleType, Any], "Skip | None"]


@dataclass(frozen=True)
class Skip:
    """Why a patch did not apply to the code it found."""

    #: "already fixed upstream", "not present in this version" (the class is there, the
    #: leak's pattern is not: nothing to repair) or "target not found" (a warning)
    status: str
    detail: str


@dataclass(frozen=True)
class Patch:
    """One repair, as data.

    ``modules`` maps version specifiers to the import path of the target in those versions
    (e.g. Transformer Engine moved attention into a package in 2.3); ``affected`` is the
    specifier of versions with the bug. ``option`` values other than True/False reach
    ``apply`` (e.g. ``"harden"``); ``widen`` maps such an option to a wider ``affected``.
    """

    name: str
    integration: str
    distributions: tuple[str, ...]
    modules: tuple[tuple[str, str], ...]
    target: str
    affected: str
    fixed_in: str
    check: Check
    apply: Apply
    description: str
    default: bool = True
    widen: tuple[tuple[Any, str], ...] = ()

    def module_for(self, version: Version) -> str | None:
        for spec, module in self.modules:
            if version_matches(version, spec):
                return module
        return None

    def options(self) -> tuple[Any, ...]:
        """The values ``patch_all`` accepts for this patch (see :meth:`Registry.select`)."""
        return (True, False, "always", *(option for option, _ in self.widen))


def version_matches(version: Version, spec: str) -> bool:
    """Is ``version`` in ``spec``, counting pre-releases and dev builds as what they are?

    Explicit about pre-releases, so the answer does not change with ``packaging``'s default
    (which moved between releases). And a pre-release or dev build of the first release
    outside an upper bound (``2.14.0.dev0`` against ``<2.14``, which PEP 440 excludes)
    matches: such a build may or may not carry the fix, so the code check decides.
    """
    specifiers = SpecifierSet(spec)
    if specifiers.contains(version, prereleases=True):
        return True
    if not (version.is_prerelease or version.is_devrelease):
        return False
    release = Version(version.base_version)
    return any(s.operator == "<" and Version(s.version) == release for s in specifiers) and all(
        s.operator == "<" or s.contains(release, prereleases=True) for s in specifiers
    )


@dataclass
class PatchRecord:
    """What happened to one patch (an entry of :func:`patch_report`)."""

    name: str
    integration: str
    target: str
    version: str | None
    status: str  # applied | pending import | skipped | reverted | disabled
    reason: str = ""
    undo: Callable[[], None] | None = field(default=None, repr=False, compare=False)
    option: Any = field(default=None, repr=False, compare=False)  #: what it was applied with

    @property
    def applied(self) -> bool:
        return self.status == "applied"


class PatchReport(list[PatchRecord]):
    """The records, printable as a table; ``report["trl.offload_activations"]`` by name."""

    def __getitem__(self, key: Any) -> Any:  # type: ignore[override]
        if isinstance(key, str):
            for record in self:
                if record.name == key:
                    return record
            raise KeyError(f"{key!r}: no such patch; known: {', '.join(r.name for r in self)}")
        return super().__getitem__(key)

    def __str__(self) -> str:
        return format_table(
            ("patch", "target", "version", "status", "reason"),
            [(r.name, r.target, r.version or "-", r.status, r.reason) for r in self],
        )


def installed_version(distributions: Iterable[str]) -> Version | None:
    """The installed version of the first distribution found (metadata only: no import)."""
    for dist in distributions:
        try:
            raw = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        try:
            return Version(raw)
        except InvalidVersion:
            continue
    return None


def _resolve(module: types.ModuleType, qualname: str) -> Any:
    obj: Any = module
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


class Registry:
    """The patches, their records, and the lock that serialises every change to them."""

    def __init__(self, patches: Iterable[Patch]) -> None:
        self.patches = {p.name: p for p in patches}
        self.records = {
            p.name: PatchRecord(p.name, p.integration, p.target, None, "not requested")
            for p in self.patches.values()
        }
        self._lock = threading.RLock()
        self._wanted: dict[str, Any] = {}  # patch name -> option, while a patch is requested
        self._hooked: set[str] = set()  # modules with a post-import hook registered
        self.strict = False

    # -- selection ------------------------------------------------------------------------

    def select(self, only: dict[str, Any]) -> dict[str, Any]:
        """``{patch name: option}`` for ``patch_all(**only)``; unknown keys raise first.

        A key is an integration (``trl=False``, ``trl="always"``) or a patch name with its
        first dot written as ``_`` (``transformer_engine_fused_attention=False``). ``True``
        keeps each patch's default; ``False`` disables; any other value is an option
        passed to the patch (and enables patches that are off by default).
        """
        integrations = {p.integration for p in self.patches.values()}
        by_key = {p.name.replace(".", "_", 1): p.name for p in self.patches.values()}
        unknown = [k for k in only if k not in integrations and k not in by_key]
        if unknown:
            raise TypeError(
                f"patch_all(): unknown integration or patch {', '.join(map(repr, unknown))}; "
                f"integrations: {', '.join(sorted(integrations))}; patches: "
                f"{', '.join(sorted(by_key))}"
            )
        for key, value in only.items():
            patches = [
                p
                for p in self.patches.values()
                if key == p.integration or by_key.get(key) == p.name
            ]
            accepted: list[Any] = []
            for p in patches:
                accepted.extend(o for o in p.options() if o not in accepted)
            # `in` would let 1 == True and 0 == False through: compare types as well.
            if not any(value is o or (type(value) is str and value == o) for o in accepted):
                raise ValueError(
                    f"patch_all({key}={value!r}): not an accepted value; {key} accepts "
                    f"{', '.join(map(repr, accepted))}"
                )
        chosen: dict[str, Any] = {}
        for patch in self.patches.values():
            option: Any = patch.default
            for key in (patch.integration, patch.name.replace(".", "_", 1)):
                if key in only:
                    value = only[key]
                    option = patch.default if value is True and key == patch.integration else value
            chosen[patch.name] = option
        return chosen

    # -- applying ---------------------------------------------------------------------------

    def request(self, chosen: dict[str, Any], strict: bool) -> None:
        with self._lock:
            self.strict = strict
            for name, option in chosen.items():
                record = self.records[name]
                if record.status == "applied":
                    if option == record.option:
                        continue  # idempotent
                    self._undo(record)  # asked for something else now: off, or harden...
                if option is False:
                    self._wanted.pop(name, None)
                    record.status, record.reason = "disabled", "disabled by the caller"
                    continue
                self._wanted[name] = option
                self._decide(self.patches[name], option)

    @staticmethod
    def _gate(patch: Patch, option: Any) -> tuple[Version | None, str | None, str]:
        """Installed version, where the target lives (None if the patch does not apply),
        and the reason it does not apply: "not installed", "not affected" or "no location".

        The one version and location decision, shared by ``request`` and ``plan``.
        """
        version = installed_version(patch.distributions)
        if version is None:
            return None, None, "not installed"
        affected = dict(patch.widen).get(option, patch.affected)
        if option != "always" and not version_matches(version, affected):
            return version, None, "not affected"
        module = patch.module_for(version)
        return version, module, "no location" if module is None else ""

    def _decide(self, patch: Patch, option: Any) -> None:
        record = self.records[patch.name]
        version, module_name, blocked = self._gate(patch, option)
        record.version = str(version) if version is not None else None
        if module_name is None:
            reason = {
                "not installed": "not installed",
                "not affected": f"version {version} not affected (fixed in {patch.fixed_in})",
                "no location": f"no known location of {patch.target} in {version}",
            }[blocked]
            self._skip(record, "skipped", reason)
            return
        module = sys.modules.get(module_name)
        if module is not None:
            self._apply(patch, module)
            return
        record.status, record.reason = "pending import", f"applies when {module_name} is imported"
        if module_name not in self._hooked:
            self._hooked.add(module_name)
            wrapt.register_post_import_hook(self._on_import, module_name)

    def _on_import(self, module: types.ModuleType) -> None:
        with self._lock:
            # wrapt drops a hook once it fired: a later re-import needs a new registration
            self._hooked.discard(module.__name__)
            for patch in self.patches.values():
                record = self.records[patch.name]
                if patch.name in self._wanted and record.status == "pending import":
                    version = installed_version(patch.distributions)
                    if version is not None and patch.module_for(version) == module.__name__:
                        self._apply(patch, module)

    def _apply(self, patch: Patch, module: types.ModuleType) -> None:
        record = self.records[patch.name]
        option = self._wanted.get(patch.name, True)
        try:
            target = _resolve(module, patch.target)
            skip = patch.check(target, module, option)
        except Exception as e:  # an odd module (lazy __getattr__, a check that trips): skip
            if self.strict and not isinstance(e, AttributeError):
                raise
            self._skip(
                record,
                "skipped",
                f"target not found: {module.__name__}.{patch.target} ({type(e).__name__})",
                warn=True,
            )
            return
        if skip is not None:
            # Good news, or nothing to do: not warnings. Only a target that cannot be read is.
            expected = skip.status in ("already fixed upstream", "not present in this version")
            self._skip(record, "skipped", f"{skip.status}: {skip.detail}", warn=not expected)
            return
        try:
            undo = patch.apply(target, module, option)
        except Exception as e:  # a guest never breaks the host
            if self.strict:
                raise
            self._skip(record, "skipped", f"apply failed: {type(e).__name__}: {e}", warn=True)
            return
        record.status, record.reason, record.undo = "applied", patch.description, undo
        record.option = option

    def _skip(self, record: PatchRecord, status: str, reason: str, *, warn: bool = False) -> None:
        record.status, record.reason, record.undo = status, reason, None
        self._wanted.pop(record.name, None)
        if warn:
            message = f"leakfree patch {record.name} skipped: {reason}"
            if self.strict:
                raise RuntimeError(message)
            warnings.warn(message, PatchWarning, stacklevel=4)

    # -- reverting ---------------------------------------------------------------------------

    def _undo(self, record: PatchRecord) -> None:
        undo, record.undo, record.option = record.undo, None, None
        record.status, record.reason = "reverted", "unpatch_all()"
        if undo is not None:
            undo()

    def revert_all(self) -> None:
        errors = []
        with self._lock:
            self._wanted.clear()  # pending hooks become no-ops
            for record in self.records.values():
                if record.status == "applied":
                    try:
                        self._undo(record)
                    except Exception as e:  # revert the others anyway
                        errors.append(f"{record.name}: {type(e).__name__}: {e}")
                elif record.status == "pending import":
                    record.status, record.reason = "reverted", "unpatch_all() before import"
        if errors:
            warnings.warn(
                "leakfree: could not revert " + "; ".join(errors), PatchWarning, stacklevel=3
            )

    def plan(self, chosen: dict[str, Any]) -> PatchReport:
        """What ``request(chosen)`` would do, without doing it (``python -m leakfree doctor``)."""
        out = PatchReport()
        for name, option in chosen.items():
            patch = self.patches[name]
            version, module, blocked = self._gate(patch, option)
            record = PatchRecord(
                name, patch.integration, patch.target, str(version) if version else None, ""
            )
            if option is False:
                record.status, record.reason = "off", "not requested (off by default or disabled)"
            elif blocked == "not installed":
                record.status, record.reason = "not installed", ""
            elif blocked:
                record.status = blocked
                record.reason = f"fixed in {patch.fixed_in}" if blocked == "not affected" else ""
            else:
                current = self.records[name].status
                record.status = "applied" if current == "applied" else "would apply"
                record.reason = f"{patch.description} ({module}.{patch.target})"
            out.append(record)
        return out

    def report(self) -> PatchReport:
        with self._lock:
            return PatchReport(
                PatchRecord(r.name, r.integration, r.target, r.version, r.status, r.reason)
                for r in self.records.values()
            )
