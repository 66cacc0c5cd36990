"""The one small mechanism behind every patch: records, version gates, import hooks, and
one table of originals.

A :class:`Patch` is data: which distribution and module, which object, which versions
are affected, how to check that the code is the code we expect, how to apply. A
:class:`SweepRecord` is the other kind of record: not one object but every module under a
package prefix (``patch_functions``). The one :class:`Registry` (``REGISTRY``) decides,
applies lazily when a target module is first imported (one mechanism for both kinds:
wrapt's post-import hooks) or at once when it already is, records what happened for
``patch_report()`` (an :class:`Outcome`, its :class:`Reason` and a detail in words), and
keeps the original of everything it changed in one table (``_originals.py``:
:func:`get_original`, :func:`is_object_patched`, as ``gevent.monkey`` does), from which
unpatching puts the exact original objects back. Nothing here imports the target
libraries: versions come from package metadata.
"""

from __future__ import annotations

import importlib.metadata
import sys
import threading
import types
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

import wrapt
import wrapt.importer
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from leakfree._text import format_table
from leakfree.errors import PatchError, PatchWarning
from leakfree.patches._originals import Changes, Originals, _check_owner

if TYPE_CHECKING:
    from leakfree.patches._originals import _Row


class _Words(str, Enum):
    """A ``str`` enum that prints, formats and serialises to JSON as its value."""

    def __str__(self) -> str:
        return str(self.value)


class Outcome(_Words):
    """What happened to a patch or a sweep (``patch_report()``), or, in a plan
    (``python -m leakfree doctor``), what ``patch_all()`` would do. One axis: *why* is the
    record's :class:`Reason`, beside it. A ``str``: ``record.outcome == "applied"``;
    printing and JSON give the value.
    """

    #: the repair is in place (in a plan: already in place)
    APPLIED = "applied"
    #: requested; applied when its target module is imported (the detail names it)
    PENDING = "pending import"
    #: in a plan only: ``patch_all()`` would apply it (now, or when the target is imported)
    WOULD_APPLY = "would apply"
    #: requested, not applied (in a plan: would not be); the reason says why
    SKIPPED = "skipped"
    #: not requested: no ``patch_all()`` yet, off by default, or turned off by the caller
    OFF = "off"
    #: was applied or pending, and put back on request (``unpatch_all()``,
    #: ``sweep.remove()``: the detail says which)
    REVERTED = "reverted"


class Reason(_Words):
    """Why a record has its :class:`Outcome` (``record.reason``); None where the outcome
    says it all (APPLIED, PENDING, WOULD_APPLY, REVERTED). The record's ``detail`` gives
    the specifics in words. Which reasons go with which outcome: :data:`PAIRS`.
    """

    # -- OFF ------------------------------------------------------------------------------
    #: no ``patch_all()`` has asked for it (yet)
    NOT_REQUESTED = "not requested"
    #: ``patch_all()`` leaves it off unless it is asked for by key (``Patch.default``)
    OFF_BY_DEFAULT = "off by default"
    #: a patch on by default, turned off by ``patch_all(<integration or patch>=False)``
    DISABLED_BY_CALLER = "disabled by the caller"
    # -- SKIPPED by the gates, from package metadata (nothing imported) --------------------
    #: no distribution of the target library is installed
    NOT_INSTALLED = "not installed"
    #: the installed version is outside the affected ones (the detail: fixed where, or why
    #: the repair is left out there)
    VERSION_NOT_AFFECTED = "version not affected"
    #: an affected version, but leakfree knows no module of the target in it
    NO_LOCATION = "no known location"
    # -- SKIPPED by the code check, after the import (a :class:`Skip`'s reason) -----------
    #: the code already carries the fix
    ALREADY_FIXED = "already fixed upstream"
    #: the target is there, the leak's pattern is not (nothing to repair)
    NOT_PRESENT = "not present in this version"
    #: the target cannot be read, or is not the code the patch expects (a warning)
    TARGET_NOT_FOUND = "target not found"
    # -- SKIPPED by applying ----------------------------------------------------------------
    #: the patch raised while applying; what it changed was put back (a warning)
    APPLY_FAILED = "apply failed"

    @property
    def warns(self) -> bool:
        """Is a skip for this reason a :class:`~leakfree.PatchWarning` (a
        :class:`~leakfree.PatchError` under ``strict=True``)? Only the two that mean
        "leakfree could not do what it meant to"; good news and "nothing to do" are not."""
        return self in (Reason.TARGET_NOT_FOUND, Reason.APPLY_FAILED)


