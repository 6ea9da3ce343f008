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
  an output not listed counts as the framework's; a key may name part of an output
  (``structure.target_layer_ids``, ``derivation.layer_types``, ``metrics.``). ``run_case``
  may also return a ``"provenance"`` entry in ``SideOutputs.metadata`` that overrides it per
  case, and ``derive_config`` one in its dict (``{field: ...}``, read as
  ``derivation.<field>``).
* ``CAPABILITIES``: what the framework can be configured to run, keys of
  :class:`dflash_audit.audit.frameworks.capabilities.Capabilities` (packed rows, layer layouts,
  block attention, verifier families, draft vocabulary, losses and mixes, weightings,
  sample_from_anchor, dtypes, target-layer rules, windows below the block, a separate draft
  head); a profile value the framework runs as its own variant is supported (the audit names
  the difference); a case outside them is "not supported by NAME VERSION: ...", never a
  failure, and the adapter's own refusals are only a guard for cases given to it directly.
* ``LATENT``: what the framework WOULD do on input it cannot express (:mod:`.latent`): one
  ``{"capability", "would", "source", "shows"}`` per capability its CAPABILITIES lack
  (``capability`` a field it lacks; ``would`` read after its label: "has no document mask:
  packed rows would leak across documents"; ``source`` ``PATH:LINE`` or ``PATH:FIRST-LAST``
  relative to its install root; ``shows`` text those lines contain). Each is a warning in
  every report format, the terminal and the conformance matrix, never a failure; a lacking
  capability left undeclared is listed as such. Malformed entries are a setup error (exit 2);
  :func:`.latent.check_sources` verifies the citations against the installed framework (a
  test per adapter: the file exists at the pinned version and the lines say what is claimed).
  The rule for what goes where: a profile value the framework runs as its own variant is
  supported (a case runs, the audit names the difference); only what it cannot express at
  all is left out of CAPABILITIES, and then described in LATENT.
* ``NAME`` and ``VERSION`` (and ``REQUIREMENTS``) as literals: the registry reads them from the
  module's source without importing the framework.
* ``REQUIREMENTS``: the pip requirements installed (``--no-deps``) into the tool's cache for
  the framework, pinned (``["specforge==0.2.0"]`` plus the few light import-time dependencies).
  REQUIREMENTS must be complete for an environment made by the README's setup alone (a
  package that happens to be installed elsewhere hides a missing one).
* ``FRAMEWORK_MODULES``: the framework modules the adapter imports (lazily, in ``run_case``
  and the other methods), as a literal list. With ``--candidate framework:NAME`` the
  candidate's process imports them when it loads, before any case; a module that cannot be
  imported there, on loading the adapter, or later inside a case is a setup error (exit 2)
  naming the module, who imports it and the fix (REQUIREMENTS, ``pip install``,
  ``--candidate-python``), never a conformance failure
  (:func:`dflash_audit.audit.frameworks.import_failure.import_failure_message`).
* ``NAME`` and ``VERSION``: the framework's display name and pinned version.
* Layer ids of a z-lab-convention framework: :func:`dflash_audit.model.layer_ids.to_zlab_ids`
  / :func:`~dflash_audit.model.layer_ids.from_zlab_ids`; recorders: :mod:`.kit`.

Hard-label trainers return ``target_ids`` [1, Q] (long: the token each slot is taught) instead
of, or besides, ``targets``.
"""
