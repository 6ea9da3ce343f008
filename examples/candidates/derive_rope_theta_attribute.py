"""Bug: ``rope_theta`` set as a config attribute that transformers 5's rotary embedding never
reads.

Since transformers 5 the rotary embedding reads ``config.rope_parameters``; ModelOpt 0.47's
``modify`` "enforces" the verifier's RoPE with ``setattr(draft_config, "rope_theta", x)``
(``hf_dflash.py``), which leaves ``rope_parameters`` at the default: the draft layers train
with theta 10000 while the exported config.json says x. The reference derives the RoPE the
draft layers run from the verifier's ``rope_parameters`` (speculators ``train/cli.py``).

Expected audit result: ``derivation`` fails with "rope_theta set as a config attribute (...)
that transformers 5's rotary embedding never reads"; on a verifier whose theta is 10000 it
passes (nothing differs there).

Run: ``dflash-audit compare
--candidate examples/candidates/derive_rope_theta_attribute.py:candidate``
"""

from __future__ import annotations

from dflash_audit.candidate import DrafterCandidate
from dflash_audit.model.derivation import derivation_fields, rederive

DEFAULT_THETA = 10_000.0  # what a config built without rope_parameters rotates with


class RopeThetaAttributeCandidate(DrafterCandidate):
    name = "bug: rope_theta set as an attribute the rotary embedding never reads"

    def derive_config(self, verifier_config, config):
        fields = derivation_fields(rederive(verifier_config, config))
        fields["saved.rope_theta"] = fields["rope_theta"]  # the attribute; the export writes it
        fields["rope_theta"] = DEFAULT_THETA  # what the rotary embedding runs
        return fields


candidate = RopeThetaAttributeCandidate()
