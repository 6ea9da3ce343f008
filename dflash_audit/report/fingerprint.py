"""Fingerprints the training gate compares: candidate, reference identity, report.

All are sha256 hex digests of canonical JSON (sorted keys, no whitespace), so they are stable
across machines and runs:

* candidate fingerprint = sha256({"files": {name: sha256(bytes)}, "profile": profile fp}),
  over the source files that define the candidate (see :func:`candidate_source_files`; the
  candidate's process reports them) and the files its spec names, located without running
  code (:func:`spec_source_files`; :func:`audited_fingerprint` joins both);
* reference key = the machine-independent part of a reference identity (kind, url, ref, commit,
  sdist sha256, version: no paths, no times);
* verifier fingerprint = sha256 of a verifier config's architecture for a DFlash drafter
  (:func:`verifier_architecture`: width-independent, so the proxy an audit builds from a
  user's config.json covers that real verifier);
* report fingerprint = sha256({"verdict", "reference": reference key, "candidate": candidate
  fp, "profile": profile fp, "verifiers": sorted verifier fps covered by the audit, "canary":
  the canary entry (its case, tolerance and the sha256 of every canary file)});
* report signature = HMAC-SHA256 over the whole canonical ``report.json`` (everything but the
  ``signature`` field), keyed by a secret of this machine (:func:`report_key`,
  ``<cache>/keys/report.key``, mode 0600, created on first use). The candidate's sandbox
  hides that folder and every key folder an audit of this user used with another cache
  (:func:`key_dirs`), so a candidate cannot sign a report; a fingerprint alone (an unkeyed hash
  of public fields) anyone can recompute. Same-user code outside the sandbox can read the key:
  the signature proves "written by dflash-audit on this machine", not more.

A gate that wants to train candidate C under profile P against reference R recomputes
C's fingerprint for P and accepts a ``report.json`` whose verdict is ``pass``, whose
``candidate.fingerprint`` and ``profile.fingerprint`` match, and whose ``fingerprint``
equals :func:`report_fingerprint` of those values (a hand-edited verdict then fails).
"""

from __future__ import annotations

import hashlib
import hmac
import inspect
import json
import os
import sys
from pathlib import Path
from typing import Any

import dflash_audit

PACKAGE_ROOT = Path(dflash_audit.__file__).resolve().parent
#: Files of dflash_audit that define our drafter's behaviour; included whenever a candidate
#: builds on it (the default candidate, or a subclass of DrafterCandidate).
DRAFTER_SOURCES = ("candidate.py", "model/*.py")
REFERENCE_KEY_FIELDS = ("kind", "url", "ref", "commit", "sdist_sha256", "version")


def canonical_sha256(value: Any) -> str:
    """sha256 hex of ``json.dumps(value, sort_keys=True, separators=(",", ":"))``."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def file_sha256(path: Path) -> str:
    """sha256 hex of a file's bytes."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _display_name(path: Path) -> str:
    """``dflash_audit/<rel>`` for our own files, else the file name (machine independent)."""
    try:
        return "dflash_audit/" + path.relative_to(PACKAGE_ROOT).as_posix()
    except ValueError:
        return path.name


def candidate_source_files(candidate: Any) -> list[Path]:
    """The source files that define ``candidate``'s behaviour.

    The files of every class in ``type(candidate).__mro__`` (and of the module that holds a
    factory function, when the candidate came from one), plus, when any of them is part of
    dflash_audit, the drafter's own sources (:data:`DRAFTER_SOURCES`). Built-in classes and
    classes without a source file are skipped.
    """
    files: set[Path] = set()
    for cls in type(candidate).__mro__:
        if cls is object or cls.__module__ in ("builtins", "typing"):
            continue
        module = sys.modules.get(cls.__module__)
        try:
            src = inspect.getsourcefile(cls) or (module and inspect.getsourcefile(module))
        except (TypeError, OSError):
            src = None
        if src:
            files.add(Path(src).resolve())
    if any(f.is_relative_to(PACKAGE_ROOT) for f in files):
        for pattern in DRAFTER_SOURCES:
            files.update(p.resolve() for p in PACKAGE_ROOT.glob(pattern))
    return sorted(f for f in files if f.is_file())


