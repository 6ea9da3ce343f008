"""Bug: a drafter-config derivation that raises on nested per-layer-type ``rope_parameters``.

Gemma3-style verifiers nest ``rope_parameters`` per layer type (``{"full_attention": {...},
"sliding_attention": {...}}``); SpecForge copies the nested dict into its draft config, whose
rotary embedding then fails with ``KeyError: 'rope_type'``. The reference takes the
``sliding_attention`` entry (speculators ``train/cli.py``).

Expected audit result: ``derivation`` fails with "derive_config raised KeyError: 'rope_type'"
on the verifiers with nested RoPE (gemma3_text), and passes on the others.

Run: ``dflash-audit compare --candidate examples/candidates/derive_config_raises.py:candidate``
"""

from __future__ import annotations

from dflash_audit.candidate import DrafterCandidate


class DeriveConfigRaisesCandidate(DrafterCandidate):
    name = "bug: derive_config raises on nested rope_parameters"

    def derive_config(self, verifier_config, config):
        vc = getattr(verifier_config, "text_config", None) or verifier_config
        rope = getattr(vc, "rope_parameters", None) or {}
        if isinstance(rope, dict) and any(isinstance(v, dict) for v in rope.values()):
            rope["rope_type"]  # noqa: B018 - the nested dict has no top-level rope_type
        return super().derive_config(verifier_config, config)


candidate = DeriveConfigRaisesCandidate()
