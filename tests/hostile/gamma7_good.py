"""A candidate that changes nothing on disk (the gamma-7 candidate itself): what a later audit
runs to show that it is refused, or not, on what an earlier candidate left."""
from gamma7_base import Gamma7

candidate = Gamma7
