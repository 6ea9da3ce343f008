"""Audit / training profiles: one explicit TOML file fixes every training-relevant default.

The reference has two sets of defaults (its model API and its training CLI) and z-lab a
third; which one a user means is never implicit. A profile names every field, both sides of
an audit run under the same profile, and the report records it (with its fingerprint).

File format (flat TOML, every key below; unknown keys are errors)::

    name = "reference-model"          # str, informational
    description = "..."               # str, informational
    block_size = 8                    # B, int >= 2
    gamma = 4.0                       # decay of fixed-exp-decay weights, float > 0
    loss = "kl_div"                   # kl_div | rkl | jsd | ce | tv | nla | lk_hybrid | ce-data
                                      # | JSON mix; ce-data = CE against the data tokens
                                      # input_ids[a+s] (SpecForge; the reference runs ce)
    weighting = "fixed-exp-decay"     # fixed-exp-decay | dpace | none (w_0 = 0, w_s = 1; the
                                      # reference runs fixed-exp-decay with gamma = inf)
    dpace_alpha = 0.5                 # (0, 1]
    max_anchors = 512                 # A used in training, int >= 1
    target_layers = "speculators"     # list of verifier layer ids in [0, N] (N = the last
                                      # layer, pre-norm) | "zlab" | "speculators" |
                                      # "per-draft-layer" (z-lab/SpecForge: one per draft layer)
    num_draft_layers = 1              # int >= 1
    layer_layout = "full"             # "full" | "sliding" | list of "full"/"sliding" per layer
    sliding_window = 2048             # W in tokens; required when a layer is sliding
    sliding_window_non_causal = false # bidirectional block in sliding layers
    sample_from_anchor = false
    draft_vocab_size = 32000          # optional; absent = the verifier's vocabulary
    optimizer = "muon"                # optional, informational (training): adamw | muon
    mask_token_id = 151669            # optional; absent = chosen from the verifier's tokenizer
    dtype = "bf16"                    # optional: fp32 (default) | bf16, the compute dtype of
                                      # training (bf16: fp32 master weights + bf16 autocast)

Built-in profiles live in ``dflash_audit/profiles/*.toml``; ``Profile.load`` takes a built-in
name, a TOML file, or a drafter's ``config.json`` (a speculators DFlash checkpoint config or
a z-lab DFlash config, :mod:`dflash_audit.profile_import`).
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from dflash_audit.model.config import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    ConfigError,
    DFlashConfig,
    default_target_layer_ids,
)
from dflash_audit.model.loss import WEIGHTINGS, LossSpec, parse_loss, uses_data_targets
from dflash_audit.user_input import loads_toml, not_a_file, shorten

TARGET_LAYER_STYLES = ("zlab", "speculators", "per-draft-layer")
LAYOUTS = ("full", "sliding")
OPTIMIZERS = ("adamw", "muon")
#: Compute dtypes a profile may name (``dtype``); bf16 = fp32 master weights under bf16
#: autocast, as the reference trains (speculators train/trainer.py, config/schema.py
#: ``hidden_states_dtype``).
DTYPES = ("fp32", "bf16")
_LAYER_TYPE = {"full": FULL_ATTENTION, "sliding": SLIDING_ATTENTION,
               FULL_ATTENTION: FULL_ATTENTION, SLIDING_ATTENTION: SLIDING_ATTENTION}
#: Fields that are not part of the profile's semantics (excluded from the fingerprint).
INFORMATIONAL = ("name", "description", "source", "target_layers_origin")


class ProfileError(ValueError):
    """A profile is missing, unreadable or has an invalid field; the message names the field
    and the file."""


def builtin_profiles() -> list[str]:
    """Names of the profiles shipped in ``dflash_audit/profiles``."""
    folder = resources.files("dflash_audit") / "profiles"
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".toml"))


@dataclass(frozen=True)
class Profile:
    """The defaults that define one DFlash training setup (see the module docstring)."""

    name: str
    block_size: int
    gamma: float
    loss: str
    weighting: str
    dpace_alpha: float
    max_anchors: int
    target_layers: tuple[int, ...] | str
    num_draft_layers: int
    layer_layout: tuple[str, ...] | str
    sliding_window: int | None = None
    sliding_window_non_causal: bool = False
    sample_from_anchor: bool = False
    draft_vocab_size: int | None = None
    optimizer: str | None = None
    mask_token_id: int | None = None
    dtype: str = "fp32"
    description: str = ""
    target_layers_origin: str = ""  # a drafter config's ids: read from which key, or computed how
    source: str = ""  # built-in name or file path it was read from

    def __post_init__(self) -> None:
        if isinstance(self.target_layers, list):
            object.__setattr__(self, "target_layers", tuple(self.target_layers))
        if isinstance(self.layer_layout, list):
            object.__setattr__(self, "layer_layout", tuple(self.layer_layout))
        self.validate()

    # ------------------------------------------------------------------ loading
    @classmethod
    def load(cls, name_or_path: str | Path) -> Profile:
        """A built-in profile by name (``reference-model``, ``reference-train-cli``,
        ``zlab``) or a TOML file.

        Raises:
            ProfileError: unknown name / missing file / TOML syntax error / bad field.
        """
        if str(name_or_path).endswith(".json"):
            return cls.from_drafter_config(Path(name_or_path))
        text, source = _read(str(name_or_path))
        try:
            data = loads_toml(text)
        except ValueError as exc:  # tomllib.TOMLDecodeError, nesting too deep included
            raise ProfileError(f"profile {source}: not valid TOML: {exc}") from None
        return cls.from_dict(data, source=source)

    @classmethod
    def from_drafter_config(cls, path: Path) -> Profile:
        """A profile from a drafter's ``config.json`` (speculators checkpoint or z-lab): its
        block size, target layer ids, mask token, layer types and draft vocabulary; the
        training recipe from the built-in profile of the same origin.

        Raises:
            ProfileError: unreadable or not a DFlash drafter config, or a bad field.
        """
        from dflash_audit.profile_import import RECIPE, read_drafter_config

        try:
            fmt, fields = read_drafter_config(Path(path).expanduser())
        except ValueError as exc:
            raise ProfileError(str(exc)) from None
        recipe = cls.load(RECIPE[fmt]).to_dict()
        for key in ("name", "description", "source", "sliding_window", "draft_vocab_size"):
            recipe.pop(key, None)
        data = {**recipe, **fields, "name": Path(path).parent.name or "drafter-config",
                "description": f"{fmt} drafter config {path} (recipe: {RECIPE[fmt]})"}
        return cls.from_dict({k: v for k, v in data.items() if v is not None}, source=str(path))

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "<dict>") -> Profile:
        """Build and validate a profile from the TOML keys.

        Raises:
            ProfileError: unknown or missing keys, wrong types or values (naming the field).
        """
        names = [f.name for f in dataclasses.fields(cls) if f.name != "source"]
        unknown = [k for k in data if k not in names]
        if unknown:
            hints = [f"{k!r} (did you mean {m[0]!r}?)" if (m := difflib.get_close_matches(
                k, names, n=1)) else repr(k) for k in unknown]
            raise ProfileError(f"profile {source}: unknown field(s) {', '.join(hints)}; "
                               f"allowed: {', '.join(names)}")
        required = [f.name for f in dataclasses.fields(cls)
                    if f.default is dataclasses.MISSING and f.name not in ("name",)]
        missing = [k for k in required if k not in data]
        if missing:
            raise ProfileError(f"profile {source}: missing field(s) {', '.join(missing)} "
                               "(a profile must state every training-relevant default)")
        kw = dict(data)
        kw.setdefault("name", Path(source).stem if source.endswith(".toml") else source)
        try:
            return cls(**kw, source=source)
        except ProfileError as exc:
            raise ProfileError(f"profile {source}: {exc}") from None

    # --------------------------------------------------------------- validation
    def validate(self) -> None:
        """Check every field.

        Raises:
            ProfileError: naming the field, its value and what is allowed.
        """
        def want(cond: bool, field: str, what: str) -> None:
            if not cond:
                raise ProfileError(f"field {field!r} = {shorten(repr(getattr(self, field)))}: "
                                   f"{what}")

        def is_int(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v: Any) -> bool:  # TOML reads inf / nan: no numeric field takes them
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

        want(isinstance(self.name, str) and bool(self.name), "name", "must be a non-empty string")
        want(is_int(self.block_size) and self.block_size >= 2, "block_size",
             "must be an integer >= 2")
        want(is_num(self.gamma) and self.gamma > 0, "gamma", "must be a finite number > 0")
        want(isinstance(self.loss, str), "loss", "must be a string")
        try:
            terms = parse_loss(self.loss)
        except ValueError as exc:
            raise ProfileError(f"field 'loss': {exc}") from None
        want(not {"ce", "ce-data"} <= set(terms), "loss",
             "mixes 'ce' and 'ce-data'; the reference runs 'ce' for 'ce-data', so the two "
             "terms cannot be audited apart: keep one")
        want(not uses_data_targets(self.loss) or self.draft_vocab_size is None, "loss",
             "'ce-data' teaches the data tokens (verifier ids): drop draft_vocab_size")
        want(self.weighting in WEIGHTINGS, "weighting", f"must be one of {list(WEIGHTINGS)}")
        want(is_num(self.dpace_alpha) and 0 < self.dpace_alpha <= 1, "dpace_alpha",
             "must be a finite number in (0, 1]")
        want(is_int(self.max_anchors) and self.max_anchors >= 1, "max_anchors",
             "must be an integer >= 1")
        tl = self.target_layers
        if isinstance(tl, str):
            want(tl in TARGET_LAYER_STYLES, "target_layers",
                 f"must be a list of layer ids or one of {list(TARGET_LAYER_STYLES)}")
        else:
            want(isinstance(tl, tuple) and len(tl) > 0 and all(is_int(i) and i >= 0 for i in tl),
                 "target_layers", "must be a non-empty list of non-negative integers "
                 "(speculators convention; z-lab ids are one less)")
            want(len(set(tl)) == len(tl) and list(tl) == sorted(tl), "target_layers",
                 "ids must be distinct and ascending")
        want(is_int(self.num_draft_layers) and self.num_draft_layers >= 1, "num_draft_layers",
             "must be an integer >= 1")
        lay = self.layer_layout
        if isinstance(lay, str):
            want(lay in LAYOUTS, "layer_layout",
                 f"must be one of {list(LAYOUTS)} or a list with one entry per draft layer")
        else:
            want(isinstance(lay, tuple) and all(x in _LAYER_TYPE for x in lay), "layer_layout",
                 "list entries must be 'full' or 'sliding'")
            want(len(lay) == self.num_draft_layers, "layer_layout",
                 f"has {len(lay)} entries for num_draft_layers = {self.num_draft_layers}")
        if self.sliding_window is not None:
            want(is_int(self.sliding_window) and self.sliding_window >= 1, "sliding_window",
                 "must be a positive integer (tokens)")
        want(self.sliding_window is not None or SLIDING_ATTENTION not in self.layer_types,
             "sliding_window", "is required when a layer is sliding")
        want(isinstance(self.sliding_window_non_causal, bool), "sliding_window_non_causal",
             "must be true or false")
        want(isinstance(self.sample_from_anchor, bool), "sample_from_anchor",
             "must be true or false")
        if self.draft_vocab_size is not None:
            want(is_int(self.draft_vocab_size) and self.draft_vocab_size >= 1,
                 "draft_vocab_size", "must be a positive integer (or absent for the verifier's)")
        if self.optimizer is not None:
            want(self.optimizer in OPTIMIZERS, "optimizer", f"must be one of {list(OPTIMIZERS)}")
        if self.mask_token_id is not None:
            want(is_int(self.mask_token_id) and self.mask_token_id >= 0, "mask_token_id",
                 "must be a non-negative integer (or absent)")
        want(self.dtype in DTYPES, "dtype", f"must be one of {list(DTYPES)}")

    # ------------------------------------------------------------------ derived
    @property
    def layer_types(self) -> tuple[str, ...]:
        """Attention type of every draft layer (``full_attention`` / ``sliding_attention``)."""
        lay = self.layer_layout
        if isinstance(lay, str):
            return (_LAYER_TYPE[lay],) * self.num_draft_layers
        return tuple(_LAYER_TYPE[x] for x in lay)

    @property
    def layout_name(self) -> str:
        """``full`` | ``sliding`` | ``mixed``."""
        kinds = set(self.layer_types)
        return "mixed" if len(kinds) > 1 else ("sliding" if SLIDING_ATTENTION in kinds else "full")

    def resolve_target_layer_ids(self, num_verifier_layers: int) -> list[int]:
        """Target layer ids (speculators convention) for an N-layer verifier; id N (the last
        layer's output before the final norm) is accepted, as the reference's
        ``resolve_target_layer_ids`` does (speculators 0.9.0 ``models/utils.py:99-140``).

        Raises:
            ProfileError: a style does not fit the verifier, or an id is > N.
        """
        if isinstance(self.target_layers, str):
            try:
                return default_target_layer_ids(num_verifier_layers, style=self.target_layers,
                                                num_draft_layers=self.num_draft_layers)
            except ConfigError as exc:
                raise ProfileError(f"field 'target_layers' = {self.target_layers!r}: {exc}"
                                   ) from None
        bad = [i for i in self.target_layers if i > num_verifier_layers]
        if bad:
            raise ProfileError(
                f"field 'target_layers' = {list(self.target_layers)}: ids {bad} do not exist in "
                f"a verifier with {num_verifier_layers} layers (use ids in [0, "
                f"{num_verifier_layers}], {num_verifier_layers} being the last layer's output "
                "before the final norm, or 'speculators' / 'zlab' / 'per-draft-layer')")
        return list(self.target_layers)

    def check_mask_token(self, vocab_size: int, verifier: str) -> None:
        """Refuse a ``mask_token_id`` outside a real verifier's vocabulary (a proxy's
        vocabulary is the built-in tokenizer's, so there the profile's id gives way to the
        pipeline's, as in :meth:`to_drafter_config`).

        Raises:
            ProfileError: the id is >= ``vocab_size`` and ``verifier`` is not a proxy
                (``family:NAME`` / ``proxy:...``).
        """
        proxy = verifier.startswith(("family:", "proxy:")) or verifier.endswith(".json")
        if self.mask_token_id is not None and self.mask_token_id >= vocab_size and not proxy:
            raise ProfileError(f"profile {self.source or self.name}: mask_token_id "
                               f"{self.mask_token_id} is outside verifier {verifier}'s "
                               f"vocabulary ({vocab_size} ids); use the mask token of the "
                               "checkpoint trained for this verifier, or drop the field")

    def to_drafter_config(self, verifier_config: Any, mask_token_id: int,
                          target_layer_ids: list[int] | None = None) -> DFlashConfig:
        """The drafter config of this profile for a Hugging Face verifier config.

        ``target_layer_ids`` overrides the profile's (e.g. ids already resolved by the data
        pipeline); otherwise they are resolved from the verifier's layer count. The profile's
        ``mask_token_id``, when set and inside the verifier's vocabulary, replaces
        ``mask_token_id`` (a proxy or synthetic verifier's smaller vocabulary keeps the
        given one).

        Raises:
            ProfileError: the profile does not fit the verifier (layer ids, draft vocab size).
        """
        vc = getattr(verifier_config, "text_config", None) or verifier_config
        ids = target_layer_ids or self.resolve_target_layer_ids(int(vc.num_hidden_layers))
        if self.mask_token_id is not None and self.mask_token_id < int(vc.vocab_size):
            mask_token_id = self.mask_token_id
        sliding = SLIDING_ATTENTION in self.layer_types
        try:
            return DFlashConfig.from_verifier_config(
                verifier_config, target_layer_ids=ids, mask_token_id=mask_token_id,
                num_hidden_layers=self.num_draft_layers, block_size=self.block_size,
                draft_vocab_size=self.draft_vocab_size,
                layer_types=self.layer_types if sliding else None,
                sliding_window=self.sliding_window if sliding else None,
                sliding_window_non_causal=self.sliding_window_non_causal,
                sample_from_anchor=self.sample_from_anchor)
        except ConfigError as exc:
            raise ProfileError(f"profile {self.source or self.name} does not fit the verifier: "
                               f"{exc}") from None

    def loss_spec(self) -> LossSpec:
        """The loss of this profile (divergence, weighting, gamma, D-PACE alpha)."""
        return LossSpec(loss=self.loss, weighting=self.weighting, gamma=float(self.gamma),
                        dpace_alpha=float(self.dpace_alpha))

    # ------------------------------------------------------------ serialization
    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict of every field (tuples as lists)."""
        d = dataclasses.asdict(self)
        for k in ("target_layers", "layer_layout"):
            if isinstance(d[k], tuple):
                d[k] = list(d[k])
        return d

    def semantic_dict(self) -> dict[str, Any]:
        """The fields that define training (no name / description / source); layouts are
        normalised to one entry per layer so equivalent spellings compare equal."""
        d = {k: v for k, v in self.to_dict().items() if k not in INFORMATIONAL}
        if d["mask_token_id"] is None:  # absent: fingerprints of older profiles unchanged
            del d["mask_token_id"]
        d["layer_layout"] = list(self.layer_types)
        d["gamma"], d["dpace_alpha"] = float(self.gamma), float(self.dpace_alpha)
        if d["dtype"] == "fp32":  # the default: fingerprints of fp32 profiles stay unchanged
            del d["dtype"]
        return d

    def fingerprint(self) -> str:
        """sha256 hex of the canonical JSON of :meth:`semantic_dict` (sorted keys)."""
        canonical = json.dumps(self.semantic_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()

    def replace(self, **changes: Any) -> Profile:
        """A validated copy with some fields changed."""
        return dataclasses.replace(self, **changes)


def _read(name_or_path: str) -> tuple[str, str]:
    path = Path(name_or_path).expanduser()
    if path.suffix == ".toml" or path.exists() or "/" in name_or_path:
        if not path.is_file():
            raise ProfileError(f"profile file {path} {not_a_file(path)}; give a TOML file or a "
                               f"built-in profile name ({', '.join(builtin_profiles())})")
        try:
            return path.read_text(), str(path)
        except (OSError, UnicodeDecodeError) as exc:
            raise ProfileError(f"cannot read profile {path}: {exc}") from None
    res = resources.files("dflash_audit") / "profiles" / f"{name_or_path}.toml"
    if not res.is_file():
        close = difflib.get_close_matches(name_or_path, builtin_profiles(), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ProfileError(f"unknown profile {name_or_path!r}{hint}; built-in profiles: "
                           f"{', '.join(builtin_profiles())}, or pass a TOML file or a drafter "
                           "config.json (speculators or z-lab) path")
    return res.read_text(), name_or_path
