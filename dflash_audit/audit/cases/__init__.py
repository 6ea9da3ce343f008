"""Stage 1 of a compare: the cases both sides run on.

:mod:`.plan` chooses them (real rows under each audited layout, plus a seeded spread of
synthetic ones over the verifier families); :mod:`.real_inputs` captures and caches the real
batches, :mod:`.synthetic` builds the synthetic ones, :mod:`.weights` and
:mod:`.user_weights` give each case the drafter weights both sides load.
"""
