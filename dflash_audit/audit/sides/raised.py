"""Naming the cause of a candidate that raised: the shapes in the exception's message read
against the case's config.

Works on the exception's text (``"ValueError: hidden_states has 1152 features, fc expects
1728"``, torch's ``"mat1 and mat2 shapes cannot be multiplied (64x1152 and 1728x576)"``), not on
the live exception, so the same naming applies to the stderr tail of a candidate run in its own
process. The raise stays a conformance failure; this only says why.
"""

from __future__ import annotations

import re

#: "<got> features ... expects <want>" in either order of words, e.g. "hidden_states has 1152
#: features, fc expects 1728" / "expected 1728 features, got 1152".
_GOT_WANT = (
    re.compile(r"(?:has|got|received|with)\s+(\d+)\s+(?:features|channels|columns)\b.*?"
               r"expect(?:s|ed)?\s+(\d+)", re.I | re.S),
    re.compile(r"expect(?:s|ed)?\s+(\d+)\s+(?:features|channels|columns|input features)\b.*?"
               r"(?:got|has|received|but)\s+(\d+)", re.I | re.S),
)
#: torch's F.linear: "(rows x in) and (fc_in x fc_out)" (mat2 is weight.T).
_MATMUL = re.compile(r"mat1 and mat2 shapes cannot be multiplied \((\d+)x(\d+) and (\d+)x(\d+)\)")


def _got_want(text: str) -> tuple[int, int] | None:
    """(features the candidate passed, features the layer expects) from an error message."""
    m = _MATMUL.search(text)
    if m:
        return int(m.group(2)), int(m.group(3))
    for i, pattern in enumerate(_GOT_WANT):
        m = pattern.search(text)
        if m:
            a, b = int(m.group(1)), int(m.group(2))
            return (a, b) if i == 0 else (b, a)
    return None


def name_raise(text: str, config) -> list[str]:
    """Causes of a raise whose message ``text`` names two feature counts.

    Args:
        text: the exception's ``"Type: message"`` (or a stderr tail holding it).
        config: the case's :class:`dflash_audit.model.config.DFlashConfig` (hidden_size H,
            target_layer_ids: n = num_target_layers slices of H in hidden_states).

    Returns:
        e.g. ["fc expects 3 target layers (1728 = 3*H features, H = 576), the candidate passed
        2 (1152 features): a target-layer slice is dropped before fc (e.g. the last one,
        hidden_states[..., :(n-1)*H])"], or [] when the message names no feature counts that
        read as target-layer slices.
    """
    pair = _got_want(text)
    if pair is None:
        return []
    got, want = pair
    H, n = config.hidden_size, config.num_target_layers
    if got % H or want % H or got == want:
        return []
    k, m = got // H, want // H
    head = (f"fc expects {m} target layers ({want} = {m}*H features, H = {H}), the candidate "
            f"passed {k} ({got} features)")
    if m == n and k < n:
        return [f"{head}: {n - k} target-layer slice(s) dropped before fc (e.g. the last one, "
                f"hidden_states[..., :{k}*H]); the reference concatenates all {n} target layers "
                f"{list(config.target_layer_ids)}"]
    if k == n and m != n:
        return [f"{head}: fc built for {m} target layers where hidden_states holds all {n} "
                f"({list(config.target_layer_ids)}); the reference's fc is Linear({n}*H, H)"]
    return [f"{head}: the reference's fc reads all {n} target layers (Linear({n}*H, H))"]
