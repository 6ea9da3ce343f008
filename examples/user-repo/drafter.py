"""A user's repository in its smallest form: this drafter file and the workflow
``.github/workflows/dflash-audit.yml`` (the README's "Gate your own repository").

The drafter keeps the reference's parameter names, so it subclasses dflash-audit's own and
changes nothing: the gate passes. Override ``build(config)`` to return your own module (see
``examples/candidates/``) and the gate audits that instead.
"""

from dflash_audit.candidate import DrafterCandidate


class MyDrafter(DrafterCandidate):
    name = "my drafter"


candidate = MyDrafter()
