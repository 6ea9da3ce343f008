"""Route 4: the candidate edits dflash-audit's own installed source."""
import tamper
from gamma7_base import Gamma7

tamper.attempt(tamper.edit_tool)
candidate = Gamma7
