"""Stage 2 of a compare: the two sides run the cases.

:mod:`.run_sides` resolves the reference and runs both sides one after the other
(:mod:`.import_check` proves first, in the background, that the reference imports);
:mod:`.candidate_process` starts the candidate in its own process, which runs
:mod:`.candidate_runner` (:mod:`.raised` names a candidate that raised); the reference runs in
its own process from ``reference/adapter.py`` (:mod:`dflash_audit.reference_source.runner`).
:mod:`.canary` stages the small case that ``train`` reruns after a PASS.
"""