#: Every (outcome, reason) pair a record may hold: in ``patch_report()``, in a plan and
#: after ``unpatch_all()``. A record refuses any other (:meth:`PatchRecord.mark`), so the
#: two axes cannot mix again.
PAIRS: frozenset[tuple[Outcome, Reason | None]] = frozenset(
    {
        (Outcome.APPLIED, None),
        (Outcome.PENDING, None),
        (Outcome.WOULD_APPLY, None),
        (Outcome.REVERTED, None),
        (Outcome.OFF, Reason.NOT_REQUESTED),
        (Outcome.OFF, Reason.OFF_BY_DEFAULT),
        (Outcome.OFF, Reason.DISABLED_BY_CALLER),
        (Outcome.SKIPPED, Reason.NOT_INSTALLED),
        (Outcome.SKIPPED, Reason.VERSION_NOT_AFFECTED),
        (Outcome.SKIPPED, Reason.NO_LOCATION),
        (Outcome.SKIPPED, Reason.ALREADY_FIXED),
        (Outcome.SKIPPED, Reason.NOT_PRESENT),
        (Outcome.SKIPPED, Reason.TARGET_NOT_FOUND),
        (Outcome.SKIPPED, Reason.APPLY_FAILED),
    }
)


def _named(value: object) -> str:
    """``Outcome.OFF`` for a member, the repr for anything else (in error messages)."""
    return f"{type(value).__name__}.{value.name}" if isinstance(value, Enum) else repr(value)


#: The reasons a code check gives (:class:`Skip`).
CHECK_REASONS = (Reason.ALREADY_FIXED, Reason.NOT_PRESENT, Reason.TARGET_NOT_FOUND)


#: ``apply(target, module, option, changes)``: make the repair through ``changes`` (which
#: writes every original into the table); may return an undo for what the table cannot
#: know (TRL: modules imported later that copied a replacement), run after the table's.
Apply = Callable[[Any, types.ModuleType, Any, "Changes"], "Callable[[], None] | None"]
#: ``check(target, module, option)``: None to apply, :class:`Applies` to apply saying why
#: (a patch with more than one reason to apply), or :class:`Skip`: why not.
Check = Callable[[Any, types.ModuleType, Any], "Skip | Applies | None"]


@dataclass(frozen=True)
class Skip:
    """Why a patch did not apply to the code it found: a ``reason`` of
    :data:`CHECK_REASONS` (ALREADY_FIXED, NOT_PRESENT: nothing to repair, neither is a
    warning; TARGET_NOT_FOUND: a warning) and the ``detail`` in words."""

    reason: Reason
    detail: str

    def __post_init__(self) -> None:
        if not (isinstance(self.reason, Reason) and self.reason in CHECK_REASONS):
            raise ValueError(
                f"Skip(reason={_named(self.reason)}): a code check skips for one of "
                f"{', '.join(f'Reason.{r.name}' for r in CHECK_REASONS)}; the version and "
                "location gates and the registry give the other reasons"
            )


@dataclass(frozen=True)
class Applies:
    """Why a patch applies to the code it found, for the report (after its description)."""

    detail: str


