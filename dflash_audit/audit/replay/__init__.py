"""What the checks' hypotheses are built from: replaying our drafter with parts replaced.

:mod:`.evidence` holds a case's evidence and the hypothesis search; :mod:`.replay` reruns our
drafter with a changed config, mask, positions or weights; :mod:`.architecture` names
differences inside the draft layers; :mod:`.loss_formulas` and :mod:`.weight_formulas` find the
loss and per-slot weight formula a candidate follows; :mod:`.noise` derives tolerances from the
reference's measured bf16 noise.
"""
