"""The kit's helpers added for NeMo Automodel and shared with the other adapters: packing
metadata from document_ids, a function's locals at its return, a framework sampler's
anchors padded to A, signature defaults, the light import of a package's modules."""

from __future__ import annotations

import sys

import pytest
import torch

from dflash_audit.audit.frameworks import kit
from dflash_audit.audit.frameworks.light_import import skip_package_inits


def test_packing_metadata_folds_padding_into_the_last_document():
    got = kit.packing_metadata(torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, -1, -1]]))
    assert got["seq_lens"].tolist() == [[3, 2, 5]]
    assert got["cu_seqlens"].tolist() == [0, 3, 5, 10]
    assert got["doc_remaining"].tolist() == [[2, 1, 0, 1, 0, 2, 1, 0, 0, 0]]
    with pytest.raises(ValueError, match="not contiguous"):
        kit.packing_metadata(torch.tensor([[0, 1, 0]]))


def test_record_locals_reads_a_local_at_return():
    def loss(x):
        weights = x * 2
        return weights.sum()

    with kit.record_locals(loss, ("weights", "absent")) as seen:
        loss(torch.ones(3))
        loss(torch.zeros(2))
    assert [r["weights"].tolist() for r in seen] == [[2.0, 2.0, 2.0], [0.0, 0.0]]
    assert "absent" not in seen[0] and sys.getprofile() is None


def test_sampled_anchors_pads_and_maps_no_anchor_to_none():
    pos, valid = kit.sampled_anchors(lambda: (torch.tensor([[3, 7]]), torch.tensor([[1, 1]])),
                                     4, torch.Generator().manual_seed(0))
    assert pos.tolist() == [3, 7, 0, 0] and valid.tolist() == [True, True, False, False]

    def nothing():
        raise LookupError("no anchor")

    assert not kit.sampled_anchors(nothing, 2, torch.Generator(), LookupError)[1].any()


def test_signature_defaults_and_refusal():
    def trainer(block_size=16, loss_decay_gamma=None):
        return block_size, loss_decay_gamma

    assert kit.signature_defaults(trainer, block_size="block_size",
                                  gamma="loss_decay_gamma") == {
        "block_size": 16, "gamma": None, "weighting": "none"}


def test_skip_package_inits_imports_a_module_without_its_package_init(tmp_path, monkeypatch):
    pkg = tmp_path / "heavy_fw" / "dflash"
    pkg.mkdir(parents=True)
    (tmp_path / "heavy_fw" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("raise ImportError('heavy init ran')\n")
    (pkg / "core.py").write_text("VALUE = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    skip_package_inits("heavy_fw.dflash")
    import importlib

    assert importlib.import_module("heavy_fw.dflash.core").VALUE == 3
    for name in ("heavy_fw.dflash.core", "heavy_fw.dflash", "heavy_fw"):
        sys.modules.pop(name, None)


def test_local_wheel_requirements_resolve_against_the_adapter_folder(tmp_path):
    from dflash_audit.audit.frameworks.install import local_requirements

    got = local_requirements(["dist/fw-1.0-py3-none-any.whl", "torch==2.13.0",
                              "/abs/fw.whl"], tmp_path)
    assert got == [str(tmp_path / "dist/fw-1.0-py3-none-any.whl"), "torch==2.13.0",
                   "/abs/fw.whl"]


def code_lines(path) -> int:
    """Lines of code: not blank, not a comment, not inside a docstring."""
    import ast

    source = path.read_text()
    docs: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and isinstance(
                getattr(body[0], "value", None), ast.Constant) and isinstance(
                body[0].value.value, str):
            docs.update(range(body[0].lineno, body[0].end_lineno + 1))
    return sum(1 for i, line in enumerate(source.splitlines(), 1)
               if line.strip() and not line.strip().startswith("#") and i not in docs)


def test_an_adapter_of_nemos_kind_is_at_most_120_lines_of_code():
    """Issue 30 item 4: with the kit, NeMo's whole adapter (its LATENT aside, a declaration
    like CAPABILITIES) fits in 120 lines of code."""
    from pathlib import Path

    import dflash_audit.audit.frameworks.nemo_adapter as nemo

    n = code_lines(Path(nemo.__file__))
    assert 80 < n <= 120, n
