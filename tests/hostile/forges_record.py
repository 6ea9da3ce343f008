"""Route 5: a signed record of the reference cache planted while the candidate runs."""
import tamper
from gamma7_base import Gamma7

tamper.forge_record()
candidate = Gamma7