def candidate_fingerprint(candidate: Any, profile_fingerprint: str, spec: str | None = None
                          ) -> dict[str, Any]:
    """``{"fingerprint": sha256, "files": {name: sha256}}`` for a loaded candidate under a
    profile: :func:`audited_fingerprint` of its source files and of its ``spec``'s own files
    (None: ours, nothing added), as compare and train compute it."""
    return audited_fingerprint(candidate_source_files(candidate), spec, profile_fingerprint)


def spec_source_files(spec: str | None, search_path: list[str] | None = None) -> list[Path]:
    """The files a candidate spec names, located WITHOUT executing any code (so they are
    known from a process where no candidate code ran): ``path/file.py:attr`` -> that file
    (relative to the working folder); ``pkg.mod:attr`` -> each package's ``__init__.py`` and
    the module's file, found with :meth:`importlib.machinery.PathFinder.find_spec` component
    by component over ``search_path`` (default: the working folder, then ``sys.path``: what
    the candidate's process searches), which reads directories but imports nothing; None (our
    drafter) -> none. A part that cannot be located so (a namespace package, a zip, a missing
    module) ends the walk: the files found up to there are returned."""
    from importlib.machinery import PathFinder

    target = (spec or "").rpartition(":")[0]
    if not target:
        return []
    if target.endswith(".py"):
        file = Path(target).resolve()
        return [file] if file.is_file() else []
    found: list[Path] = []
    where: list[str] | None = list(dict.fromkeys(search_path if search_path is not None else
                                                 [os.getcwd(), *sys.path]))
    parts = target.split(".")
    for i in range(len(parts)):
        if where is None or not all(parts[: i + 1]):
            break
        try:
            module_spec = PathFinder.find_spec(".".join(parts[: i + 1]), where)
        except (ImportError, ValueError, OSError):
            break
        if module_spec is None:
            break
        if module_spec.origin and Path(module_spec.origin).is_file():
            found.append(Path(module_spec.origin).resolve())
        locations = module_spec.submodule_search_locations
        where = list(locations) if locations is not None else None
    return found


def audited_fingerprint(source_files: list[str] | list[Path], spec: str | None,
                        profile_fingerprint: str, search_path: list[str] | None = None
                        ) -> dict[str, Any]:
    """The candidate fingerprint compare records and train recomputes: :func:`files_fingerprint`
    of ``source_files`` (what the candidate's own process reports: untrusted) together with
    :func:`spec_source_files` of ``spec`` (located here, without running code), so a
    candidate that lies about its source files still hashes its own file and cannot borrow
    another candidate's report."""
    return files_fingerprint([*source_files, *spec_source_files(spec, search_path)],
                             profile_fingerprint)


def files_fingerprint(source_files: list[str] | list[Path], profile_fingerprint: str
                      ) -> dict[str, Any]:
    """:func:`candidate_fingerprint` from the candidate's source file paths (as the candidate
    process reports them in its identity, so the candidate is never imported here)."""
    paths = [p for p in sorted({Path(f).resolve() for f in source_files}) if p.is_file()]
    names = [_display_name(p) for p in paths]
    for i, p in enumerate(paths):  # a framework's losses/utils.py beside its dflash/utils.py
        depth = 2
        while names.count(names[i]) > 1 and depth <= len(p.parts):
            names = [("/".join(q.parts[-depth:]) if n == names[i] else n)
                     for q, n in zip(paths, names)]
            depth += 1
    files = {n: file_sha256(p) for n, p in zip(names, paths)}
    return {"fingerprint": canonical_sha256({"files": files, "profile": profile_fingerprint}),
            "files": files}


def reference_key(identity: dict[str, Any]) -> dict[str, Any]:
    """The machine-independent fields of a reference identity dict (see module docstring)."""
    return {k: identity.get(k) for k in REFERENCE_KEY_FIELDS}


#: Verifier config fields that shape a DFlash drafter's behaviour (none depends on the width).
VERIFIER_ARCH_FIELDS = ("model_type", "num_hidden_layers", "layer_types", "rms_norm_eps",
                        "hidden_act", "hidden_activation", "tie_word_embeddings",
                        "sliding_window", "attention_bias")


