"""Route 10: the candidate appends to a site-packages module that the reference imports."""
import tamper
from gamma7_base import Gamma7

tamper.attempt(tamper.poison_site_packages)
candidate = Gamma7
