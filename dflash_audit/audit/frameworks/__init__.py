"""Adapters that audit a training framework's own DFlash code as the candidate
(``--candidate framework:NAME[==VERSION]``): glue that drives the framework's real code and
records what it computes; what the adapter invents is marked as the adapter's.

The contract every adapter module ``dflash_audit/audit/frameworks/<name>_adapter.py`` follows
(it runs INSIDE the candidate's process, with the framework importable):

* ``candidate``: an object with the candidate protocol's ``run_case(config, loss, weights,
  inputs) -> SideOutputs`` (:mod:`dflash_audit.candidate`), and where the framework has them
  ``select_anchors(loss_mask, max_anchors, block_size, generator)`` (the framework's own
  sampler, seeded) and ``derive_config(verifier_config, config) -> dict`` (the framework's own
  drafter-config derivation, flattened like :func:`dflash_audit.model.derivation.derivation_fields`).
* ``PROVENANCE``: ``{output key or key prefix ending in ".": "framework" | "adapter"}`` -- who
  computed each output (``"grad."``, ``"mask."``, ``"loss_weights."`` cover their families);
  an output not listed counts as the framework's. ``run_case`` may also return a
  ``"provenance"`` entry in ``SideOutputs.metadata`` that overrides it per case.
* ``CAPABILITIES``: what the framework supports, keys of
  :class:`dflash_audit.audit.frameworks.capabilities.Capabilities` (packed rows, layer layouts,
  verifier families, draft vocabulary, losses, weightings, sample_from_anchor); a case outside
  them is "not supported by NAME VERSION: ...", never a failure.
* ``REQUIREMENTS``: the pip requirements installed (``--no-deps``) into the tool's cache for
  the framework, pinned (``["specforge==0.2.0"]`` plus the few light import-time dependencies).
* ``NAME`` and ``VERSION``: the framework's display name and pinned version.

Hard-label trainers return ``target_ids`` [1, Q] (long: the token each slot is taught) instead
of, or besides, ``targets``.
"""