#: RoPE fields sized by the head width, which a proxy rescales (mrope sections, longrope's
#: per-frequency factors): left out of the architecture.
WIDTH_ROPE_KEYS = ("mrope_section", "short_factor", "long_factor")


def verifier_architecture(config: Any) -> dict[str, Any]:
    """The architecture of a verifier (text) config for a DFlash drafter: model type, depth,
    layer types, eps, activation, tied embeddings, sliding window, RoPE parameters (without
    :data:`WIDTH_ROPE_KEYS`, which a proxy rescales to its width; ``type`` read as
    ``rope_type``) and whether head_dim is
    independent of hidden_size / heads. A transformers config or a namespace of its fields."""
    from types import SimpleNamespace

    vc = getattr(config, "text_config", None) or config
    if isinstance(vc, dict):
        vc = SimpleNamespace(**vc)
    rope = json.loads(json.dumps(getattr(vc, "rope_parameters", None) or {}, default=str))
    for entry in [rope, *(v for v in rope.values() if isinstance(v, dict))]:
        for key in WIDTH_ROPE_KEYS:
            entry.pop(key, None)
        if "type" in entry:  # the legacy alias of rope_type
            entry.setdefault("rope_type", entry.pop("type"))
    head_dim, heads = getattr(vc, "head_dim", None), getattr(vc, "num_attention_heads", None)
    arch = {k: getattr(vc, k, None) for k in VERIFIER_ARCH_FIELDS}
    arch["layer_types"] = list(arch["layer_types"] or [])
    arch["rope_parameters"] = rope
    arch["head_dim_independent"] = bool(head_dim and heads and int(head_dim) * int(heads)
                                        != int(vc.hidden_size))
    return arch


def verifier_fingerprint(config: Any) -> str:
    """sha256 of :func:`verifier_architecture`."""
    return canonical_sha256(verifier_architecture(config))


def report_fingerprint(verdict: str, reference_identity: dict[str, Any],
                       candidate_fp: str, profile_fp: str,
                       verifiers: list[str] | None = None,
                       canary: dict[str, Any] | None = None) -> str:
    """sha256 of verdict + reference key + candidate fingerprint + profile fingerprint (+ the
    sorted fingerprints of the verifiers the audit covered, when given) + the canary entry
    (``report.json``'s ``candidate.canary``; None when the report has none)."""
    payload = {"verdict": verdict, "reference": reference_key(reference_identity),
               "candidate": candidate_fp, "profile": profile_fp, "canary": canary}
    if verifiers is not None:
        payload["verifiers"] = sorted(verifiers)
    return canonical_sha256(payload)


# ------------------------------------------------------------------------------ signature
KEY_FILE = "report.key"
SIGNATURE_FIELD = "signature"
SIGNATURE_ALG = "hmac-sha256"


#: Size of the report key (HMAC-SHA256 key).
KEY_BYTES = 32


def key_dir() -> Path:
    """``$DFLASH_AUDIT_CACHE/keys`` (default ``~/.cache/dflash-audit/keys``): the folder of
    the report key, hidden from the candidate's sandbox."""
    base = os.environ.get("DFLASH_AUDIT_CACHE") or Path.home() / ".cache" / "dflash-audit"
    return Path(base).expanduser().absolute() / "keys"


#: The registry (:mod:`dflash_audit.folder_registry`) of every report-key folder used here.
KEY_REGISTRY = "key-folders"


def key_dirs() -> list[Path]:
    """Every report-key folder a candidate must not read, wherever the cache is: this run's
    (:func:`key_dir`), the default cache's of every home
    (:func:`dflash_audit.folder_registry.homes`: ``$HOME``'s, the account's whatever
    ``$HOME`` says, and for root every account's), and every one an audit made or read with
    another ``$DFLASH_AUDIT_CACHE`` (the registries :data:`KEY_REGISTRY`, written by
    :func:`report_key`)."""
    from dflash_audit.folder_registry import default_caches, recorded_folders

    defaults = [(cache / "keys").absolute() for cache in default_caches()]
    return list(dict.fromkeys([key_dir(), *defaults, *recorded_folders(KEY_REGISTRY)]))


