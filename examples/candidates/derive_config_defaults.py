"""Bug: a derived drafter config that keeps a config class's defaults instead of the verifier's
geometry.

ModelOpt 0.47 builds the draft config as ``Qwen3Config(**defaults)`` and then "setdefault"s the
verifier's ``num_attention_heads``, ``num_key_value_heads``, ``intermediate_size``,
``rms_norm_eps`` and ``max_position_embeddings`` (``hf_dflash.py: modify``); under
transformers 5 the class has already filled them (32 heads, 32 KV heads, head_dim 128, MLP
22016, eps 1e-6, 32768 positions), so none is inherited. The reference derives them all from
the verifier (speculators ``train/cli.py: create_transformer_layer_config``).

Expected audit result: ``derivation`` fails with "the drafter config does not inherit the
verifier's num_attention_heads, ... : its ... are the config class's defaults".

Run: ``dflash-audit compare --candidate examples/candidates/derive_config_defaults.py:candidate``
"""

from __future__ import annotations

from transformers import Qwen3Config

from dflash_audit.candidate import DrafterCandidate
from dflash_audit.model.derivation import derivation_fields, rederive

INHERITED = ("num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
             "rms_norm_eps", "max_position_embeddings")


class ConfigDefaultsCandidate(DrafterCandidate):
    name = "bug: derived config keeps Qwen3Config's defaults"

    def derive_config(self, verifier_config, config):
        fields = derivation_fields(rederive(verifier_config, config))
        defaults = Qwen3Config()
        for key in INHERITED:  # "setdefault" on attributes the class already filled
            fields[key] = getattr(defaults, key)
        return fields


candidate = ConfigDefaultsCandidate()
