"""``dflash-audit check-batches``: audit a user's batch files against a recomputation.

A drafter trained on wrongly captured batches passes ``compare`` (which captures its own
batches); this package checks the user's files. Modules, one job each (imports point down):

- ``files``      read a batch folder: ours (``batch_*.safetensors``) or the reference's offline
                 format (Arrow rows + ``hidden_states/hs_{i}.safetensors``) into :class:`Row`s
- ``recompute``  every verifier layer's output for a row, in the files' dtype (per document,
                 or over the packed row), and the noise that sets the tolerances
- ``layers``     each captured slice and the last state against every layer (names the layer)
- ``capture_attention``  a slice that equals no layer per document, examined for a capture
                 over the packed row with a causal mask across documents
- ``loss_mask``  ``loss_mask`` against the chat template's assistant spans (names the shift /
                 the wrong role)
- ``layout``     ``position_ids`` / ``document_ids`` / padding conventions of packed rows
- ``ids``        the mask token and the target layer ids against the drafter that will read them
- ``result``     :class:`Check` and :class:`BatchReport` (verdict, exit code)
- ``report``     json / md / html / junit writers
- ``run``        ``run_check_batches``: every check on sampled rows -> :class:`BatchReport`
- ``command``    the CLI command (no torch until it runs)
"""