def report_key(create: bool = True) -> bytes | None:
    """The report key (32 random bytes) of this machine; created (folder 0700, file 0600,
    never overwritten) when missing and ``create``; None when missing and not ``create``.

    Raises:
        OSError: the key cannot be created or read.
    """
    from dflash_audit.folder_registry import record_folder

    path = key_dir() / KEY_FILE
    try:
        key = _read_key(path)
    except FileNotFoundError:
        if not create:
            return None
    else:
        record_folder(KEY_REGISTRY, path.parent.resolve())  # also a key older than the registry
        return key
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path.parent, 0o700)
    record_folder(KEY_REGISTRY, path.parent.resolve())  # before the key exists: hidden from then
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another process made it meanwhile
        return _read_key(path)
    with os.fdopen(fd, "wb") as f:
        f.write(os.urandom(KEY_BYTES))
    return _read_key(path)


def key_id(key: bytes) -> str:
    """The public id of a report key (the first 16 hex digits of its sha256): what a
    signature names, never the key."""
    return hashlib.sha256(key).hexdigest()[:16]


def _read_key(path: Path) -> bytes:
    """The key file's bytes: a regular file (never a symlink) of exactly :data:`KEY_BYTES`.

    Raises:
        FileNotFoundError: no key yet. OSError: a symlink, or another size (a damaged key
            signs nothing: reports made with it could be forged); the message says what to do.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        if isinstance(exc, FileNotFoundError):
            raise
        raise OSError(f"the report key {path} is not a regular file ({exc.strerror}); remove "
                      "it (a new key is made; reports signed before are then refused)") from None
    with os.fdopen(fd, "rb") as f:
        if os.fstat(f.fileno()).st_nlink != 1:  # another name, in a folder the sandbox shows
            raise OSError(f"the report key {path} has another name (a hard link): whatever "
                          "reaches that name can sign reports; remove the key and its links "
                          "(a new key is made; reports signed before are then refused)")
        key = f.read(KEY_BYTES + 1)
    if len(key) != KEY_BYTES:
        raise OSError(f"the report key {path} has {len(key)} bytes, not {KEY_BYTES}: it was "
                      "damaged; remove it (a new key is made; reports signed before are then "
                      "refused) and rerun the audit")
    return key


def _mac(report: dict[str, Any], key: bytes) -> str:
    body = {k: v for k, v in report.items() if k != SIGNATURE_FIELD}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hmac.new(key, text.encode(), hashlib.sha256).hexdigest()


def sign_report(report: dict[str, Any]) -> dict[str, Any]:
    """``report`` (a strict-JSON dict) with its ``signature`` = {"alg", "key_id", "value"}:
    HMAC-SHA256 of its canonical JSON without the signature, under :func:`report_key`.

    Raises:
        OSError: the key cannot be created or read.
    """
    key = report_key(create=True)
    return {**report, SIGNATURE_FIELD: {"alg": SIGNATURE_ALG, "key_id": key_id(key),
                                   "value": _mac(report, key)}}


def signature_problem(report: dict[str, Any]) -> str | None:
    """Why ``report`` (as read from ``report.json``) is not signed by this machine's key;
    None when the signature is valid."""
    sig = report.get(SIGNATURE_FIELD)
    if not isinstance(sig, dict) or not isinstance(sig.get("value"), str):
        return "it carries no signature (written by another tool, by hand, or by a " \
               "dflash-audit older than signed reports)"
    try:
        key = report_key(create=False)
    except OSError as exc:
        return str(exc)
    if key is None:
        return f"this machine has no report key ({key_dir() / KEY_FILE}): only a report " \
               "written here by `dflash-audit compare` is trusted"
    if sig.get("key_id") != key_id(key):
        return "it was signed with another key (another machine or cache)"
    try:
        ok = hmac.compare_digest(sig["value"], _mac(report, key))
    except (TypeError, ValueError):
        ok = False
    return None if ok else "its signature does not match its content (edited after it " \
                           "was written)"
