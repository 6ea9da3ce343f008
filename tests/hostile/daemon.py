"""Route 3: a daemon outside the candidate's process group edits the reference during its run."""
import tamper
from gamma7_base import Gamma7

for f in tamper.losses_utils():
    tamper.start_daemon(f)
candidate = Gamma7