@dataclass(frozen=True)
class FailureMode:
    """One known way an integration's own code goes wrong, in ``versions`` (a specifier;
    empty: every version), on machines with or without an accelerator (``accelerator``:
    True, False, or None for both). ``python -m leakfree doctor`` lists the ones that fit
    the installed version and this machine, with the call that repairs each."""

    name: str
    versions: str
    accelerator: bool | None
    what: str
    #: accelerator types it spares: on a machine with an accelerator, listed only where
    #: the type is known and not one of them
    spares: tuple[str, ...] = ()

    def applies(self, version: Version, has_accelerator: bool, device_type: str | None) -> bool:
        """Does this mode hit ``version`` on a machine with (or without) an accelerator
        of type ``device_type``?"""
        if not version_matches(version, self.versions or ">=0"):
            return False
        if self.accelerator not in (None, has_accelerator):
            return False
        spared = device_type is None or device_type in self.spares
        return not (self.spares and has_accelerator and spared)


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
    #: ``expect(version, option)``: what ``check`` will say on this machine, decided
    #: without importing the target (``plan``, the doctor), for a patch whose check
    #: depends on more than the code (TRL: whether an accelerator is there)
    expect: Callable[[Version, Any], Skip | Applies | None] | None = None
    #: why a version outside ``affected`` is left alone, when it is not "fixed in
    #: ``fixed_in``" (a repair built and measured on some releases only)
    outside: str = ""

    def why_outside(self) -> str:
        return self.outside or f"fixed in {self.fixed_in}"

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
    """What happened to one patch (an entry of :func:`patch_report`): its ``outcome``,
    the ``reason`` for it (None where the outcome says it all) and the ``detail`` in words
    (what it repairs, which module it waits for, what the code check found). The pair
    (outcome, reason) is always one of :data:`PAIRS`."""

    name: str
    integration: str
    target: str
    version: str | None
    outcome: Outcome
    reason: Reason | None = None
    detail: str = ""
    #: what to undo beyond the table of originals (see :data:`Apply`)
    undo: Callable[[], None] | None = field(default=None, repr=False, compare=False)
    option: Any = field(default=None, repr=False, compare=False)  #: what it was applied with
    #: requested with strict=True: a failure raises PatchError (for this record only)
    strict: bool = field(default=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._check(self.outcome, self.reason)

    def _check(self, outcome: Outcome, reason: Reason | None) -> None:
        if (outcome, reason) not in PAIRS:
            raise ValueError(
                f"PatchRecord({self.name!r}): outcome={_named(outcome)} with "
                f"reason={_named(reason)} is not one of leakfree.patches._registry.PAIRS; "
                "give the outcome a reason listed for it there (or add the pair there, with "
                "its meaning)"
            )

    def mark(self, outcome: Outcome, reason: Reason | None = None, detail: str = "") -> None:
        """Set the outcome, its reason and the detail together (a pair of :data:`PAIRS`)."""
        self._check(outcome, reason)
        self.outcome, self.reason, self.detail = outcome, reason, detail

    @property
    def applied(self) -> bool:
        return self.outcome is Outcome.APPLIED


class SweepRecord(PatchRecord):
    """The second kind of record: every module under ``prefix``, not one named object.

    The registry applies it to what is already imported when it is added, then to each
    module under ``prefix`` right after that module is imported (the same post-import hooks
    as a :class:`Patch`), until it is removed. A subclass says what applying to a module
    means (:meth:`apply`); its changes go into the table like a patch's. Compared by
    identity: two sweeps of one prefix are two records.
    """

    #: what the sweep patches, for the report's target column ("3 Function classes")
    unit = "objects"

    def __init__(self, prefix: str, description: str) -> None:
        super().__init__(
            f"sweep.{prefix}", "sweep", f"0 {self.unit}", None, Outcome.OFF, Reason.NOT_REQUESTED
        )
        self.prefix = prefix
        self.description = description  #: the detail while it is applied

    def covers(self, module_name: str) -> bool:
        return module_name == self.prefix or module_name.startswith(self.prefix + ".")

    def apply(self, module_names: set[str] | None, changes: Changes) -> None:
        """Patch what is defined in ``module_names`` (None: every module it covers),
        through ``changes``. Runs under the registry's lock."""
        raise NotImplementedError

    def __eq__(self, other: object) -> bool:
        return self is other

    def __hash__(self) -> int:
        return id(self)


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
            ("patch", "target", "version", "outcome", "reason", "detail"),
            [
                (r.name, r.target, r.version or "-", str(r.outcome), str(r.reason or "-"), r.detail)
                for r in self
            ],
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


# --- post-import hooks for a prefix -----------------------------------------------------------
#
# wrapt's hooks are keyed by exact module names: its finder asks "is this name in my table
# of hooks?" before it wraps a loader, so "every module under mylib, imported later" (names
# nobody knows in advance) cannot be registered with it. This finder adds only that: when
# the import system looks for a module under a watched prefix, it registers a wrapt hook for
# that exact name and answers "not mine". wrapt's finder, next in sys.meta_path, then
# wraps the loader and calls the registry right after the module executes, as it does for a
# patch's named module. It finds and loads nothing itself, so patches and sweeps share one
# hook mechanism. A reload (find_spec with a target) is not watched: wrapt's hooks do not
# cope with reloads either.


class _SweptAfter(wrapt.ObjectProxy):  # type: ignore[misc, type-arg]
    """A loader that runs the module, then hands it to ``after`` (a re-sweep)."""

    def __init__(self, loader: Any, after: Callable[[types.ModuleType], None]) -> None:
        super().__init__(loader)
        self._self_after = after

    def exec_module(self, module: types.ModuleType) -> None:
        self.__wrapped__.exec_module(module)
        self._self_after(module)


class _PrefixWatch:
    def __init__(self, registry: Registry) -> None:
        self._registry = registry
        self.prefixes: tuple[str, ...] = ()  # replaced whole, read without the lock

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if not any(fullname == p or fullname.startswith(p + ".") for p in self.prefixes):
            return None
        if target is None:
            if fullname not in sys.modules:
                self._registry._hook(fullname)
            return None
        # importlib.reload(module): the module runs again and defines new classes, but a
        # post-import hook fires once only. Find the real spec and sweep after it runs.
        for finder in sys.meta_path:
            if finder is self or isinstance(finder, wrapt.importer.ImportHookFinder):
                continue
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _SweptAfter(spec.loader, self._registry._on_reload)
                return spec
        return None

    def install(self) -> None:
        if self in sys.meta_path:
            return
        # wrapt puts its finder at sys.meta_path[0] on its first registration: make sure
        # it is there (a hook on a module already imported runs at once), then go just
        # before it, so that the hook exists by the time wrapt's finder looks.
        wrapt.register_post_import_hook(_nothing, __name__)
        index = next(
            (
                i
                for i, finder in enumerate(sys.meta_path)
                if isinstance(finder, wrapt.importer.ImportHookFinder)
            ),
            0,
        )
        sys.meta_path.insert(index, self)  # type: ignore[arg-type]

    def uninstall(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)  # type: ignore[arg-type]


def _nothing(module: types.ModuleType) -> None:
    pass


class Registry:
    """The records (patches and sweeps), the table of originals (``originals``, an
    :class:`~leakfree.patches._originals.Originals`), and the one lock that serialises
    every change to them.

    Kept, until reverted: each applied record's changes in the table (owner, name,
    original: the owners and originals stay alive), the active sweeps, and a wrapt
    post-import hook per module that a pending patch or an active sweep waits for.
    """

    def __init__(self, patches: Iterable[Patch] = ()) -> None:
        self.patches: dict[str, Patch] = {}
        self.records: dict[str, PatchRecord] = {}
        self.sweeps: list[SweepRecord] = []  # active ones, in the order they were added
        self._lock = threading.RLock()
        self._wanted: dict[str, Any] = {}  # patch name -> option, while a patch is requested
        self._hooked: set[str] = set()  # modules with a post-import hook registered
        self.originals = Originals()  # what was changed, and what was there before
        self._watch = _PrefixWatch(self)
        self.add(patches)

    def add(self, patches: Iterable[Patch]) -> None:
        with self._lock:
            for p in patches:
                self.patches[p.name] = p
                self.records[p.name] = PatchRecord(
                    p.name, p.integration, p.target, None, Outcome.OFF, Reason.NOT_REQUESTED
                )

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

    def is_strict(self, integration: str) -> bool:
        """Was any patch of ``integration`` requested with ``strict=True``? (The run-time
        guards of a patch, which have no record at hand, raise then.)"""
        return any(r.strict for r in self.records.values() if r.integration == integration)

    def request(self, chosen: dict[str, Any], strict: bool) -> None:
        """Apply (or wait to apply) the ``chosen`` patches. ``strict`` belongs to this
        request: the records it names raise :class:`~leakfree.PatchError` when they cannot
        be applied, now or when their module is imported later; other records keep theirs."""
        with self._lock:
            for name, option in chosen.items():
                record = self.records[name]
                record.strict = strict
                if record.outcome is Outcome.APPLIED:
                    if option == record.option:
                        continue  # idempotent
                    self._undo(record)  # asked for something else now: off, or harden...
                if option is False:
                    self._wanted.pop(name, None)
                    record.mark(Outcome.OFF, self._off(self.patches[name]))
                    continue
                self._wanted[name] = option
                self._decide(self.patches[name], option)

    @staticmethod
    def _off(patch: Patch) -> Reason:
        """Why ``select`` gave ``patch`` the option False: the caller turned off a patch
        that is on by default, or it is off by default and nobody asked for it."""
        return Reason.DISABLED_BY_CALLER if patch.default else Reason.OFF_BY_DEFAULT

    @staticmethod
    def _gate(
        patch: Patch, option: Any
    ) -> tuple[Version | None, str | None, tuple[Reason, str] | None]:
        """Installed version, where the target lives (None if the patch does not apply),
        and why it does not apply: NOT_INSTALLED, VERSION_NOT_AFFECTED or NO_LOCATION, with
        the detail.

        The one version and location decision, shared by ``request`` and ``plan``.
        """
        version = installed_version(patch.distributions)
        if version is None:
            return None, None, (Reason.NOT_INSTALLED, "")
        affected = dict(patch.widen).get(option, patch.affected)
        if option != "always" and not version_matches(version, affected):
            return version, None, (Reason.VERSION_NOT_AFFECTED, patch.why_outside())
        module = patch.module_for(version)
        if module is None:
            known = "; ".join(spec or "any" for spec, _ in patch.modules)
            where = f"leakfree knows where {patch.target} is in versions {known} only"
            return version, None, (Reason.NO_LOCATION, where)
        return version, module, None

    def _decide(self, patch: Patch, option: Any) -> None:
        record = self.records[patch.name]
        version, module_name, blocked = self._gate(patch, option)
        record.version = str(version) if version is not None else None
        if blocked is not None or module_name is None:
            self._skip(record, *(blocked or (Reason.NO_LOCATION, "")))
            return
        module = sys.modules.get(module_name)
        if module is not None:
            self._apply(patch, module)
            return
        record.mark(Outcome.PENDING, None, f"applies when {module_name} is imported")
        self._hook(module_name)

    def _hook(self, module_name: str) -> None:
        """One wrapt post-import hook for ``module_name`` (runs at once if it is imported)."""
        if module_name not in self._hooked:
            self._hooked.add(module_name)
            wrapt.register_post_import_hook(self._on_import, module_name)

    def _on_import(self, module: types.ModuleType) -> None:
        with self._lock:
            # wrapt drops a hook once it fired: a later re-import needs a new registration
            self._hooked.discard(module.__name__)
            for patch in self.patches.values():
                record = self.records[patch.name]
                if patch.name in self._wanted and record.outcome is Outcome.PENDING:
                    version = installed_version(patch.distributions)
                    if version is not None and patch.module_for(version) == module.__name__:
                        self._apply(patch, module)
            for sweep in self.sweeps:  # after the patches: a patched class is not swept
                if sweep.covers(module.__name__):
                    self._sweep(sweep, {module.__name__})

    def _on_reload(self, module: types.ModuleType) -> None:
        """A covered module ran again (``importlib.reload``): sweep its new classes."""
        with self._lock:
            for sweep in self.sweeps:
                if sweep.covers(module.__name__):
                    self._sweep(sweep, {module.__name__})

    def _apply(self, patch: Patch, module: types.ModuleType) -> None:
        record = self.records[patch.name]
        option = self._wanted.get(patch.name, True)
        try:
            target = _resolve(module, patch.target)
            skip = patch.check(target, module, option)
        except Exception as e:  # an odd module (lazy __getattr__, a check that trips): skip
            if record.strict and not isinstance(e, AttributeError):
                raise PatchError(
                    record.name, f"checking {module.__name__}.{patch.target} raised {e!r}"
                ) from e
            where = f"{module.__name__}.{patch.target} ({type(e).__name__})"
            self._skip(record, Reason.TARGET_NOT_FOUND, where)
            return
        why = skip.detail if isinstance(skip, Applies) else None
        if isinstance(skip, Skip):
            # Good news, or nothing to do: not warnings. Only a target that cannot be read is.
            self._skip(record, skip.reason, skip.detail)
            return
        try:
            undo = patch.apply(target, module, option, Changes(self.originals, record))
        except Exception as e:  # a guest never breaks the host
            self._restore(record)  # what it changed before it failed
            if record.strict:
                raise PatchError(record.name, f"applying it raised {e!r}") from e
            self._skip(record, Reason.APPLY_FAILED, f"{type(e).__name__}: {e}")
            return
        detail = patch.description if why is None else f"{patch.description}: {why}"
        record.mark(Outcome.APPLIED, None, detail)
        record.undo, record.option = undo, option

    def _skip(self, record: PatchRecord, reason: Reason, detail: str) -> None:
        """``record`` is SKIPPED for ``reason``; a reason that :attr:`~Reason.warns` warns
        (raises :class:`~leakfree.PatchError` for a strict record)."""
        record.mark(Outcome.SKIPPED, reason, detail)
        record.undo = None
        self._wanted.pop(record.name, None)
        if reason.warns:
            why = f"{reason}: {detail}" if detail else str(reason)
            if record.strict:
                raise PatchError(record.name, why)
            message = f"leakfree patch {record.name} skipped: {why}"
            warnings.warn(message, PatchWarning, stacklevel=4)

    # -- sweeps ------------------------------------------------------------------------------

    def add_sweep(self, sweep: SweepRecord) -> None:
        """Apply ``sweep`` to what is imported now, and to each module under its prefix
        imported later, until :meth:`remove_sweep`."""
        with self._lock:
            if sweep in self.sweeps:
                return
            self.sweeps.append(sweep)
            sweep.mark(Outcome.APPLIED, None, sweep.description)
            self._watch.prefixes = tuple(s.prefix for s in self.sweeps)
            self._watch.install()
            self._sweep(sweep, None)

    def apply_sweep(self, sweep: SweepRecord, module_names: Iterable[str] | None) -> None:
        """Sweep again (new classes of a factory); nothing for a removed sweep."""
        with self._lock:
            if sweep in self.sweeps:
                self._sweep(sweep, None if module_names is None else set(module_names))

    def _sweep(self, sweep: SweepRecord, module_names: set[str] | None) -> None:
        sweep.apply(module_names, Changes(self.originals, sweep))
        self._count(sweep)

    def _count(self, sweep: SweepRecord) -> None:
        """The sweep's target column: what it holds now (a patch may have taken a class)."""
        sweep.target = f"{len(self.rows_of(sweep))} {sweep.unit}"

    def remove_sweep(self, sweep: SweepRecord, by: str = "sweep.remove()") -> None:
        """Put back what ``sweep`` changed and stop sweeping modules imported later; ``by``
        names the call, for the record's detail."""
        with self._lock:
            try:
                self._restore(sweep)
            finally:
                self._count(sweep)
                if sweep in self.sweeps:
                    self.sweeps.remove(sweep)
                    sweep.mark(Outcome.REVERTED, None, by)
                self._watch.prefixes = tuple(s.prefix for s in self.sweeps)
                if not self.sweeps:
                    self._watch.uninstall()

    def remove_sweeps(self) -> int:
        with self._lock:
            sweeps = list(self.sweeps)
            for sweep in sweeps:
                self.remove_sweep(sweep)
        return len(sweeps)

    # -- the table of originals (kept by self.originals; its updates under the lock) ------
    # An apply writes into it through Changes(self.originals, record), under the lock.

    def rows_of(self, holder: PatchRecord) -> list[_Row]:
        """The changes ``holder`` made and has not put back, in the order it made them."""
        with self._lock:
            return self.originals.rows_of(holder)

    def _restore(self, holder: PatchRecord) -> None:
        """Put back every change of ``holder``, from the table; each row goes."""
        with self._lock:
            self.originals.restore(holder)

    def get_original(self, owner: Any, name: str) -> Any:
        _check_owner("get_original", owner, name)
        with self._lock:
            return self.originals.get_original(owner, name)

    def is_patched(self, owner: Any, name: str) -> bool:
        _check_owner("is_object_patched", owner, name)
        with self._lock:
            return self.originals.is_patched(owner, name)

    # -- reverting ---------------------------------------------------------------------------

    def _undo(self, record: PatchRecord) -> None:
        undo, record.undo, record.option = record.undo, None, None
        record.mark(Outcome.REVERTED, None, "unpatch_all()")
        self._restore(record)
        if undo is not None:
            undo()

    def revert_all(self) -> None:
        """Revert every applied patch and remove every sweep (``unpatch_all``)."""
        errors = []
        with self._lock:
            self._wanted.clear()  # pending hooks become no-ops
            for record in self.records.values():
                if record.outcome is Outcome.APPLIED:
                    try:
                        self._undo(record)
                    except Exception as e:  # revert the others anyway
                        errors.append(f"{record.name}: {type(e).__name__}: {e}")
                elif record.outcome is Outcome.PENDING:
                    record.mark(Outcome.REVERTED, None, "unpatch_all() before import")
            for sweep in list(self.sweeps):
                try:
                    self.remove_sweep(sweep, by="unpatch_all()")
                except Exception as e:
                    errors.append(f"{sweep.name}: {type(e).__name__}: {e}")
        if errors:
            warnings.warn(
                "leakfree: could not revert " + "; ".join(errors), PatchWarning, stacklevel=3
            )

    # -- reporting ---------------------------------------------------------------------------

    def plan(self, chosen: dict[str, Any]) -> PatchReport:
        """What ``request(chosen)`` would do, without doing it (``python -m leakfree doctor``):
        WOULD_APPLY (or APPLIED where it already is), OFF or SKIPPED, with the reason
        ``request`` would give."""
        out = PatchReport()
        for name, option in chosen.items():
            patch = self.patches[name]
            version, module, blocked = self._gate(patch, option)
            record = PatchRecord(
                name,
                patch.integration,
                patch.target,
                str(version) if version else None,
                Outcome.WOULD_APPLY,
            )
            out.append(record)
            if option is False:
                record.mark(Outcome.OFF, self._off(patch))
                continue
            if blocked is not None or module is None:
                record.mark(Outcome.SKIPPED, *(blocked or (Reason.NO_LOCATION, "")))
                continue
            current = self.records[name].outcome
            expected = (
                None if patch.expect is None or version is None else patch.expect(version, option)
            )
            if isinstance(expected, Skip) and current is not Outcome.APPLIED:
                record.mark(Outcome.SKIPPED, expected.reason, expected.detail)
                continue
            why = f": {expected.detail}" if isinstance(expected, Applies) else ""
            record.mark(
                Outcome.APPLIED if current is Outcome.APPLIED else Outcome.WOULD_APPLY,
                None,
                f"{patch.description}{why} ({module}.{patch.target})",
            )
        return out

    def report(self) -> PatchReport:
        """Copies of the records: the patches, then the active sweeps."""
        with self._lock:
            for sweep in self.sweeps:
                self._count(sweep)
            return PatchReport(
                PatchRecord(
                    r.name, r.integration, r.target, r.version, r.outcome, r.reason, r.detail
                )
                for r in (*self.records.values(), *self.sweeps)
            )


#: The one registry: the integrations add their patches to it (``leakfree.patches``).
REGISTRY = Registry()


def get_original(owner: Any, name: str) -> Any:
    """What ``owner.name`` was before leakfree changed it (``gevent.monkey.get_original``).

    ``owner`` is a module or a class. The answer is the object as the owner stored it:
    for a class, its raw ``__dict__`` entry (the ``staticmethod`` object of a
    ``backward``), looked up along the MRO; for a class that inherited the attribute
    before leakfree gave it its own, the inherited original. If leakfree did not change
    it (or has put it back), the current entry. Kept by the registry until the change is
    put back (``unpatch_all()``, ``sweep.remove()``, a patch turned off).
    """
    return REGISTRY.get_original(owner, name)


def is_object_patched(owner: Any, name: str) -> bool:
    """Did leakfree (a patch or a sweep) change ``owner.name`` and not put it back yet?

    ``owner`` is a module or a class; only its own attribute counts (a subclass that a
    sweep patched has its own entry). ``gevent.monkey.is_object_patched``, by object.
    """
    return REGISTRY.is_patched(owner, name)
